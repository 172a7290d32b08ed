"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-29 09:03:15.009305
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:

    op.create_table(
        "eec_workflow_definition",
        sa.Column("spec_hash", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column(
            "spec",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("spec_hash"),
    )
    with op.batch_alter_table("eec_workflow_definition", schema=None) as batch_op:
        batch_op.create_index(
            "eec_workflow_definition_name_version", ["name", "version"], unique=False
        )

    op.create_table(
        "eec_workflow_outbox",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=20), nullable=False),
        sa.Column("task", sa.String(length=200), nullable=False),
        sa.Column("queue", sa.String(length=200), nullable=True),
        sa.Column(
            "payload",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("eec_workflow_outbox", schema=None) as batch_op:
        batch_op.create_index("eec_workflow_outbox_created", ["created_at"], unique=False)

    op.create_table(
        "eec_workflow_step_attempt",
        sa.Column("token", sa.String(length=300), nullable=False),
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("node", sa.String(length=200), nullable=False),
        sa.Column("branch", sa.Integer(), nullable=True),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("step", sa.String(length=200), nullable=False),
        sa.Column("queue", sa.String(length=200), nullable=True),
        sa.Column(
            "args",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("timeout", sa.Float(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("claimed_by", sa.String(length=200), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("outcome", sa.String(length=20), nullable=True),
        sa.Column(
            "output",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column(
            "error",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column("retryable", sa.Boolean(), nullable=True),
        sa.Column(
            "patch",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column("folded", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.PrimaryKeyConstraint("token"),
    )
    with op.batch_alter_table("eec_workflow_step_attempt", schema=None) as batch_op:
        batch_op.create_index(
            "eec_workflow_step_attempt_run_node", ["run_id", "node"], unique=False
        )
        batch_op.create_index(
            "eec_workflow_step_attempt_unfolded",
            ["run_id"],
            unique=False,
            postgresql_where=sa.text("finished_at IS NOT NULL AND NOT folded"),
            sqlite_where=sa.text("finished_at IS NOT NULL AND NOT folded"),
        )

    op.create_table(
        "eec_workflow_timer",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("fire_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("woken_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("run_id"),
    )
    with op.batch_alter_table("eec_workflow_timer", schema=None) as batch_op:
        batch_op.create_index("eec_workflow_timer_fire_at", ["fire_at"], unique=False)

    op.create_table(
        "eec_workflow_transition",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(length=200), nullable=True),
        sa.Column("from_status", sa.String(length=20), nullable=True),
        sa.Column("to_status", sa.String(length=20), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "seq"),
    )
    op.create_table(
        "eec_workflow_run",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("workflow_id", sa.String(length=200), nullable=False),
        sa.Column("workflow", sa.String(length=200), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("spec_hash", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column(
            "state",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column(
            "input",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column(
            "output",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column(
            "error",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column("record_version", sa.Integer(), server_default="0", nullable=False),
        sa.Column("transition_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("parent_run_id", sa.String(length=64), nullable=True),
        sa.Column("continued_from", sa.String(length=64), nullable=True),
        sa.Column("continued_to", sa.String(length=64), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["spec_hash"], ["eec_workflow_definition.spec_hash"], name="eec_workflow_run_spec_fk"
        ),
        sa.PrimaryKeyConstraint("run_id"),
    )
    with op.batch_alter_table("eec_workflow_run", schema=None) as batch_op:
        batch_op.create_index(
            "eec_workflow_run_open_workflow_id",
            ["workflow_id"],
            unique=True,
            postgresql_where=sa.text("status IN ('pending', 'running', 'paused')"),
            sqlite_where=sa.text("status IN ('pending', 'running', 'paused')"),
        )
        batch_op.create_index(
            "eec_workflow_run_status_created", ["status", "created_at"], unique=False
        )
        batch_op.create_index(
            "eec_workflow_run_workflow_created", ["workflow", "created_at"], unique=False
        )
        batch_op.create_index(
            "eec_workflow_run_workflow_id_created", ["workflow_id", "created_at"], unique=False
        )


def downgrade() -> None:

    with op.batch_alter_table("eec_workflow_run", schema=None) as batch_op:
        batch_op.drop_index("eec_workflow_run_workflow_id_created")
        batch_op.drop_index("eec_workflow_run_workflow_created")
        batch_op.drop_index("eec_workflow_run_status_created")
        batch_op.drop_index(
            "eec_workflow_run_open_workflow_id",
            postgresql_where=sa.text("status IN ('pending', 'running', 'paused')"),
            sqlite_where=sa.text("status IN ('pending', 'running', 'paused')"),
        )

    op.drop_table("eec_workflow_run")
    op.drop_table("eec_workflow_transition")
    with op.batch_alter_table("eec_workflow_timer", schema=None) as batch_op:
        batch_op.drop_index("eec_workflow_timer_fire_at")

    op.drop_table("eec_workflow_timer")
    with op.batch_alter_table("eec_workflow_step_attempt", schema=None) as batch_op:
        batch_op.drop_index(
            "eec_workflow_step_attempt_unfolded",
            postgresql_where=sa.text("finished_at IS NOT NULL AND NOT folded"),
            sqlite_where=sa.text("finished_at IS NOT NULL AND NOT folded"),
        )
        batch_op.drop_index("eec_workflow_step_attempt_run_node")

    op.drop_table("eec_workflow_step_attempt")
    with op.batch_alter_table("eec_workflow_outbox", schema=None) as batch_op:
        batch_op.drop_index("eec_workflow_outbox_created")

    op.drop_table("eec_workflow_outbox")
    with op.batch_alter_table("eec_workflow_definition", schema=None) as batch_op:
        batch_op.drop_index("eec_workflow_definition_name_version")

    op.drop_table("eec_workflow_definition")
