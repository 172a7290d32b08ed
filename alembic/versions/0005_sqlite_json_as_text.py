"""JSON columns as TEXT on SQLite, so numbers round-trip exactly

A column declared JSON has NUMERIC affinity in SQLite, which converts a bare number on the way
in (2**64 + 1 became a REAL, 1.0 became 1, -0.0 became 0). PostgreSQL keeps JSONB: nothing
changes there.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 12:00:00
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

#: Every JSON column, by table.
JSON_COLUMNS: dict[str, tuple[str, ...]] = {
    "eec_workflow_definition": ("spec",),
    "eec_workflow_run": ("state", "input", "output", "error"),
    "eec_workflow_step_attempt": ("args", "heartbeat_details", "output", "error", "patch"),
    "eec_workflow_outbox": ("payload",),
    "eec_workflow_signal": ("payload",),
    "eec_workflow_control": ("input",),
}


def _retype(old: sa.types.TypeEngine[Any], new: sa.types.TypeEngine[Any]) -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    for table, columns in JSON_COLUMNS.items():
        # SQLite cannot alter a column's type: batch mode copies the table (rows, indexes).
        with op.batch_alter_table(table, recreate="always") as batch:
            for column in columns:
                batch.alter_column(column, type_=new, existing_type=old)


def upgrade() -> None:
    _retype(sa.JSON(), sa.Text())


def downgrade() -> None:
    _retype(sa.Text(), sa.JSON())
