"""Cooperative cancel: an attempt row says when its run's cancel was requested

The cancel's tick sets ``cancel_requested_at`` on every open attempt of the run; the worker's
heartbeat (and claim) reads it back in the same statement, so the step learns of the cancel
without another round trip (``ctx.cancelled``, ``StepCancelled``).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 02:45:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("eec_workflow_step_attempt", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("cancel_requested_at", sa.DateTime(timezone=True), nullable=True)
        )


def downgrade() -> None:
    with op.batch_alter_table("eec_workflow_step_attempt", schema=None) as batch_op:
        batch_op.drop_column("cancel_requested_at")
