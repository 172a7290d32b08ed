"""An index for the runs list: newest first, with a keyset cursor on (created_at, run_id)

``list_runs`` (and the console's runs page) reads ``ORDER BY created_at DESC, run_id DESC``
and continues after a cursor; without a filter nothing else indexes that order, so every page
would sort the whole table.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 02:00:00
"""

from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("eec_workflow_run_created_run_id", "eec_workflow_run", ["created_at", "run_id"])


def downgrade() -> None:
    op.drop_index("eec_workflow_run_created_run_id", table_name="eec_workflow_run")
