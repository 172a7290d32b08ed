"""scatter branches, child runs, concurrency leases, coalesced wake-ups

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29 12:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_OPEN_LEASED = "lease_key IS NOT NULL AND finished_at IS NULL"
_HAS_PARENT = "parent_run_id IS NOT NULL"


def upgrade() -> None:
    op.create_table(
        "eec_concurrency_lease",
        sa.Column("key", sa.String(length=500), nullable=False),
        sa.Column("slot", sa.Integer(), nullable=False),
        sa.Column("token", sa.String(length=300), nullable=False),
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("node", sa.String(length=200), nullable=False),
        sa.Column("granted_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("key", "slot"),
        sa.UniqueConstraint("token"),
    )
    op.create_table(
        "eec_workflow_wake",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("run_id"),
    )
    with op.batch_alter_table("eec_workflow_step_attempt", schema=None) as batch_op:
        batch_op.add_column(sa.Column("lease_key", sa.String(length=500), nullable=True))
        batch_op.add_column(sa.Column("lease_limit", sa.Integer(), nullable=True))
        batch_op.create_index(
            "eec_workflow_step_attempt_lease_wait",
            ["lease_key", "created_at"],
            unique=False,
            postgresql_where=sa.text(_OPEN_LEASED),
            sqlite_where=sa.text(_OPEN_LEASED),
        )
    with op.batch_alter_table("eec_workflow_run", schema=None) as batch_op:
        batch_op.add_column(sa.Column("parent_node", sa.String(length=200), nullable=True))
        batch_op.create_index(
            "eec_workflow_run_parent",
            ["parent_run_id"],
            unique=False,
            postgresql_where=sa.text(_HAS_PARENT),
            sqlite_where=sa.text(_HAS_PARENT),
        )


def downgrade() -> None:
    with op.batch_alter_table("eec_workflow_run", schema=None) as batch_op:
        batch_op.drop_index("eec_workflow_run_parent")
        batch_op.drop_column("parent_node")
    with op.batch_alter_table("eec_workflow_step_attempt", schema=None) as batch_op:
        batch_op.drop_index("eec_workflow_step_attempt_lease_wait")
        batch_op.drop_column("lease_limit")
        batch_op.drop_column("lease_key")
    op.drop_table("eec_workflow_wake")
    op.drop_table("eec_concurrency_lease")
