"""The audit log: who did what (eec_audit), and where a control came from

Every action that took effect on runs (a start, a control the tick applied, a signal, an
approval, a schedule written, a prune) is a row of ``eec_audit``, written in the transaction
of what it records. A control row gains ``source`` (api, cli, web, bulk, schedule, parent),
which the tick that applies it copies into its entry with ``requested_by``.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03 12:50:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # As 0005 left every JSON column: JSONB on PostgreSQL, exact TEXT on SQLite.
    sqlite = op.get_bind().dialect.name == "sqlite"
    json_type = sa.Text() if sqlite else postgresql.JSONB(astext_type=sa.Text())
    with op.batch_alter_table("eec_workflow_control", schema=None) as batch_op:
        batch_op.add_column(sa.Column("source", sa.String(20), nullable=True))
    op.create_table(
        "eec_audit",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer, "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("actor", sa.String(200), nullable=True),
        sa.Column("action", sa.String(20), nullable=False),
        sa.Column("run_id", sa.String(64), nullable=True),
        sa.Column("workflow_id", sa.String(200), nullable=True),
        sa.Column("node", sa.String(200), nullable=True),
        sa.Column("detail", json_type, nullable=True),
        sa.Column("source", sa.String(20), nullable=False),
    )
    op.create_index("eec_audit_run", "eec_audit", ["run_id", "id"])
    op.create_index("eec_audit_workflow_id", "eec_audit", ["workflow_id", "id"])
    op.create_index("eec_audit_at", "eec_audit", ["at"])


def downgrade() -> None:
    op.drop_index("eec_audit_at", table_name="eec_audit")
    op.drop_index("eec_audit_workflow_id", table_name="eec_audit")
    op.drop_index("eec_audit_run", table_name="eec_audit")
    op.drop_table("eec_audit")
    with op.batch_alter_table("eec_workflow_control", schema=None) as batch_op:
        batch_op.drop_column("source")
