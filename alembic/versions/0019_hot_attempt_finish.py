"""The attempt table's partial indexes on generated columns: an inline step's finish is HOT

Three partial indexes of ``eec_workflow_step_attempt`` named ``finished_at`` and ``folded``
in their predicates, so PostgreSQL made every finish of an attempt a full update (a new
entry in every index) instead of a HOT update, even the inline step's, which changes no
column those indexes are about. Each predicate is now a stored generated column
(``rate_waiting``, ``lease_waiting``, ``unfolded``; the same expressions as before) and each
index is rebuilt, with its name and keys, on ``WHERE <its column>``
(docs/hot-attempt-finish.md).

PostgreSQL: one ``ALTER TABLE`` adds the three columns and **rewrites the attempt table
once** (every existing row's columns computed) under an ACCESS EXCLUSIVE lock; then the
indexes. On a big table, run it with the workers stopped, after ``ductor prune``.

SQLite cannot add a stored generated column to a table: the table is rebuilt (batch mode),
with the history view of 0018 dropped first and created again after (0018 says why), and
the three indexes dropped before and created after (the rebuild does not carry a partial
index's predicate over reliably).

A later migration that rebuilds the attempt table on SQLite must do the same: alembic's batch
copy names every column in its ``INSERT ... SELECT``, the generated ones too, and SQLite
refuses to insert into them. So its batch drops the three columns and adds them again
(``store/schema.py``'s ``ATTEMPT_PREDICATES``), with the three indexes dropped before and
created after, and 0018's view dropped and created around it all
(tests/integration/test_history_in_attempt_rows.py does it).

The downgrade puts the indexes back on their old predicates and drops the columns; nothing
is stored only in them.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06 04:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

_TABLE = "eec_workflow_step_attempt"

#: Column -> its expression: each the predicate of the index of that row (0001, 0004, 0014).
_COLUMNS = {
    "rate_waiting": "rate_wait_since IS NOT NULL AND finished_at IS NULL",
    "lease_waiting": "lease_key IS NOT NULL AND finished_at IS NULL",
    "unfolded": "finished_at IS NOT NULL AND NOT folded",
}
#: Index -> its keys and its column.
_INDEXES = {
    "eec_workflow_step_attempt_rate_wait": (("rate_key", "created_at"), "rate_waiting"),
    "eec_workflow_step_attempt_lease_wait": (("lease_key", "created_at"), "lease_waiting"),
    "eec_workflow_step_attempt_unfolded": (("run_id",), "unfolded"),
}

#: 0018's view, as it is at this revision (a migration must not change with the code).
_CREATE_HISTORY_VIEW = """
CREATE VIEW eec_workflow_history AS
SELECT run_id, seq, node, from_status, to_status, reason, at
FROM eec_workflow_transition
UNION ALL
SELECT run_id, dispatch_seq, node, 'pending', 'running',
       'attempt ' || CAST(attempt AS VARCHAR) || ' dispatched', created_at
FROM eec_workflow_step_attempt WHERE dispatch_seq IS NOT NULL
UNION ALL
SELECT run_id, success_seq, node, 'running', 'succeeded',
       'attempt ' || CAST(attempt AS VARCHAR) || ' succeeded', finished_at
FROM eec_workflow_step_attempt WHERE success_seq IS NOT NULL
"""


def _sqlite() -> bool:
    return bool(op.get_bind().dialect.name == "sqlite")


def _create_indexes(on_columns: bool) -> None:
    """The three indexes, on the generated columns or (``on_columns`` False) on the old
    predicates."""
    for name, (keys, column) in _INDEXES.items():
        if on_columns:
            where = f"{column} = 1" if _sqlite() else column
        else:
            where = _COLUMNS[column]
        op.create_index(
            name,
            _TABLE,
            list(keys),
            postgresql_where=sa.text(where),
            sqlite_where=sa.text(where),
        )


def _drop_indexes() -> None:
    for name in _INDEXES:
        op.drop_index(name, table_name=_TABLE)


def upgrade() -> None:
    _drop_indexes()
    if _sqlite():
        op.execute("DROP VIEW eec_workflow_history")
        with op.batch_alter_table(_TABLE, recreate="always") as batch:
            for column, expression in _COLUMNS.items():
                batch.add_column(
                    sa.Column(column, sa.Boolean, sa.Computed(expression, persisted=True))
                )
        op.execute(_CREATE_HISTORY_VIEW)
    else:
        op.execute(
            f"ALTER TABLE {_TABLE} "
            + ", ".join(
                f"ADD COLUMN {column} boolean GENERATED ALWAYS AS ({expression}) STORED"
                for column, expression in _COLUMNS.items()
            )
        )
    _create_indexes(on_columns=True)


def downgrade() -> None:
    _drop_indexes()
    if _sqlite():
        op.execute("DROP VIEW eec_workflow_history")
        with op.batch_alter_table(_TABLE, recreate="always") as batch:
            for column in _COLUMNS:
                batch.drop_column(column)
        op.execute(_CREATE_HISTORY_VIEW)
    else:
        op.execute(f"ALTER TABLE {_TABLE} " + ", ".join(f"DROP COLUMN {c}" for c in _COLUMNS))
    _create_indexes(on_columns=False)
