"""A run's history: its transitions, whether stored as rows or kept by attempt rows.

An inline step's dispatch and success transitions are not rows of ``eec_workflow_transition``
but two columns of the attempt row they describe (``dispatch_seq``, ``success_seq``;
docs/history-in-attempt-rows.md). The view ``eec_workflow_history`` (migration 0018) is the
``UNION ALL`` of both, with a transition row's columns: every reader of a run's history, ours
and a user's own SQL, reads it instead of the table, and finds each transition once.
"""

from __future__ import annotations

import sqlalchemy as sa

from .schema import Ts

#: The view, as migration 0018 creates it (and ``migrate.create_throwaway`` for the test
#: harness's SQLite file, which is made from the metadata instead of the migrations). A
#: derived entry is built from the attempt row's own columns: what it says, the row says.
#: A migration that rebuilds either table, or changes the type of a column the view reads,
#: drops the view first and runs this again after (migration 0018's docstring).
CREATE_VIEW = """
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


def kept_reason(attempt: int, word: str) -> str:
    """The reason an attempt row's kept entry reads back as (``CREATE_VIEW``: ``word`` is
    ``dispatched`` or ``succeeded``). A commit keeps a transition in the row only if its
    reason is exactly this; otherwise it is a row of its own."""
    return f"attempt {attempt} {word}"


#: The view's columns, a transition row's. Its own MetaData: the schema's ``create_all``
#: must not make it a table.
view = sa.Table(
    "eec_workflow_history",
    sa.MetaData(),
    sa.Column("run_id", sa.String(64)),
    sa.Column("seq", sa.Integer),
    sa.Column("node", sa.String(200)),
    sa.Column("from_status", sa.String(20)),
    sa.Column("to_status", sa.String(20)),
    sa.Column("reason", sa.Text),
    sa.Column("at", Ts),
)
