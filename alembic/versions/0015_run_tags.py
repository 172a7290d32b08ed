"""Run tags (search attributes): eec_run_tag, and the tags an attempt set

``eec_run_tag`` has one row per (run, key) with its value, 1..100 characters each, at most 20
per run; the index ``(key, value, run_id)`` serves ``list_runs(tags=...)``. An attempt row
carries the tags its step set with ``ctx.tag`` (``tags``, JSON) until the tick that folds a
succeeded outcome applies them (docs/tags.md).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-04 04:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # As 0005 left every JSON column: JSONB on PostgreSQL, exact TEXT on SQLite.
    sqlite = op.get_bind().dialect.name == "sqlite"
    json_type = sa.Text() if sqlite else postgresql.JSONB(astext_type=sa.Text())
    with op.batch_alter_table("eec_workflow_step_attempt", schema=None) as batch_op:
        batch_op.add_column(sa.Column("tags", json_type, nullable=True))
    op.create_table(
        "eec_run_tag",
        sa.Column("run_id", sa.String(64), primary_key=True),
        sa.Column("key", sa.String(100), primary_key=True),
        sa.Column("value", sa.String(100), nullable=False),
    )
    op.create_index("eec_run_tag_key_value", "eec_run_tag", ["key", "value", "run_id"])


def downgrade() -> None:
    op.drop_index("eec_run_tag_key_value", table_name="eec_run_tag")
    op.drop_table("eec_run_tag")
    with op.batch_alter_table("eec_workflow_step_attempt", schema=None) as batch_op:
        batch_op.drop_column("tags")
