"""The run state compressed with lz4, where the PostgreSQL server has it

Every tick writes a new version of the run row, its state (every node of the run) included.
PostgreSQL compresses a row's large values once the row passes its TOAST threshold (about
2 kB: a state of some eight finished nodes and more), with pglz unless the column says
otherwise, at every update. lz4 compresses that JSON almost as well and costs PostgreSQL
less: on a 40-step chain, 0.27-0.28 ms of PostgreSQL's CPU per step against 0.30-0.33 with
pglz, and 3% more WAL (benchmarks/README.md, twelfth round); below the threshold nothing
changes.

Only values written from now on are compressed so: rows written before keep pglz, which
PostgreSQL reads as before (each stored value names its method). Skipped on a server without
lz4 (PostgreSQL before 14, or built without it): nothing in ductor depends on the method.
No table rewrite: the column's setting changes in the catalog only, under a brief ACCESS
EXCLUSIVE lock on ``eec_workflow_run`` (as any ``ALTER TABLE`` of ductor's migrations).

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-05 17:50:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def _has_lz4(bind: sa.engine.Connection) -> bool:
    """Whether the server can compress with lz4: ``default_toast_compression`` (PostgreSQL 14
    and later) lists the methods the server was built with."""
    if bind.dialect.name != "postgresql":
        return False
    found = bind.execute(
        sa.text(
            "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'"
        )
    ).scalar()
    return bool(found)


def upgrade() -> None:
    if _has_lz4(op.get_bind()):
        op.execute("ALTER TABLE eec_workflow_run ALTER COLUMN state SET COMPRESSION lz4")


def downgrade() -> None:
    if _has_lz4(op.get_bind()):
        op.execute("ALTER TABLE eec_workflow_run ALTER COLUMN state SET COMPRESSION DEFAULT")
