"""Requests that take effect once: eec_start_request

One row per request from outside that must start a run (or send a signal) once however often
it is sent: an HTTP start with an ``Idempotency-Key`` (scope ``api:<workflow>``), a webhook's
delivery (scope ``hook:<name>``). Written in the transaction of the run (or signal) it made,
so neither exists without the other; its primary key makes a repeat, even a concurrent one,
find the first request's run. Pruned with that run.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "eec_start_request",
        sa.Column("scope", sa.String(210), primary_key=True),
        sa.Column("key", sa.String(200), primary_key=True),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("workflow_id", sa.String(200), nullable=False),
        sa.Column("signal_id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
    )
    op.create_index("eec_start_request_run", "eec_start_request", ["run_id"])


def downgrade() -> None:
    op.drop_index("eec_start_request_run", table_name="eec_start_request")
    op.drop_table("eec_start_request")
