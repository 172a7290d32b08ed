"""``eec_refuse``: a statement rolls itself back, saying why

The one-statement commit in autocommit (store/pg_commit.py, ``alone``) updates the run row
first and writes the carried outcome after it. If the run row was updated and the outcome
could not be written (its attempt finished or closed meanwhile), the statement must write
nothing at all: its last ``SELECT`` calls this function, which raises SQLSTATE ``EEC01`` with
the reason, and PostgreSQL rolls the whole statement back (docs/tick-without-transaction.md,
"Nineteenth round"). PostgreSQL only. No table changes.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-06 12:45:00
"""

from __future__ import annotations

from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

# VOLATILE (the default): never evaluated ahead of time, only where a row reaches it.
_CREATE = """
CREATE OR REPLACE FUNCTION eec_refuse(reason text) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '%', reason USING ERRCODE = 'EEC01';
END $$"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_CREATE)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION eec_refuse(text)")
