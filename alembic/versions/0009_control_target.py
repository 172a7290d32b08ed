"""What a redrive or continue-as-new control aims at: the node a redrive reruns from, and the
definition a continue-as-new moves the run to

Both NULL on every other control (and on every row written before them): a plain redrive, a
continue-as-new on the run's own definition.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 02:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("eec_workflow_control", schema=None) as batch_op:
        batch_op.add_column(sa.Column("node", sa.String(200), nullable=True))
        batch_op.add_column(sa.Column("spec_hash", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("eec_workflow_control", schema=None) as batch_op:
        batch_op.drop_column("spec_hash")
        batch_op.drop_column("node")
