"""The run state compressed with lz4, where the PostgreSQL server has it

Every tick writes a new version of the run row, its state (every node of the run) included.
Once the row passes PostgreSQL's TOAST threshold (about 2 kB: in a 10-step chain, from the
seventh step on) PostgreSQL compresses its largest values, the state first, at every update,
with pglz unless the column says otherwise. lz4 compresses that JSON almost as well and
costs PostgreSQL less: on a 40-step chain 0.255-0.260 ms of PostgreSQL's CPU per step
against 0.300-0.305 with pglz, and 3% more WAL; on a 10-step chain 0.260 against 0.265-0.275
(benchmarks/README.md, twelfth round).

Only values written from now on are compressed so: rows written before keep pglz, which
PostgreSQL reads as before (each stored value names its method). Skipped on a server without
lz4 (PostgreSQL before 14, or built without it): nothing in ductor depends on the method. A
database moved later to a server with lz4 keeps pglz unless the ``ALTER`` below is run by
hand. No table rewrite: the catalog changes only, under an ACCESS EXCLUSIVE lock on
``eec_workflow_run`` held for a moment, once the transactions open on the table have ended
(ticks queue behind it meanwhile), as for any ``ALTER TABLE`` of these migrations.
``pg_dump`` now writes the column's method: restoring such a dump on a server without lz4
needs ``pg_dump --no-toast-compression``.

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
