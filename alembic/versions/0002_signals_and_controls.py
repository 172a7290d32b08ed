"""signals and controls

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 09:49:49.415664
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:

    op.create_table(
        "eec_workflow_control",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=20), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("requested_by", sa.String(length=200), nullable=True),
        sa.Column(
            "input",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column("has_input", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("handled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("result", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("eec_workflow_control", schema=None) as batch_op:
        batch_op.create_index(
            "eec_workflow_control_unhandled",
            ["run_id", "id"],
            unique=False,
            postgresql_where=sa.text("handled_at IS NULL"),
            sqlite_where=sa.text("handled_at IS NULL"),
        )

    op.create_table(
        "eec_workflow_signal",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("workflow_id", sa.String(length=200), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column(
            "payload",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column("idempotency_key", sa.String(length=200), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("applied_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("applied_to", sa.String(length=200), nullable=True),
        sa.Column("applied_version", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("eec_workflow_signal", schema=None) as batch_op:
        batch_op.create_index(
            "eec_workflow_signal_idempotency",
            ["workflow_id", "idempotency_key"],
            unique=True,
            postgresql_where=sa.text("idempotency_key IS NOT NULL"),
            sqlite_where=sa.text("idempotency_key IS NOT NULL"),
        )
        batch_op.create_index(
            "eec_workflow_signal_unapplied",
            ["run_id", "id"],
            unique=False,
            postgresql_where=sa.text("applied_at IS NULL"),
            sqlite_where=sa.text("applied_at IS NULL"),
        )


def downgrade() -> None:

    with op.batch_alter_table("eec_workflow_signal", schema=None) as batch_op:
        batch_op.drop_index(
            "eec_workflow_signal_unapplied",
            postgresql_where=sa.text("applied_at IS NULL"),
            sqlite_where=sa.text("applied_at IS NULL"),
        )
        batch_op.drop_index(
            "eec_workflow_signal_idempotency",
            postgresql_where=sa.text("idempotency_key IS NOT NULL"),
            sqlite_where=sa.text("idempotency_key IS NOT NULL"),
        )

    op.drop_table("eec_workflow_signal")
    with op.batch_alter_table("eec_workflow_control", schema=None) as batch_op:
        batch_op.drop_index(
            "eec_workflow_control_unhandled",
            postgresql_where=sa.text("handled_at IS NULL"),
            sqlite_where=sa.text("handled_at IS NULL"),
        )

    op.drop_table("eec_workflow_control")
