"""heartbeat details

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 11:07:51.825576
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:

    with op.batch_alter_table("eec_workflow_step_attempt", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "heartbeat_details",
                sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
                nullable=True,
            )
        )


def downgrade() -> None:

    with op.batch_alter_table("eec_workflow_step_attempt", schema=None) as batch_op:
        batch_op.drop_column("heartbeat_details")
