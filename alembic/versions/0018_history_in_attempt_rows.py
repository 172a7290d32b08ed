"""A step's dispatch and success transitions kept by its attempt row

An inline step's commit recorded two transitions as rows of ``eec_workflow_transition`` that
said again what its attempt rows say: the next node's ``pending -> running`` ("attempt N
dispatched", at the new attempt's ``created_at``) and the finished node's ``running ->
succeeded`` ("attempt N succeeded", at its ``finished_at``). As rows they were a fifth of a
step's WAL. From here on such a transition is the attempt row's ``dispatch_seq`` or
``success_seq`` instead (docs/history-in-attempt-rows.md). The view ``eec_workflow_history``
is both, with a transition row's columns: what every reader of a run's history reads
(``store/history.py`` holds the same definition, for the test harness's SQLite file).

A later migration that rebuilds either table (SQLite's batch mode copies it and renames the
copy, which SQLite refuses while a view reads the table) or changes the type of a column the
view reads (PostgreSQL refuses that too) drops the view first and creates it again after,
from ``store/history.py``'s ``CREATE_VIEW`` as it is then
(tests/integration/test_history_in_attempt_rows.py does it).

Adding nullable columns without a default rewrites nothing. The downgrade writes every
derived transition back as a row before dropping the view and the columns: no history is
lost.
"""

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


_DERIVED = (
    ("dispatch_seq", "pending", "running", "dispatched", "created_at"),
    ("success_seq", "running", "succeeded", "succeeded", "finished_at"),
)


def _derived(seq: str, from_status: str, to_status: str, word: str, at: str) -> str:
    return (
        f"SELECT run_id, {seq}, node, '{from_status}', '{to_status}', "
        f"'attempt ' || CAST(attempt AS VARCHAR) || ' {word}', {at} "
        f"FROM eec_workflow_step_attempt WHERE {seq} IS NOT NULL"
    )


def upgrade() -> None:
    with op.batch_alter_table("eec_workflow_step_attempt") as batch:
        batch.add_column(sa.Column("dispatch_seq", sa.Integer, nullable=True))
        batch.add_column(sa.Column("success_seq", sa.Integer, nullable=True))
    op.execute(
        "CREATE VIEW eec_workflow_history AS "
        "SELECT run_id, seq, node, from_status, to_status, reason, at "
        "FROM eec_workflow_transition UNION ALL "
        + " UNION ALL ".join(_derived(*d) for d in _DERIVED)
    )


def downgrade() -> None:
    op.execute("DROP VIEW eec_workflow_history")
    for derived in _DERIVED:
        op.execute(
            "INSERT INTO eec_workflow_transition "
            "(run_id, seq, node, from_status, to_status, reason, at) " + _derived(*derived)
        )
    with op.batch_alter_table("eec_workflow_step_attempt") as batch:
        batch.drop_column("success_seq")
        batch.drop_column("dispatch_seq")
