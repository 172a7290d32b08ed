"""The coordinator's side of the store: commit a tick's payload (``load.py`` reads the run;
``tick_store.py`` puts both behind the coordinator's port).

``commit_on`` is the only code that updates ``eec_workflow_run`` after its insert, and it
always does so ``WHERE record_version = :expected``.
"""

from __future__ import annotations

import dataclasses
import functools
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from ..coordinator.port import (
    LoadedRun,
    OutboxRow,
    OutcomeNotCarried,
    RunBusy,
    TickClaim,
    VersionConflict,
    WorkflowIdTaken,
)
from ..coordinator.rows import (
    OutboxIntent,
    carrier_revokes,
    folded_by_commit,
    outbox_intents,
    outbox_row,
    transition_rows,
    unsent,
    wakeup_intent,
)
from ..engine import AttemptResult, RunState, TickPayload
from ..engine.children import child_workflow_id
from ..engine.deadline import deadline_after
from ..engine.kinds import CONTROL_APPLIED, AuditAction, AuditSource
from . import attempts, audit, blobs, done_nodes, leases, pg_commit, rates, run_slots
from . import tags as run_tags
from .db import driver_cursor
from .dialect import Dialect, dialect_of
from .external import lock_workflow_signals
from .finishes import RUN_FINISHED_CHANNEL
from .next_read import keep as next_read_kept
from .outbox import insert_outbox
from .runs import pending_run, run_exists
from .schema import (
    step_attempt,
    workflow_control,
    workflow_definition,
    workflow_run,
    workflow_signal,
    workflow_timer,
    workflow_transition,
)


def offload_payload(conn: Connection, run_id: str, payload: TickPayload) -> None:
    """Values the tick writes that are over the offload threshold (a step's arguments, the
    run's output, a child's or successor's input resolved from inside a large value) go to
    ``eec_blob`` in this transaction, and the payload carries their references: one
    serialization per value, no query, when nothing is large (docs/large-values.md)."""
    limit = blobs.threshold(conn.engine)
    payload.new_attempts = [
        a
        if a.args_from is not None
        or (stored := blobs.offloaded(conn, run_id, a.args, limit, a.args_text)) is a.args
        else dataclasses.replace(a, args=stored, args_text=None)
        for a in payload.new_attempts
    ]
    if payload.finished:
        payload.output = blobs.offloaded(conn, run_id, payload.output, limit)
    payload.child_starts = [
        dataclasses.replace(c, input=blobs.offloaded(conn, c.run_id, c.input, limit))
        for c in payload.child_starts
    ]
    if payload.successor is not None:
        successor = payload.successor
        payload.successor = dataclasses.replace(
            successor, input=blobs.offloaded(conn, successor.run_id, successor.input, limit)
        )


def commit_on(
    conn: Connection,
    loaded: LoadedRun,
    payload: TickPayload,
    claim: TickClaim | None = None,
    carried: AttemptResult | None = None,
) -> list[OutboxRow]:
    """Write the payload in the caller's transaction; ``VersionConflict``,
    ``WorkflowIdTaken`` and ``OutcomeNotCarried`` mean roll it back. ``claim``: a new attempt
    inserted as claimed. ``carried``: an outcome the worker holds, written finished and
    folded (PostgreSQL; docs/one-statement-step.md)."""
    try:
        return _commit_on(conn, loaded, payload, claim, carried)
    except IntegrityError as exc:
        if payload.reopened:
            raise WorkflowIdTaken(loaded.workflow_id) from exc
        raise


def _commit_on(
    conn: Connection,
    loaded: LoadedRun,
    payload: TickPayload,
    claim: TickClaim | None,
    carried: AttemptResult | None,
) -> list[OutboxRow]:
    if payload.needs:
        # compute_tick read inside a large value its inputs lacked: never written (the loop
        # computes the tick again with it first).
        raise RuntimeError(f"run {loaded.run_id}: a tick computed without its large values")
    offload_payload(conn, loaded.run_id, payload)
    now = loaded.now
    values = _run_values(loaded, payload)
    slots = _changes_run_slots(loaded, payload)
    if slots:  # before lease locks, as in every writer of run slots
        run_slots.lock_for_commit(conn, loaded.run_id, loaded.concurrency_key)
    rate = claim.rate if claim is not None else None
    if dialect_of(conn).one_statement and pg_commit.eligible(payload):
        outbox = _commit_in_one_statement(conn, loaded, payload, values, now, claim, carried)
        in_statement = True  # the run's NOTIFY and timer row, by the statement
    else:
        in_statement = False
        if carried is not None and not attempts.finish_carried(conn, carried):
            raise OutcomeNotCarried(carried.token)
        outbox = _commit_core(conn, loaded, payload, values, now, claim, carried)

    for applied in payload.applied_signals:
        res = conn.execute(
            sa.update(workflow_signal)
            .where(workflow_signal.c.id == applied.id, workflow_signal.c.applied_at.is_(None))
            .values(
                applied_at=now, applied_to=applied.node, applied_version=loaded.record_version + 1
            )
        )
        if res.rowcount != 1:
            raise VersionConflict(f"signal {applied.id} applied meanwhile")
    if payload.handled_control is not None:
        conn.execute(
            sa.update(workflow_control)
            .where(workflow_control.c.id == payload.handled_control.id)
            .values(handled_at=now, result=payload.handled_control.result[:2000])
        )
        if payload.handled_control.result == CONTROL_APPLIED:
            # Who asked, in the commit that applies it: a refused control has no entry.
            audit.record_applied_control(conn, payload.handled_control.id, now)
        # A tick drains one control. If more are queued, wake the run for the next one now:
        # their own wake-ups may have gone elsewhere (lost with the broker, or sent to the
        # predecessor of a continue-as-new), and the sweeper would take one per 30 s.
        if _more_controls(conn, loaded.run_id, payload.handled_control.id):
            outbox.extend(insert_outbox(conn, [wakeup_intent(loaded.run_id)], now))
    if payload.tags_set:  # a succeeded step's ctx.tag: the index follows the state
        run_tags.upsert_on(conn, loaded.run_id, payload.tags_set)
    if payload.successor is not None:
        outbox.extend(_insert_successor(conn, loaded, payload, now))
    if slots:
        outbox.extend(_run_slot_changes(conn, loaded, payload, now))
    if claim is not None and rate is not None:
        # The claimed attempt's token, last: its bucket's lock is held for the least time
        # (the commit follows), and after the attempt rows, as a worker's claim takes them.
        rate.taken = rates.take_for_claim(
            conn, rate.key, rate.limit, rate.period, claim.token, now, loaded.priority
        )
        if not rate.taken:
            rates.give_back(conn, claim.token, now)
    if payload.child_starts or payload.child_controls:
        outbox.extend(_children(conn, loaded, payload, now))
    wakes_parent = payload.checkpoint_reached or payload.finished
    if loaded.parent_run_id is not None and wakes_parent:
        parent = newest_of_chain(conn, loaded.parent_run_id)
        outbox.extend(insert_outbox(conn, [wakeup_intent(parent)], now))

    if payload.cancel_requested:
        # A cooperative cancel: the workers of these attempts read it with their heartbeat.
        conn.execute(
            sa.update(step_attempt)
            .where(
                step_attempt.c.token.in_(payload.cancel_requested),
                step_attempt.c.finished_at.is_(None),
            )
            .values(cancel_requested_at=now)
        )
    if not in_statement:
        _set_timer(conn, loaded, payload.next_wake_at)

    if payload.finished and not in_statement:
        dialect_of(conn).notify(conn, RUN_FINISHED_CHANNEL, loaded.run_id)
    return outbox


def _run_values(loaded: LoadedRun, payload: TickPayload) -> dict[str, Any]:
    """The run row's new values (its versioned update); ``state`` is the ``RunState`` itself,
    which each way of committing encodes its own way (``pg_commit``: ``state_text``)."""
    now, state = loaded.now, payload.state
    values: dict[str, Any] = {
        "status": state.status.value,
        "state": state,
        "record_version": loaded.record_version + 1,
        "transition_count": state.transitions,
        "updated_at": now,
    }
    if payload.finished:
        values.update(output=payload.output, error=payload.error, finished_at=now)
    elif payload.reopened:
        values.update(output=None, error=None, finished_at=None)
    if payload.successor is not None:
        values["continued_to"] = payload.successor.run_id
    return values


def _run_slot_changes(
    conn: Connection, loaded: LoadedRun, payload: TickPayload, now: datetime
) -> list[OutboxRow]:
    """Run concurrency (store/run_slots.py): a run that ends or continues as new frees its
    slot for its key's line (woken); a redriven run holds one."""
    if payload.finished or payload.successor is not None:
        return run_slots.release(conn, loaded.run_id, now)
    if payload.reopened and loaded.concurrency_key is not None:
        return run_slots.readmit(
            conn,
            loaded.run_id,
            loaded.concurrency_key,
            loaded.concurrency_limit,
            loaded.priority,
            now,
        )
    return []


def _changes_run_slots(loaded: LoadedRun, payload: TickPayload) -> bool:
    return loaded.concurrency_key is not None and (
        payload.finished or payload.successor is not None or payload.reopened
    )


# Statements of every tick, built once per process (building one costs more than sending it;
# SQLAlchemy's compiled cache then skips the compile too). Bind parameters are named b_* so an
# UPDATE never reads them as SET values.


@functools.cache
def _update_run_statement(columns: tuple[str, ...]) -> Any:
    """The versioned run update, SETting ``columns`` (given as parameters of those names)."""
    del columns  # part of the cache key only: the SET clause comes from the parameters
    return sa.update(workflow_run).where(
        workflow_run.c.run_id == sa.bindparam("b_run", type_=sa.String),
        workflow_run.c.record_version == sa.bindparam("b_version", type_=sa.Integer),
    )


@functools.cache
def _fold_statement() -> Any:
    return (
        sa.update(step_attempt)
        .where(step_attempt.c.token.in_(sa.bindparam("b_tokens", expanding=True)))
        .values(folded=True)
    )


def _commit_in_one_statement(
    conn: Connection,
    loaded: LoadedRun,
    payload: TickPayload,
    values: dict[str, Any],
    now: datetime,
    claim: TickClaim | None,
    carried: AttemptResult | None,
    *,
    lock_timeout: str | None = None,
    next_read: bool = False,
) -> list[OutboxRow]:
    """The common tick's writes in one round trip (store/pg_commit.py); ``lock_timeout``
    given: the whole tick, in autocommit (``commit_alone``). ``next_read``: keep what the
    run's next read would find for this thread's next tick (``store/next_read.py``)."""
    intents = outbox_intents(payload, unsent(claim), loaded.priority)
    timer = _timer_change(loaded, payload.next_wake_at)
    kept_by_attempts = done_nodes.done_nodes(
        loaded.run_id,
        payload.state.nodes,
        loaded.done,
        loaded.state.nodes,
        None if carried is None else carried.node,
        now,
    )
    done = pg_commit.commit(
        conn,
        run_id=loaded.run_id,
        version=loaded.record_version,
        run_values=values,
        payload=payload,
        transitions=transition_rows(loaded.run_id, loaded.now, payload),
        outbox=intents,
        now=now,
        claim=claim,
        priority=loaded.priority,
        carried=carried,
        alone=lock_timeout is not None,
        lock_timeout=lock_timeout,
        notify=RUN_FINISHED_CHANNEL if payload.finished else None,
        timer=timer,
        next_read=next_read,
        done=kept_by_attempts,
    )
    if not done.locked:
        # Alone: another tick committed the run after our read, or held it past the lock
        # timeout. Nothing written.
        raise RunBusy(loaded.run_id)
    if not done.written:
        assert carried is not None
        raise OutcomeNotCarried(carried.token)
    if not done.matched:
        raise VersionConflict(loaded.run_id)
    if done.next_read is not None:
        timer_at = loaded.timer_at if timer is None else timer[1]
        next_read_kept(
            conn.engine, loaded, timer_at, done.next_read, payload.state.nodes, kept_by_attempts
        )
    return [outbox_row(i, r) for i, r in zip(done.outbox_ids, intents, strict=True)]


def commits_alone(
    conn: Connection, loaded: LoadedRun, payload: TickPayload, claim: TickClaim | None
) -> bool:
    """Whether this commit is the one statement and nothing else (PostgreSQL): no value to
    offload and none of the writes ``_commit_on`` makes after the statement. Such a commit
    needs no transaction of its own (``commit_alone``; docs/tick-without-transaction.md).
    Keep in step with ``_commit_on``: each condition below is one of its writes."""
    if not (dialect_of(conn).one_statement and pg_commit.eligible(payload)) or payload.needs:
        return False
    wakes_parent = payload.checkpoint_reached or payload.finished
    if (
        (loaded.parent_run_id is not None and wakes_parent)  # the parent's wake-up
        or payload.successor is not None
        or payload.applied_signals
        or payload.handled_control is not None
        or payload.tags_set
        or payload.child_starts
        or payload.child_controls
        or payload.cancel_requested
        or _changes_run_slots(loaded, payload)
        or (claim is not None and claim.rate is not None)  # a rate-limit token taken
    ):
        return False
    limit = blobs.threshold(conn.engine)
    if payload.finished and blobs.large_text(payload.output, limit) is not None:
        return False
    return all(
        a.args_from is not None or blobs.large_text(a.args, limit, a.args_text) is None
        for a in payload.new_attempts
    )


def commit_alone(
    conn: Connection,
    loaded: LoadedRun,
    payload: TickPayload,
    claim: TickClaim | None,
    carried: AttemptResult | None,
    lock_timeout: str,
) -> list[OutboxRow]:
    """A commit ``commits_alone`` approved, as one statement in autocommit on ``conn``: its
    run update takes the run's lock at the version read (waiting at most ``lock_timeout``
    for a tick that holds it, or for any other lock). ``RunBusy`` (another tick wrote the
    run since the read, or held it past the timeout) and ``OutcomeNotCarried``: nothing
    was written."""
    values = _run_values(loaded, payload)
    return _commit_in_one_statement(
        conn,
        loaded,
        payload,
        values,
        loaded.now,
        claim,
        carried,
        lock_timeout=lock_timeout,
        next_read=_next_tick_here_locks_late(payload, claim),
    )


def _next_tick_here_locks_late(payload: TickPayload, claim: TickClaim | None) -> bool:
    """Whether the next tick of this run in this thread will lock late and read the row this
    commit writes: the chain runs a plain step it claimed here next, and nothing held before
    it (docs/next-read-from-commit.md). Then the commit returns that read; a scatter branch's
    tick reads in its transaction, and would not take it."""
    if claim is None or claim.held or payload.finished:
        return False
    return any(a.token == claim.token and a.branch is None for a in payload.new_attempts)


#: The run row locked as a tick read it (``pg_commit.RUN_AS_READ``), with the tick's
#: timeouts set by the same statement (it waits for no lock): what a tick read without a
#: transaction takes before it writes in one (``lock_at_version``).
_LOCK_AT_VERSION = (
    "SELECT set_config('idle_in_transaction_session_timeout', %(idle)s, true), "
    "set_config('lock_timeout', %(lock)s, true), "
    f"EXISTS (SELECT 1 FROM eec_workflow_run WHERE {pg_commit.RUN_AS_READ} "
    "FOR UPDATE SKIP LOCKED)"
)


def lock_at_version(conn: Connection, loaded: LoadedRun, idle: str, lock: str) -> None:
    """In a transaction begun after the tick's read (PostgreSQL): lock the run row as the
    tick read it (its version), so every write that follows is made as if
    the lock had been held since the read; ``RunBusy`` if another tick holds it or wrote it
    since."""
    params = {
        "idle": idle,
        "lock": lock,
        "run_id": loaded.run_id,
        "version": loaded.record_version,
    }
    with driver_cursor(conn) as cursor:
        cursor.execute(_LOCK_AT_VERSION, params)
        row = cursor.fetchone()
    if not row[2]:
        raise RunBusy(loaded.run_id)


def _commit_core(
    conn: Connection,
    loaded: LoadedRun,
    payload: TickPayload,
    values: dict[str, Any],
    now: datetime,
    claim: TickClaim | None,
    carried: AttemptResult | None,
) -> list[OutboxRow]:
    """The run update and the writes that come with it, one statement each, in the order
    the lease rules need (every key locked before an attempt row is touched; a carried
    outcome's attempt, folded already by ``_commit_on``, holds no lease)."""
    updated = conn.execute(
        _update_run_statement(tuple(sorted(values))),
        {
            "b_run": loaded.run_id,
            "b_version": loaded.record_version,
            **values,
            "state": values["state"].to_json(),
        },
    )
    if updated.rowcount != 1:
        raise VersionConflict(loaded.run_id)

    # Every lease key this commit touches is locked up front, in sorted order.
    # The keys of closed attempts come from their own rows (a lease_key never changes), not
    # from the lease table: a waiter being closed may be granted a slot by a worker's finish
    # until its key is locked, and that grant must be released too.
    closed_tokens = [c.token for c in payload.closed]
    released_keys = _lease_keys_of(conn, closed_tokens)
    prior = _prior_attempts(conn, payload)
    leases.lock_keys(conn, released_keys + [k for _, k in _lease_keys(payload, prior) if k])

    carriers: dict[str, str | None] = {}
    for closed in payload.closed:
        # Conditional on the attempt still being open: if its worker finished it after our
        # load, roll back and recompute, so the worker's result is folded, not overwritten.
        # The carrier is read back by the same statement: a held branch claimed after our load
        # is claimed before this update (which then sees its carrier) or refused after it.
        found = conn.execute(
            sa.update(step_attempt)
            .where(step_attempt.c.token == closed.token, step_attempt.c.finished_at.is_(None))
            .values(
                finished_at=now,
                outcome=closed.outcome,
                error=closed.error,
                retryable=False,
                folded=True,
            )
            .returning(step_attempt.c.carrier)
        ).first()
        if found is None:
            raise VersionConflict(f"attempt {closed.token} finished meanwhile")
        carriers[closed.token] = found.carrier

    folded = folded_by_commit(payload, carried)
    if folded:
        conn.execute(_fold_statement(), {"b_tokens": folded})

    waiting: set[str] = set()
    if payload.new_attempts:
        waiting = _insert_attempts(conn, loaded, payload, prior, now, claim)

    if payload.transitions:
        conn.execute(
            sa.insert(workflow_transition), transition_rows(loaded.run_id, loaded.now, payload)
        )
    intents = outbox_intents(payload, waiting | unsent(claim), loaded.priority)
    outbox = insert_outbox(conn, [*intents, *carrier_revokes(payload, carriers)], now)
    if released_keys:
        outbox.extend(leases.release(conn, closed_tokens, now))

    return outbox


def refresh_stale_timer(conn: Connection, loaded: LoadedRun, fire_at: datetime | None) -> bool:
    """A tick with nothing to commit still moves a timer row that has come due early.

    The commit keeps an earlier row than it needs (``_set_timer``: it wakes the run early).
    When that row fires and the tick finds nothing to do, nothing else would move it, and the
    sweeper would wake the run every few seconds until the real deadline. Writes only then;
    True if it wrote.
    """
    if not timer_is_stale(loaded, fire_at):
        return False
    _set_timer(conn, loaded, fire_at)
    # A new version, and nothing else of the run changed: a tick that read the run before
    # and locks it only at its commit must not keep the earlier timer row it read (its
    # commit is at the version read; docs/tick-without-transaction.md, "The timer row").
    conn.execute(_bump_version_statement(), {"b_run": loaded.run_id})
    return True


@functools.cache
def _bump_version_statement() -> Any:
    return (
        sa.update(workflow_run)
        .where(workflow_run.c.run_id == sa.bindparam("b_run", type_=sa.String))
        .values(record_version=workflow_run.c.record_version + 1)
    )


def timer_is_stale(loaded: LoadedRun, fire_at: datetime | None) -> bool:
    """Whether ``refresh_stale_timer`` writes: the run's timer row came due and is not at
    ``fire_at``."""
    current = loaded.timer_at
    return current is not None and current <= loaded.now and current != fire_at


def _set_timer(conn: Connection, loaded: LoadedRun, fire_at: datetime | None) -> None:
    """Keep the run's timer row at ``fire_at``, writing only when that matters.

    A row still in the future and no later than ``fire_at`` is left as it is: it wakes the run
    early, a no-op tick that moves it (and most runs finish first). That saves a write in
    almost every tick of a busy run, whose next check moves a little later each time.
    """
    write = _timer_write(loaded, fire_at)
    if write == "delete":
        conn.execute(_delete_timer_statement(), {"b_run": loaded.run_id})
    elif write == "set":
        upsert = _upsert_timer_statement(dialect_of(conn))
        conn.execute(upsert, {"run_id": loaded.run_id, "fire_at": fire_at, "woken_at": None})


def _timer_change(
    loaded: LoadedRun, fire_at: datetime | None
) -> tuple[str, datetime | None] | None:
    """``_timer_write`` with the time to set, for the one-statement commit."""
    write = _timer_write(loaded, fire_at)
    return None if write is None else (write, fire_at if write == "set" else None)


def _timer_write(loaded: LoadedRun, fire_at: datetime | None) -> str | None:
    """What ``_set_timer`` writes: "delete", "set" (the row at ``fire_at``), or None."""
    current = loaded.timer_at
    if fire_at is None:
        return None if current is None else "delete"
    if current is not None and loaded.now < current <= fire_at:
        return None
    return "set"


@functools.cache
def _delete_timer_statement() -> Any:
    return sa.delete(workflow_timer).where(
        workflow_timer.c.run_id == sa.bindparam("b_run", type_=sa.String)
    )


@functools.cache
def _upsert_timer_statement(dialect: Dialect) -> Any:
    """The timer row's upsert (parameters ``run_id``, ``fire_at``, ``woken_at``), built once
    per process and database kind (each has its ON CONFLICT): building it cost more than
    sending it."""
    stmt = dialect.insert(workflow_timer)
    return stmt.on_conflict_do_update(
        index_elements=[workflow_timer.c.run_id],
        set_={"fire_at": stmt.excluded.fire_at, "woken_at": stmt.excluded.woken_at},
    )


def _insert_successor(
    conn: Connection, loaded: LoadedRun, payload: TickPayload, now: datetime
) -> list[OutboxRow]:
    """Continue-as-new: the successor run row, linked both ways, and its first wake-up."""
    successor = payload.successor
    assert successor is not None
    run = conn.execute(
        sa.select(
            workflow_run.c.workflow, workflow_run.c.version, workflow_run.c.parent_run_id
        ).where(workflow_run.c.run_id == loaded.run_id)
    ).one()
    conn.execute(
        sa.insert(workflow_run).values(
            pending_run(
                run_id=successor.run_id,
                workflow_id=loaded.workflow_id,
                workflow=run.workflow,
                # continue_as_new(version=): the definition the successor moves to.
                version=successor.version or run.version,
                spec_hash=successor.spec_hash or loaded.spec_hash,
                state=successor.state,
                input=successor.input,
                parent_run_id=run.parent_run_id,
                continued_from=loaded.run_id,
                trace_context=loaded.trace_context,  # the same trace, docs/tracing.md
                priority=loaded.priority,
                created_at=now,
                updated_at=now,
            )
        )
    )
    tag_rows = run_tags.tags_insert(successor.run_id, successor.state.tags)
    if tag_rows is not None:  # the successor keeps the run's tags (docs/tags.md)
        conn.execute(tag_rows)
    # Signals the predecessor never consumed belong to the successor now. Under the signal
    # lock: a client inserting at this moment either lands before the move (and is moved) or
    # reads the run as continued (and follows it to the successor).
    lock_workflow_signals(conn, loaded.workflow_id)
    conn.execute(
        sa.update(workflow_signal)
        .where(workflow_signal.c.run_id == loaded.run_id, workflow_signal.c.applied_at.is_(None))
        .values(run_id=successor.run_id)
    )
    # So are controls not handled yet (a parent closing this child as it continued), under the
    # same lock that a parent's commit takes before it picks the newest run of the chain.
    conn.execute(
        sa.update(workflow_control)
        .where(workflow_control.c.run_id == loaded.run_id, workflow_control.c.handled_at.is_(None))
        .values(run_id=successor.run_id)
    )
    return insert_outbox(conn, [wakeup_intent(successor.run_id)], now)


def newest_of_chain(conn: Connection, run_id: str) -> str:
    """The newest run of ``run_id``'s continue-as-new chain (a parent that continued as new
    waits for its children in its successor)."""
    for _ in range(100):
        nxt = conn.execute(
            sa.select(workflow_run.c.continued_to).where(workflow_run.c.run_id == run_id)
        ).scalar_one_or_none()
        if not nxt:
            return run_id
        run_id = nxt
    return run_id


def _children(
    conn: Connection, loaded: LoadedRun, payload: TickPayload, now: datetime
) -> list[OutboxRow]:
    """Insert the child runs this tick starts, and the controls for children it closes.

    A child id is deterministic, so an insert that finds its id taken is the same child
    (a recomputed tick): it is skipped. One whose workflow id is taken by an open run is not
    inserted either; the parent then reads it as missing and fails the node, saying why.
    """
    intents: list[OutboxIntent] = []
    started: list[dict[str, Any]] = []  # their audit entries (source parent)
    insert = dialect_of(conn).insert
    for child in payload.child_starts:
        found = conn.execute(
            sa.select(
                workflow_definition.c.spec_hash,
                workflow_definition.c.name,
                workflow_definition.c.version,
                workflow_definition.c.spec,
            )
            .where(
                workflow_definition.c.spec_hash == child.spec_hash
                if child.spec_hash is not None
                # not pinned (registered after its parent): the newest definition of the name
                else workflow_definition.c.name == child.workflow
            )
            .order_by(workflow_definition.c.version.desc(), workflow_definition.c.created_at.desc())
            .limit(1)
        ).one_or_none()
        if found is None:
            raise LookupError(
                f"child workflow {child.workflow!r} ({child.spec_hash}) is not stored: "
                "start the parent with a client that registered it"
            )
        inserted = conn.execute(
            insert(workflow_run)
            .values(
                pending_run(
                    run_id=child.run_id,
                    workflow_id=child_workflow_id(loaded.workflow_id, child.workflow_id_suffix),
                    workflow=found.name,
                    version=found.version,
                    spec_hash=found.spec_hash,
                    state=RunState.initial(
                        [n["id"] for n in found.spec["nodes"]],
                        # the child workflow's own default deadline, from its start
                        deadline_at=deadline_after(now, found.spec.get("deadline")),
                    ),
                    input=child.input,
                    parent_run_id=loaded.run_id,
                    parent_node=child.node,
                    trace_context=loaded.trace_context,
                    priority=loaded.priority,  # children inherit their parent's priority
                    created_at=now,
                    updated_at=now,
                )
            )
            .on_conflict_do_nothing()
            .returning(workflow_run.c.run_id)
        ).first()
        if inserted is not None:  # (rowcount is not reliable for ON CONFLICT on psycopg)
            intents.append(wakeup_intent(child.run_id))
            started.append(
                {
                    "at": now,
                    "actor": f"parent:{loaded.run_id}",
                    "action": AuditAction.START.value,
                    "source": AuditSource.PARENT.value,
                    "run_id": child.run_id,
                    "workflow_id": child_workflow_id(loaded.workflow_id, child.workflow_id_suffix),
                    "node": child.node,
                    "detail": {"workflow": found.name},
                }
            )
        elif not run_exists(conn, child.run_id):
            # Its workflow id is taken by an open run: tick this parent again at once, so it
            # reads the child as missing and fails the node saying so.
            intents.append(wakeup_intent(loaded.run_id))
    for control in payload.child_controls:
        child_wf = conn.execute(
            sa.select(workflow_run.c.workflow_id).where(workflow_run.c.run_id == control.run_id)
        ).scalar_one_or_none()
        if child_wf is None:
            continue  # never inserted (its workflow id was taken): nothing to close
        lock_workflow_signals(conn, child_wf)
        target = newest_of_chain(conn, control.run_id)
        conn.execute(
            sa.insert(workflow_control).values(
                run_id=target,
                kind=control.kind,
                reason=control.reason[:2000],
                requested_by=f"parent:{loaded.run_id}",
                source=AuditSource.PARENT.value,
                created_at=now,
            )
        )
        intents.append(wakeup_intent(target))
    audit.record_many(conn, started)
    return insert_outbox(conn, intents, now)


def reject_control(engine: Engine, control_id: int, result: str) -> None:
    """Mark a control handled without applying it (its commit would break a database rule)."""
    with engine.begin() as conn:
        conn.execute(
            sa.update(workflow_control)
            .where(workflow_control.c.id == control_id, workflow_control.c.handled_at.is_(None))
            .values(handled_at=sa.func.now(), result=result[:2000])
        )


def _more_controls(conn: Connection, run_id: str, handled: int) -> bool:
    found = conn.execute(
        sa.select(workflow_control.c.id)
        .where(
            workflow_control.c.run_id == run_id,
            workflow_control.c.handled_at.is_(None),
            workflow_control.c.id != handled,
        )
        .limit(1)
    )
    return found.first() is not None


def _lease_keys_of(conn: Connection, tokens: list[str]) -> list[str]:
    if not tokens:
        return []
    return [
        k
        for k in conn.execute(
            sa.select(step_attempt.c.lease_key).where(
                step_attempt.c.token.in_(tokens), step_attempt.c.lease_key.is_not(None)
            )
        ).scalars()
        if k
    ]


def _prior_attempts(conn: Connection, payload: TickPayload) -> dict[str, Any]:
    """The earlier attempts that retries copy their arguments, lease key and rate key from."""
    copied = [a.args_from for a in payload.new_attempts if a.args_from]
    if not copied:
        return {}
    rows = conn.execute(
        sa.select(
            step_attempt.c.token,
            step_attempt.c.args,
            step_attempt.c.lease_key,
            step_attempt.c.rate_key,
        ).where(step_attempt.c.token.in_(copied))
    )
    return {r.token: r for r in rows}


def _lease_keys(payload: TickPayload, prior: dict[str, Any]) -> list[tuple[Any, str | None]]:
    out = []
    for a in payload.new_attempts:
        source = prior.get(a.args_from) if a.args_from else None
        out.append((a, source.lease_key if source is not None else a.lease_key))
    return out


def _insert_attempts(
    conn: Connection,
    loaded: LoadedRun,
    payload: TickPayload,
    prior: dict[str, Any],
    now: datetime,
    claim: TickClaim | None = None,
) -> set[str]:
    """Insert the tick's new attempts and ask for their leases (the caller holds the keys'
    locks). Returns the tokens that wait for a lease. A retry copies its first attempt's
    arguments, lease key and rate key."""
    rows: list[dict[str, Any]] = []
    requests: list[leases.LeaseRequest] = []
    for a, lease_key in _lease_keys(payload, prior):
        source = prior.get(a.args_from) if a.args_from else None
        args = (source.args if source is not None else {}) if a.args_from else a.args
        limit = (a.lease_limit or 1) if lease_key else None
        claimed_by = claim.worker if claim is not None and claim.token == a.token else None
        rows.append(
            {
                "token": a.token,
                "run_id": loaded.run_id,
                "node": a.node,
                "branch": a.branch,
                "generation": a.generation,
                "attempt": a.attempt,
                "step": a.step,
                "queue": a.queue,
                "args": args,
                "timeout": a.timeout,
                "created_at": now,
                "folded": False,
                "priority": loaded.priority,
                "lease_key": lease_key,
                "lease_limit": limit,
                # A retry takes its tokens from its first attempt's bucket.
                "rate_key": source.rate_key if source is not None else a.rate_key,
                "rate_limit": a.rate_limit,
                "rate_period": a.rate_period,
                "claimed_at": None if claimed_by is None else now,
                "claimed_by": claimed_by,
                "carrier": None if claimed_by is None or claim is None else claim.carrier,
            }
        )
        if lease_key:
            requests.append(
                leases.LeaseRequest(
                    a.token, loaded.run_id, a.node, lease_key, limit or 1, a.timeout
                )
            )
    conn.execute(sa.insert(step_attempt), rows)
    if not requests:
        return set()
    granted = leases.acquire(conn, requests, now)
    return {r.token for r in requests} - granted
