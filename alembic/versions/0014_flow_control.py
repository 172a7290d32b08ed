"""Flow control: rate limits (eec_rate_bucket, each attempt's bucket), run concurrency
(eec_run_slot) and priorities (``priority`` on runs and attempts)

``RateLimit("N/s", key=...)`` on a step: an attempt row carries the bucket it takes a token
from when a worker claims it (``rate_key``, ``rate_limit``, ``rate_period``), and
``rate_wait_since`` while it waits for one with no message out; the partial index lists each
key's waiters. ``eec_rate_bucket`` holds each key's GCRA state. ``eec_run_slot`` has a row per
run of a workflow with ``RunConcurrency`` from its first tick to its end: holding a slot of its
key, or waiting for one. ``priority`` (0..9) orders waiters, higher first (docs/flow-control.md).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-03 22:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

WAITING = "rate_wait_since IS NOT NULL AND finished_at IS NULL"


def upgrade() -> None:
    with op.batch_alter_table("eec_workflow_step_attempt", schema=None) as batch_op:
        batch_op.add_column(sa.Column("rate_key", sa.String(500), nullable=True))
        batch_op.add_column(sa.Column("rate_limit", sa.Integer, nullable=True))
        batch_op.add_column(sa.Column("rate_period", sa.Float, nullable=True))
        batch_op.add_column(sa.Column("rate_wait_since", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(
            sa.Column("rate_released_at", sa.DateTime(timezone=True), nullable=True)
        )
        batch_op.add_column(
            sa.Column("priority", sa.SmallInteger, nullable=False, server_default="0")
        )
    with op.batch_alter_table("eec_workflow_run", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("priority", sa.SmallInteger, nullable=False, server_default="0")
        )
    op.create_index(
        "eec_workflow_step_attempt_rate_wait",
        "eec_workflow_step_attempt",
        ["rate_key", "created_at"],
        postgresql_where=sa.text(WAITING),
        sqlite_where=sa.text(WAITING),
    )
    op.create_table(
        "eec_rate_bucket",
        sa.Column("key", sa.String(500), primary_key=True),
        sa.Column("tat", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )

    op.create_table(
        "eec_run_slot",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer, "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("run_id", sa.String(64), nullable=False, unique=True),
        sa.Column("key", sa.String(500), nullable=False),
        sa.Column("slot_limit", sa.Integer, nullable=False),
        sa.Column("priority", sa.SmallInteger, nullable=False, server_default="0"),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("granted_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("eec_run_slot_key", "eec_run_slot", ["key", "granted_at"])


def downgrade() -> None:
    op.drop_index("eec_run_slot_key", table_name="eec_run_slot")
    op.drop_table("eec_run_slot")
    with op.batch_alter_table("eec_workflow_run", schema=None) as batch_op:
        batch_op.drop_column("priority")
    op.drop_table("eec_rate_bucket")
    op.drop_index("eec_workflow_step_attempt_rate_wait", table_name="eec_workflow_step_attempt")
    with op.batch_alter_table("eec_workflow_step_attempt", schema=None) as batch_op:
        batch_op.drop_column("priority")
        batch_op.drop_column("rate_released_at")
        batch_op.drop_column("rate_wait_since")
        batch_op.drop_column("rate_period")
        batch_op.drop_column("rate_limit")
        batch_op.drop_column("rate_key")
