"""Schedules (one row per schedule, fired by the sweeper) and the indexes prune reads by

Prune deletes finished runs by ``finished_at`` and their signals and controls by run id:
without these indexes each batch would scan those tables.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 02:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # As 0005 left every JSON column: JSONB on PostgreSQL, exact TEXT on SQLite.
    sqlite = op.get_bind().dialect.name == "sqlite"
    json_type = sa.Text() if sqlite else JSONB(astext_type=sa.Text())
    op.create_table(
        "eec_workflow_schedule",
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("workflow", sa.String(200), nullable=False),
        sa.Column("cron", sa.String(200), nullable=True),
        sa.Column("every", sa.Float, nullable=True),
        sa.Column("timezone", sa.String(64), nullable=False),
        sa.Column("input", json_type, nullable=True),
        sa.Column("overlap", sa.String(20), nullable=False),
        sa.Column("catchup_window", sa.Float, nullable=False),
        sa.Column("paused", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("next_fire_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("buffered_fire_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_workflow_id", sa.String(200), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
    )
    op.create_index("eec_workflow_schedule_next_fire", "eec_workflow_schedule", ["next_fire_at"])
    op.create_index(
        "eec_workflow_run_finished",
        "eec_workflow_run",
        ["finished_at"],
        postgresql_where=sa.text("finished_at IS NOT NULL"),
        sqlite_where=sa.text("finished_at IS NOT NULL"),
    )
    op.create_index("eec_workflow_signal_run", "eec_workflow_signal", ["run_id"])
    op.create_index("eec_workflow_control_run", "eec_workflow_control", ["run_id"])


def downgrade() -> None:
    op.drop_index("eec_workflow_control_run", table_name="eec_workflow_control")
    op.drop_index("eec_workflow_signal_run", table_name="eec_workflow_signal")
    op.drop_index("eec_workflow_run_finished", table_name="eec_workflow_run")
    op.drop_index("eec_workflow_schedule_next_fire", table_name="eec_workflow_schedule")
    op.drop_table("eec_workflow_schedule")
