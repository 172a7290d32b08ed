"""The run's trace context (W3C traceparent), so every tick and attempt joins its trace

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 02:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("eec_workflow_run") as batch:
        batch.add_column(sa.Column("trace_context", sa.String(200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("eec_workflow_run") as batch:
        batch.drop_column("trace_context")
