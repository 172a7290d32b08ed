"""The common tick commit in one statement and one round trip, on PostgreSQL.

Most ticks do the same five writes: update the run row (versioned), mark the folded results,
insert the new attempts, append the transitions, insert the outbox rows and read their ids.
Sent one by one they cost five round trips and five trips through SQLAlchemy's execution
path. Here they are one fixed statement: the run update and the other writes as
data-modifying CTEs, each table's rows passed as one JSON array (``jsonb_array_elements``).
The text never changes with the number of rows, so psycopg prepares it once per connection;
and three JSON texts cost psycopg far less to send than the two dozen typed arrays, one per
column, that this statement took before (each array is adapted in Python, element by
element).

Only for ticks with none of the writes that need an order of their own: no attempt closed,
no lease taken or released, no retry copying an earlier attempt's arguments, no redrive or
continue-as-new (``eligible``). ``ticks.commit_on`` does everything else, and the writes
that follow these five, as before. Two more ride along when the tick makes them: the run's
timer row (the ``timer`` CTE: ``ticks._set_timer``'s upsert or delete) and a finishing run's
notification (``pg_notify`` in the last ``SELECT``), both conditional on the run update.

Every other write is conditional on the run update having matched (``EXISTS (SELECT 1 FROM
run_update)``): a tick that lost a version race writes nothing, not even a row that would
collide with the winner's, and the caller rolls back and recomputes (``VersionConflict``).

A tick that carries a step's outcome (``Coordinator.tick``'s ``carried``: an inline step's
eager tick) writes it in a ``carried`` CTE that finishes and folds its attempt at once. In a
transaction it is written first, and the run update is conditional on it; alone, after the
run update, conditional on it, and a run updated without it is refused (below). Either way
an attempt finished or closed already writes nothing at all, and the caller rolls back
(``OutcomeNotCarried``; docs/one-statement-step.md).

``alone``: the statement is the whole tick, in autocommit. Its run update is its first write,
and takes the run's lock (waiting for a tick that holds it, at most the statement's
``lock_timeout``); the carried outcome and everything else wait for it, and a statement that
updated the run but could not write its outcome rolls itself back (``eec_refuse``, SQLSTATE
``REFUSED``; docs/tick-without-transaction.md, "Nineteenth round").
"""

from __future__ import annotations

import functools
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple

import psycopg
from sqlalchemy.engine import Connection

from ..coordinator.rows import OutboxIntent, folded_by_commit
from ..engine import AttemptResult, NewAttempt, TickPayload
from .attempts import CARRIED_WHERE, OUTCOME_VALUES, carried_params
from .db import LOCK_NOT_AVAILABLE, driver_cursor
from .history import kept_reason
from .schema import dumps_json, stored_json_text
from .state_text import state_text

if TYPE_CHECKING:
    from ..coordinator.port import TickClaim

#: Run-row columns holding JSON (cast from the text ``dumps_json`` makes; ``state``'s is the
#: tick's ``RunState``, whose text ``state_text`` makes).
_JSON_RUN_COLUMNS = frozenset({"state", "output", "error"})


class Committed(NamedTuple):
    """What the statement did."""

    #: ``alone``: the run update matched, at the tick's version (else nothing was written:
    #: another tick committed the run since the read, or held it past the lock timeout).
    #: Always True otherwise.
    locked: bool
    #: The carried outcome was written (True when there is none).
    written: bool
    #: The run update matched.
    matched: bool
    #: The outbox rows' ids, in row order.
    outbox_ids: list[int]
    #: ``next_read`` and the run update matched: what the run's next read would return,
    #: else None.
    next_read: NextRead | None = None


#: The run row as the tick read it (a WHERE on ``eec_workflow_run``; parameters ``run_id``,
#: ``version``): at its version. Every write a tick reads gives the run a new version, a
#: stale timer row's move included (``ticks.refresh_stale_timer``), so a tick that locks the
#: run only at its commit never keeps an earlier timer row it read that another tick has
#: moved meanwhile (docs/tick-without-transaction.md, "The timer row").
RUN_AS_READ = "run_id = %(run_id)s AND record_version = %(version)s"

#: What ``eec_refuse`` raises (migration 0021): the statement rolled itself back.
REFUSED = "EEC01"


class NextRead(NamedTuple):
    """``next_read``: what the run's next read would find, read by the statement itself
    (docs/next-read-from-commit.md), in the order of ``_NEXT_READ``'s columns."""

    #: The state the statement stored without its nodes, as PostgreSQL returns it
    #: (``RETURNING state - 'nodes'``): the run's own fields, its context and every other
    #: value a step could see, exactly as a read decodes them. The nodes are the ones the
    #: tick committed, as a read would order them (``next_read.nodes_as_read``).
    state: Any
    #: The database's clock as the statement ends (``clock_timestamp()``, not its start: the
    #: next tick's clock runs on from there, and must not lag by a lock the statement waited
    #: for).
    db_now: datetime
    #: Whether its snapshot holds anything else to apply (the read's own tests,
    #: ``load._run_row_statement``; an attempt this statement folds still counts as unfolded
    #: in its snapshot: conservative).
    has_control: bool
    has_signals: bool
    has_results: bool
    #: The database's clock as the statement began (``statement_timestamp()``): its snapshot's
    #: time, the flags' above. Earlier than ``db_now`` by more than the statement's own work
    #: when it waited for the run's lock (docs/tick-without-transaction.md, "Nineteenth
    #: round"); the kept read's age counts from here. None: not read (a test's own).
    db_began: datetime | None = None


#: The carried outcome's write in the commit (``CARRIED_SET`` but for two columns): finished
#: at the tick's time, the time of everything else the commit writes; and, when the commit's
#: transitions hold this attempt's success, its seq (``%(c_success_seq)s``), if the reason is
#: the very one the row reads back as (``history.kept_reason``, checked here in SQL against
#: the row's own attempt number; docs/history-in-attempt-rows.md).
_TICK_CARRIED_SET = f"""finished_at = %(now)s, {OUTCOME_VALUES}, folded = true,
        success_seq = CASE WHEN %(c_success_reason)s = 'attempt ' || attempt || ' succeeded'
                           THEN %(c_success_seq)s::int END"""

_NEXT_READ = """,
       (SELECT rest FROM run_update) AS next_state, clock_timestamp() AS db_now,
       EXISTS (SELECT 1 FROM eec_workflow_control c
               WHERE c.run_id = %(run_id)s AND c.handled_at IS NULL) AS has_control,
       EXISTS (SELECT 1 FROM eec_workflow_signal s
               WHERE s.run_id = %(run_id)s AND s.applied_at IS NULL) AS has_signals,
       EXISTS (SELECT 1 FROM eec_workflow_step_attempt r
               WHERE r.run_id = %(run_id)s AND r.unfolded) AS has_results,
       statement_timestamp() AS db_began"""


def eligible(payload: TickPayload) -> bool:
    return (
        not payload.closed
        and not payload.reopened
        and payload.successor is None
        and all(a.args_from is None and a.lease_key is None for a in payload.new_attempts)
    )


@functools.cache
def _statement(
    run_columns: tuple[str, ...],
    carrying: bool,
    alone: bool = False,
    notify: bool = False,
    timer: str | None = None,
    next_read: bool = False,
    folds: bool = True,
    sends: bool = True,
    carried_done: bool = False,
) -> str:
    sets = ", ".join(
        f"{c} = %(r_{c})s::jsonb" if c in _JSON_RUN_COLUMNS else f"{c} = %(r_{c})s"
        for c in run_columns
    )
    # ``alone``: the statement is the whole tick, in autocommit (docs/tick-without-
    # transaction.md, "Nineteenth round"). Its first write is the run update, at the version
    # the tick read: it takes the run's lock (no lock of its own before it: a row lock is a
    # WAL record), waiting for a tick that holds the run, and a version moved meanwhile
    # matches nothing. The lock timeout is set by its WHERE, on the row found, before the
    # row's lock is waited for. The carried outcome is written only after it (the run row's
    # lock before the attempt row's, as in every tick), and the last SELECT rolls the
    # statement back if the run was updated without it.
    bounded = " AND set_config('lock_timeout', %(lock_timeout)s, true) IS NOT NULL" if alone else ""
    # ``notify``: the run finishes; its waiters hear it when the statement's commit lands.
    notified = (
        "CASE WHEN EXISTS (SELECT 1 FROM run_update) THEN pg_notify(%(channel)s, %(run_id)s) END"
        if notify
        else "NULL"
    )
    # ``timer``: the run's timer row is set at %(timer_at)s, or deleted (ticks._timer_write).
    timer_write = {
        None: "",
        "set": """, timer AS (
    INSERT INTO eec_workflow_timer (run_id, fire_at, woken_at)
    SELECT %(run_id)s, %(timer_at)s, NULL
    WHERE EXISTS (SELECT 1 FROM run_update)
    ON CONFLICT (run_id) DO UPDATE SET fire_at = excluded.fire_at, woken_at = excluded.woken_at
)""",
        "delete": """, timer AS (
    DELETE FROM eec_workflow_timer
    WHERE run_id = %(run_id)s AND EXISTS (SELECT 1 FROM run_update)
)""",
    }[timer]
    # A part with no rows is left out of the statement (its own prepared variant): an inline
    # step's tick folds nothing but its own outcome (the carried CTE) and sends no message,
    # and PostgreSQL would set up and run each part's plan for nothing at every call.
    folded = (
        """, folded AS (
    UPDATE eec_workflow_step_attempt SET folded = true
    -- The tokens as an array built by the statement itself: a custom plan cannot see its
    -- length any more than the generic one can, so both cost the same and PostgreSQL keeps
    -- the generic plan instead of planning the statement at every call; and each token is
    -- looked up by the primary key. (A join to the list, estimated at 100 rows, hashed it
    -- against a scan of the whole attempts table, cheaper by the estimate than 100 index
    -- lookups up to tens of thousands of attempt rows: 1-4 ms at every scatter tick.)
    WHERE eec_workflow_step_attempt.token
          = ANY (ARRAY(SELECT jsonb_array_elements_text(%(folded)s::jsonb)))
      AND EXISTS (SELECT 1 FROM run_update)
)"""
        if folds
        else ""
    )
    outbox = (
        """, outbox AS (
    INSERT INTO eec_workflow_outbox (run_id, kind, task, queue, payload, created_at)
    SELECT o.row->>'run_id', o.row->>'kind', o.row->>'task', o.row->>'queue',
           o.row->'payload', %(now)s
    FROM jsonb_array_elements(%(outbox)s::jsonb) WITH ORDINALITY AS o(row, n)
    WHERE EXISTS (SELECT 1 FROM run_update)
    ORDER BY o.n
    RETURNING id
)"""
        if sends
        else ""
    )
    outbox_ids = "ARRAY(SELECT id FROM outbox ORDER BY id)" if sends else "'{}'::bigint[]"
    returned = "state - 'nodes' - 'open' - 'done' - 'unstarted' AS rest" if next_read else "1"

    def run_update(also: str = "") -> str:
        return f"""run_update AS (
    UPDATE eec_workflow_run SET {sets}
    WHERE run_id = %(run_id)s AND record_version = %(version)s{bounded}{also}
    RETURNING {returned}
)"""

    refused = "NULL"
    if carrying:
        # ``carried_done``: the state leaves the carried node to this row (store/done_nodes.py),
        # which gives it back only if it was created when the node started.
        started = " AND created_at = %(c_started)s" if carried_done else ""
        written = "EXISTS (SELECT 1 FROM carried)"
        # In a transaction (the run locked since the read) the outcome is written first and
        # the run update requires it; alone, the run update is first and the outcome
        # requires it, and a run updated without its outcome is refused.
        carried = f"""carried AS (
    UPDATE eec_workflow_step_attempt SET {_TICK_CARRIED_SET}
    WHERE {CARRIED_WHERE}{started}{" AND EXISTS (SELECT 1 FROM run_update)" if alone else ""}
    RETURNING success_seq
)"""
        if alone:
            parts = f"{run_update()}, {carried}"
            refused = (
                f"CASE WHEN EXISTS (SELECT 1 FROM run_update) AND NOT {written} THEN "
                "eec_refuse('the carried outcome of attempt ' || %(c_token)s || ' was not "
                "written: the attempt was finished or closed meanwhile') END"
            )
        else:
            parts = f"{carried}, {run_update(f' AND {written}')}"
        # The success transition this row took (docs/history-in-attempt-rows.md) is not
        # written as a row too.
        kept_by_row = "AND (t->>'seq')::int IS DISTINCT FROM (SELECT success_seq FROM carried)"
    else:
        parts = run_update()
        written = "true"
        kept_by_row = ""
    matched = "EXISTS (SELECT 1 FROM run_update)"
    return f"""
WITH {parts}{folded}, attempts AS (
    INSERT INTO eec_workflow_step_attempt
        (token, run_id, node, branch, generation, attempt, step, queue, args, timeout,
         created_at, folded, claimed_at, claimed_by, carrier, rate_key, rate_limit,
         rate_period, priority, dispatch_seq)
    SELECT a->>'token', %(run_id)s, a->>'node', (a->>'branch')::int,
           (a->>'generation')::int, (a->>'attempt')::int, a->>'step', a->>'queue',
           a->'args', (a->>'timeout')::float8, %(now)s, false,
           CASE WHEN a->>'claimed_by' IS NULL THEN NULL ELSE %(now)s END, a->>'claimed_by',
           a->>'carrier', a->>'rate_key', (a->>'rate_limit')::int,
           (a->>'rate_period')::float8, %(priority)s, (a->>'dispatch_seq')::int
    FROM jsonb_array_elements(%(attempts)s::jsonb) AS a
    WHERE EXISTS (SELECT 1 FROM run_update)
), transitions AS (
    INSERT INTO eec_workflow_transition (run_id, seq, node, from_status, to_status, reason, at)
    SELECT %(run_id)s, (t->>'seq')::int, t->>'node', t->>'from_status', t->>'to_status',
           t->>'reason', %(now)s
    FROM jsonb_array_elements(%(transitions)s::jsonb) AS t
    WHERE EXISTS (SELECT 1 FROM run_update) {kept_by_row}
){outbox}{timer_write}
SELECT {written} AS written, (SELECT count(*) FROM run_update) AS updated,
       {outbox_ids} AS outbox_ids, {matched if alone else "true"} AS locked,
       {notified} AS notified, {refused} AS refused{_NEXT_READ if next_read else ""}
"""


def commit(
    conn: Connection,
    *,
    run_id: str,
    version: int,
    run_values: dict[str, Any],
    payload: TickPayload,
    transitions: list[dict[str, Any]],
    outbox: list[OutboxIntent],
    now: datetime,
    claim: TickClaim | None = None,
    priority: int = 0,
    carried: AttemptResult | None = None,
    alone: bool = False,
    lock_timeout: str | None = None,
    notify: str | None = None,
    timer: tuple[str, datetime | None] | None = None,
    next_read: bool = False,
    done: frozenset[str] = frozenset(),
) -> Committed:
    """Run the five writes (six with ``carried``). ``claim``: that new attempt is inserted
    claimed by its worker (runtime/inline.py). ``alone``: the statement is the whole tick
    (autocommit) and takes the run's lock itself by its run update, at ``version``, waiting
    at most ``lock_timeout`` for any lock. ``notify``: the channel to announce the run on (it
    finishes), if the run update matched. ``timer``: the run's timer row written too
    (``("set", fire_at)`` or ``("delete", None)``). ``next_read``: return what the run's next
    read would find (``Committed.next_read``; docs/next-read-from-commit.md). ``done``: the
    nodes the state leaves to their attempt rows (``done_nodes.done_nodes``)."""
    columns = tuple(sorted(run_values))
    folded = folded_by_commit(payload, carried)
    params: dict[str, Any] = {
        "run_id": run_id,
        "version": version,
        "now": now,
        "priority": priority,
    }
    if folded:
        params["folded"] = dumps_json(folded)
    if outbox:
        params["outbox"] = dumps_json(
            [{k: o[k] for k in ("run_id", "kind", "task", "queue", "payload")} for o in outbox]
        )
    if notify is not None:
        params["channel"] = notify
    if timer is not None:
        params["timer_at"] = timer[1]
    if alone:
        if lock_timeout is None:
            raise ValueError("a commit alone sets its own lock timeout")
        params["lock_timeout"] = lock_timeout
    carried_done = carried is not None and carried.node in done
    if carried is not None:
        params.update(carried_params(carried))
        if carried_done:
            params["c_started"] = payload.state.nodes[carried.node].started_at
    for column in columns:
        value = run_values[column]
        if column == "state":
            value = state_text(run_id, value, done)
        elif column in _JSON_RUN_COLUMNS:
            value = dumps_json(value)
        params[f"r_{column}"] = value
    new = payload.new_attempts
    dispatched = _dispatch_seqs(new, transitions)
    kept_by_rows = set(dispatched.values())
    if carried is not None:
        success = _success_transition(carried, transitions)
        params["c_success_seq"] = None if success is None else success["seq"]
        params["c_success_reason"] = None if success is None else success["reason"]
    params.update(
        attempts="["
        + ",".join(_attempt_json(a, claim, dispatched.get(a.token)) for a in new)
        + "]",
        transitions=dumps_json(
            [
                {k: t[k] for k in ("seq", "node", "from_status", "to_status", "reason")}
                for t in transitions
                if t["seq"] not in kept_by_rows
            ]
        ),
    )
    # Straight to the driver's cursor, inside the transaction SQLAlchemy opened on this very
    # connection: the text is final and the parameters are plain values, so SQLAlchemy's
    # execution context and result wrapping are pure cost here (measured by
    # benchmarks/tick_cost.py).
    with driver_cursor(conn) as cursor:
        statement = _statement(
            columns,
            carried is not None,
            alone,
            notify is not None,
            None if timer is None else timer[0],
            next_read,
            bool(folded),
            bool(outbox),
            carried_done,
        )
        try:
            cursor.execute(statement, params)
        except psycopg.Error as error:
            # Alone, in autocommit: the statement rolled back as a whole, nothing written.
            if alone and error.sqlstate == LOCK_NOT_AVAILABLE:
                # Another tick held the run past the lock timeout (stopped or cut off).
                return Committed(False, False, False, [])
            if alone and error.sqlstate == REFUSED:
                # The run matched; the carried outcome's attempt was finished or closed.
                return Committed(True, False, False, [])
            raise
        written, updated, outbox_ids, locked, _notified, _refused, *read = cursor.fetchone()
    matched = updated == 1
    return Committed(
        bool(locked),
        bool(written),
        matched,
        list(outbox_ids),
        NextRead(*read) if next_read and matched else None,
    )


def _dispatch_seqs(new: list[NewAttempt], transitions: list[dict[str, Any]]) -> dict[str, int]:
    """Token -> seq of each new attempt that is its node's "pending -> running, attempt N
    dispatched" transition in this commit (its row keeps it: ``dispatch_seq``). Only a
    node with exactly one new attempt, not a scatter's branch."""
    by_node: dict[str, NewAttempt | None] = {}
    for a in new:
        by_node[a.node] = None if a.node in by_node or a.branch is not None else a
    found: dict[str, int] = {}
    for t in transitions:
        one = by_node.get(t["node"]) if t["node"] is not None else None
        if (
            one is not None
            and one.token not in found
            and t["from_status"] == "pending"
            and t["to_status"] == "running"
            and t["reason"] == kept_reason(one.attempt, "dispatched")
        ):
            found[one.token] = t["seq"]
    return found


def _success_transition(
    carried: AttemptResult, transitions: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """The transition of this commit that may be the carried attempt's success: its node's
    ``running -> succeeded``. The statement keeps it in the attempt row only if its reason is
    the one the row reads back as (``_TICK_CARRIED_SET``)."""
    if carried.branch is not None or carried.outcome != "succeeded":
        return None
    for t in transitions:
        if t["node"] == carried.node and (t["from_status"], t["to_status"]) == (
            "running",
            "succeeded",
        ):
            return t
    return None


def _attempt_json(a: NewAttempt, claim: TickClaim | None, dispatch_seq: int | None) -> str:
    """A new attempt as the statement's ``attempts`` array holds it: its arguments from their
    check's text when the tick kept it (``NewAttempt.args_text``), not encoded again;
    ``dispatch_seq``: the transition its row keeps (``_dispatch_seqs``)."""
    mine = claim if claim is not None and a.token == claim.token else None
    fields = dumps_json(
        {
            "token": a.token,
            "node": a.node,
            "branch": a.branch,
            "generation": a.generation,
            "attempt": a.attempt,
            "step": a.step,
            "queue": a.queue,
            "timeout": float(a.timeout),
            "claimed_by": None if mine is None else mine.worker,
            "carrier": None if mine is None else mine.carrier,
            "rate_key": a.rate_key,
            "rate_limit": a.rate_limit,
            "rate_period": a.rate_period,
            "dispatch_seq": dispatch_seq,
        }
    )
    args = dumps_json(a.args) if a.args_text is None else stored_json_text(a.args_text)
    return f'{fields[:-1]},"args":{args}}}'
