"""Load one run for a tick: the run row and the inbox (results, control, signals, checks).

A single first query returns the run row, the database clock and whether each inbox holds
anything, so a redundant wake-up costs one indexed read and no more.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from datetime import datetime
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg.rows import namedtuple_row
from sqlalchemy.dialects.postgresql import aggregate_order_by
from sqlalchemy.engine import Connection, Engine

from ..coordinator.port import LoadedRun, RunBusy
from ..coordinator.read_rows import RESULT_COLUMNS, attempt_result
from ..definition.blobrefs import contains_ref
from ..definition.spec import RunConcurrencySpec, WorkflowSpec
from ..engine import (
    AttemptCheck,
    AttemptResult,
    ControlIn,
    EngineConfig,
    NodeStatus,
    RunState,
    SignalIn,
    TickInputs,
)
from ..engine.children import may_stop
from ..engine.delay import waiting_to_start
from ..engine.kinds import ControlKind
from ..engine.outputs import OutputRef, output_ref, received_events, resolve_outputs
from ..engine.redrive import reads_for
from ..engine.slots import slots
from ..engine.state import DONE_KEY
from ..engine.status import TERMINAL_RUN_STATUSES, RunStatus
from ..engine.tick import ACTIVE, read_nodes
from ..engine.versions import successor_spec_hash
from . import blobs, clock, done_nodes, run_slots
from .composed import ImmutableCache, PerDatabase, cache_for, children_of, gather_any
from .db import LOCK_NOT_AVAILABLE, aware, driver_compiled, driver_cursor
from .dialect import dialect_of
from .done_nodes import read_done
from .inputs import redriven_input
from .leases import holds_lease
from .outputs import ConnectionOutputs, signal_payloads
from .schema import (
    step_attempt,
    workflow_control,
    workflow_run,
    workflow_signal,
    workflow_timer,
)

#: Run inputs by database and run id: an input never changes once its run is inserted
#: (nothing updates ``eec_workflow_run.input``; a new input means a new run). Few entries per
#: database: one can be large.
_inputs_caches: PerDatabase = weakref.WeakKeyDictionary()


def _inputs_cache(engine: Engine) -> ImmutableCache:
    return cache_for(_inputs_caches, engine, size=64)


def exists_where(table: sa.Table, *where: Any) -> Any:
    # ``1`` as SQL text, not a bound literal: nothing to bind per call in the hot reads.
    return sa.exists(sa.select(sa.literal_column("1")).select_from(table).where(*where))


def load_on(
    conn: Connection,
    run_id: str,
    spec_for: Callable[[str, Connection], WorkflowSpec],
    config: EngineConfig,
    *,
    wait_for_lock: bool = True,
    bounds: tuple[str, str] | None = None,
    in_transaction: bool = True,
    kept: Any = None,
) -> tuple[LoadedRun, WorkflowSpec, TickInputs] | None:
    """Read everything one tick needs, on ``conn`` (the coordinator's commit transaction).

    On PostgreSQL the run row is read ``FOR UPDATE``: the row lock is the run's tick lock, held
    until the tick commits or rolls back, so two processes never compute one run at once (the
    version check stays the last line of defence). ``wait_for_lock=False`` (an eager tick in a
    step worker) reads it ``FOR UPDATE SKIP LOCKED`` and raises ``RunBusy`` when another tick
    holds it. SQLite needs neither: every tick transaction starts with ``BEGIN IMMEDIATE``,
    which serializes them.

    ``spec_for`` gets the connection too: a definition missing from the process cache is read
    on it, never on a second connection (on SQLite that one would wait for this one's lock).

    ``bounds`` (PostgreSQL, ``wait_for_lock=False``): the transaction's idle and lock
    timeouts (``store/tick_store.py``), set by the run-row read itself, one round trip less
    for every eager tick. A read that skips a locked row waits for no lock, so the lock
    timeout is in force from its end on, for every statement that could wait; a read that
    waits for the lock must have it set before (the caller's own statement).

    ``in_transaction=False`` (PostgreSQL, ``wait_for_lock=False``): ``conn`` is in autocommit
    (docs/tick-without-transaction.md); the run row is read without a lock (the commit takes
    it: a lock taken by a read in autocommit would be released at once, and would cost its
    own commit record and WAL flush), and a run whose load would write (a concurrency key's
    admission) raises ``NeedsTransaction`` before any write.

    ``kept``: the run row as this thread's last commit returned it (``next_read.take``;
    docs/next-read-from-commit.md), read instead of the run row while the run's input is
    cached.
    """
    input_cache = _inputs_cache(conn.engine)
    cached, _ = input_cache.get_many([run_id])
    if kept is not None and run_id in cached:
        row = kept
    else:
        row = _run_row(
            conn,
            run_id,
            wait_for_lock,
            with_input=run_id not in cached,
            bounds=bounds,
            lock=in_transaction,
        )
    if row is None:
        if not wait_for_lock and _run_exists(conn, run_id):
            raise RunBusy(run_id)
        return None
    now = aware(row.now) if row.now is not None else clock.now(conn.engine)
    assert now is not None
    # A kept read's state is decoded already (``next_read.take``).
    state = row.state if isinstance(row.state, RunState) else RunState.from_json(row.state)
    loaded = LoadedRun(
        run_id=row.run_id,
        workflow_id=row.workflow_id,
        workflow=row.workflow,
        spec_hash=row.spec_hash,
        record_version=row.record_version,
        state=state,
        now=now,
        parent_run_id=row.parent_run_id,
        timer_at=aware(row.timer_at),
        created_at=aware(row.created_at),
        trace_context=row.trace_context,
        priority=row.priority or 0,
        done=read_done(getattr(row, "done", None)),
    )
    spec = spec_for(row.spec_hash, conn)
    if "results" in row._fields:
        results = _aggregated_results(row.results)
    else:
        results = _results(conn, run_id) if row.has_results else ()
    control = _control(conn, run_id) if row.has_control else None
    if state.status in TERMINAL_RUN_STATUSES and control is None:
        return loaded, spec, TickInputs(run_id=run_id, results=results, config=config)
    if state.input_from is not None:  # a redrive replaced the input (engine/redrive.py)
        run_input = redriven_input(conn, input_cache, run_id, state.input_from)
    elif run_id in cached:
        run_input = cached[run_id]
    else:
        run_input = _remember(input_cache, run_id, row.input)
    admission = run_slots.Admission(True)
    if spec.concurrency is not None:
        if not in_transaction:
            raise NeedsTransaction(run_id)
        # A redrive with a new input is admitted under the key that input gives.
        key_input = run_input
        if control is not None and control.kind == ControlKind.REDRIVE and control.has_input:
            key_input = control.input
        key = None
        if key_input is run_input and state.input_from is None and contains_ref(key_input):
            # A large input's key as admission stored it: the input is read back for the key
            # only until the run has a slot row, not on every tick (docs/large-values.md).
            key = run_slots.stored_key(conn, run_id)
        if key is None:
            # The key reads inside the input: a large input is read back for it.
            key_input = blobs.resolved(conn, key_input, f"the input of run {run_id}")
            key = run_slots.key_for(spec.name, spec.concurrency, key_input)
        loaded = dataclasses.replace(
            loaded, concurrency_key=key, concurrency_limit=spec.concurrency.limit
        )
        admission = _admission(conn, loaded, spec.concurrency, key)
    inputs = TickInputs(
        run_id=run_id,
        input=run_input,
        results=results,
        admitted=admission.admitted,
        refused=admission.refused,
        wake=admission.wake,
        checks=_checks(conn, state, now),
        outputs=_outputs_for(conn, spec, state, reads_for(spec, control, state)),
        config=config,
        signals=_signals(conn, run_id) if row.has_signals else (),
        control=control,
        received=_received(conn, state),
        gathered={
            node: gather_any(conn, spec, node, ns.scatter)
            for node, ns in state.nodes.items()
            if ns.status in ACTIVE and ns.scatter is not None and ns.scatter.gathering
        },
        children=children_of(conn, spec, state, stopping=may_stop(state, control, now)),
        successor_spec=_successor_spec(conn, spec_for, successor_spec_hash(state, control)),
    )
    return loaded, spec, inputs


class NeedsTransaction(Exception):
    """A load in autocommit found it has to write (``load_on``'s ``in_transaction``)."""


def _admission(
    conn: Connection, loaded: LoadedRun, spec: RunConcurrencySpec, key: str
) -> run_slots.Admission:
    """Run concurrency: a pending run due to start takes a slot of its key or waits; a paused
    one is admitted if it holds a slot (where a resume takes it); others started already."""
    state = loaded.state
    if state.status == RunStatus.PENDING and not waiting_to_start(state, loaded.now):
        return run_slots.admit(
            conn,
            run_id=loaded.run_id,
            key=key,
            spec=spec,
            priority=loaded.priority,
            now=loaded.now,
        )
    if state.status == RunStatus.PAUSED:
        return run_slots.Admission(run_slots.is_granted(conn, loaded.run_id))
    return run_slots.Admission(True)


def _successor_spec(
    conn: Connection, spec_for: Callable[[str, Connection], WorkflowSpec], spec_hash: str | None
) -> WorkflowSpec | None:
    """The definition a continue-as-new moves the run to (``version=``). Missing (deleted by
    hand): None, and the tick drops the continue-as-new, saying so."""
    if spec_hash is None:
        return None
    try:
        return spec_for(spec_hash, conn)
    except LookupError:
        return None


def _run_exists(conn: Connection, run_id: str) -> bool:
    found = conn.execute(sa.select(workflow_run.c.run_id).where(workflow_run.c.run_id == run_id))
    return found.first() is not None


def _remember(cache: ImmutableCache, key: str, value: Any) -> Any:
    cache.put(key, value)
    return value


def _run_row(
    conn: Connection,
    run_id: str,
    wait_for_lock: bool = True,
    *,
    with_input: bool = True,
    bounds: tuple[str, str] | None = None,
    lock: bool = True,
) -> Any:
    # PostgreSQL's form of the read (the clock, the results aggregated, the row locked) is
    # the one-statement one; SQLite's transaction is BEGIN IMMEDIATE already.
    postgres = dialect_of(conn).one_statement
    if not postgres:
        query = _run_row_statement(False, False, with_input)
        return conn.execute(query, {"b_run": run_id}).one_or_none()
    if bounds is not None and wait_for_lock:
        raise ValueError("a read that waits for the run's lock sets no timeouts of its own")
    text = _run_row_text(not wait_for_lock, with_input, bounds is not None, lock)
    params = {"b_run": run_id}
    if bounds is not None:
        params.update(b_idle=bounds[0], b_lock=bounds[1])
    try:
        row = _fetch_on_driver(conn, text, params)
    except (sa.exc.OperationalError, psycopg.OperationalError) as exc:
        orig = exc.orig if isinstance(exc, sa.exc.OperationalError) else exc
        if getattr(orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
            raise
        # Another tick held the run past ``TICK_LOCK_TIMEOUT`` (a process stopped or cut off
        # mid-tick): leave the run to the sweeper's lost-wake-up scan rather than wait on
        # with this worker's whole queue behind it (store/tick_store.py).
        raise RunBusy(run_id) from exc
    if row is not None and row.snapshot_version != row.record_version:
        # This statement waited for the run's lock while another tick committed the run.
        # Under READ COMMITTED the locked row is re-read as that tick left it, but the
        # subqueries (results, timer, inbox flags) keep the snapshot from before it: results
        # it folded, a timer it moved. Read again: we hold the lock now, so no other tick
        # can commit the run in between, and the new statement's snapshot is fresh.
        row = _fetch_on_driver(conn, text, params)
    return row


def _fetch_on_driver(conn: Connection, text: str, params: dict[str, str]) -> Any:
    """The run-row read straight on psycopg's cursor, inside the tick's transaction: the
    first read of every tick, whose text never changes, so SQLAlchemy's execution context
    and result wrapping are pure cost (as for the one-statement commit, store/pg_commit.py).
    The row is a named tuple (``row.state``, ``row._fields``), as SQLAlchemy's; psycopg
    decodes the JSON and timestamp columns as SQLAlchemy's psycopg dialect does. A dropped
    connection raises psycopg's own ``OperationalError``, which ``db.is_transient`` retries
    like SQLAlchemy's (``db.driver_cursor`` invalidates the connection first)."""
    with driver_cursor(conn, row_factory=namedtuple_row) as cursor:
        cursor.execute(text, params)
        return cursor.fetchone()


@functools.cache
def _run_row_text(
    skip_locked: bool, with_input: bool, bounds: bool = False, lock: bool = True
) -> str:
    """``_run_row_statement`` on PostgreSQL as psycopg's text (``%(b_run)s``), compiled once
    per process; ``bounds``: with the transaction's timeouts set by the same statement
    (``%(b_idle)s``, ``%(b_lock)s``; ``load_on``'s ``bounds``)."""
    query = _run_row_statement(True, skip_locked, with_input, lock)
    if bounds:
        query = query.add_columns(
            sa.func.set_config(
                sa.literal_column("'idle_in_transaction_session_timeout'"),
                sa.bindparam("b_idle", type_=sa.String),
                sa.true(),
            ).label("bound_idle"),
            sa.func.set_config(
                sa.literal_column("'lock_timeout'"),
                sa.bindparam("b_lock", type_=sa.String),
                sa.true(),
            ).label("bound_lock"),
        )
    return str(driver_compiled(query))


@functools.cache
def _run_row_statement(
    postgres: bool, skip_locked: bool, with_input: bool, lock: bool = True
) -> Any:
    """The tick's first read (bind parameter ``b_run``), built once per process: the run row,
    the database clock, its timer, and whether each inbox holds anything.

    The run's input only ``with_input``: it never changes after the run is inserted, so each
    process keeps the recent ones (``_inputs_cache``). A scatter's item list can be most of a
    megabyte; read and decoded by every tick of the run, it made a 10,000-item scatter cost
    quadratic time."""
    run_id = sa.bindparam("b_run", type_=sa.String)
    # NULL as SQL text (``sa.null()``), not a bound literal: nothing to bind per tick.
    now_col = sa.func.now() if postgres else sa.null()
    other = workflow_run.alias("snapshot")
    query = sa.select(
        workflow_run.c.run_id,
        workflow_run.c.workflow_id,
        workflow_run.c.workflow,
        workflow_run.c.spec_hash,
        workflow_run.c.record_version,
        done_nodes.full_state().label("state"),
        (workflow_run.c.input if with_input else sa.null()).label("input"),
        workflow_run.c.parent_run_id,
        workflow_run.c.created_at,
        workflow_run.c.trace_context,
        workflow_run.c.priority,
        now_col.label("now"),
        # The version as the statement's snapshot saw it (a subquery is never re-read after
        # waiting for a lock, the locked row is): differs from record_version exactly when
        # this read waited for another tick's commit (``_run_row``).
        sa.select(other.c.record_version)
        .where(other.c.run_id == run_id)
        .scalar_subquery()
        .label("snapshot_version"),
        sa.select(workflow_timer.c.fire_at)
        .where(workflow_timer.c.run_id == run_id)
        .scalar_subquery()
        .label("timer_at"),
        _results_column(run_id, postgres),
        # The nodes the state left to their attempt rows (given back in ``state``).
        (
            workflow_run.c.state.op("->")(sa.literal_column(f"'{DONE_KEY}'"))
            if postgres
            else sa.null()
        ).label("done"),
        exists_where(
            workflow_control,
            workflow_control.c.run_id == run_id,
            workflow_control.c.handled_at.is_(None),
        ).label("has_control"),
        exists_where(
            workflow_signal,
            workflow_signal.c.run_id == run_id,
            workflow_signal.c.applied_at.is_(None),
        ).label("has_signals"),
    ).where(workflow_run.c.run_id == run_id)
    if postgres and lock:
        # Lock the run row only (the EXISTS subqueries read the inbox tables without locks).
        query = query.with_for_update(of=workflow_run, skip_locked=skip_locked)
    return query


def _results(conn: Connection, run_id: str) -> tuple[AttemptResult, ...]:
    """Finished attempts not folded yet, in the order they finished."""
    rows = conn.execute(_results_statement(), {"b_run": run_id})
    return tuple(attempt_result(*r) for r in rows)


def _results_column(run_id: Any, postgres: bool) -> Any:
    """On PostgreSQL, the unfolded results themselves, as one JSON array in finish order, each
    result an array of its ``RESULT_COLUMNS`` (the
    run-row read then brings them in the same round trip); on SQLite, whether there are any
    (read next by ``_results``: SQLite is in-process, a second query costs no trip)."""
    unfolded = (
        step_attempt.c.run_id == run_id,
        step_attempt.c.unfolded,
    )
    if not postgres:
        return exists_where(step_attempt, *unfolded).label("has_results")
    row = sa.func.json_build_array(*(step_attempt.c[c] for c in RESULT_COLUMNS))
    ordered = aggregate_order_by(row, step_attempt.c.finished_at, step_attempt.c.token)
    return sa.select(sa.func.json_agg(ordered)).where(*unfolded).scalar_subquery().label("results")


def _aggregated_results(rows: list[list[Any]] | None) -> tuple[AttemptResult, ...]:
    return tuple(attempt_result(*r) for r in rows or ())


@functools.cache
def _results_statement() -> Any:
    return (
        sa.select(*(step_attempt.c[c] for c in RESULT_COLUMNS))
        .where(
            step_attempt.c.run_id == sa.bindparam("b_run", type_=sa.String),
            step_attempt.c.unfolded,
        )
        .order_by(step_attempt.c.finished_at, step_attempt.c.token)
    )


def _control(conn: Connection, run_id: str) -> ControlIn | None:
    """The oldest control not handled yet: one per tick."""
    row = conn.execute(
        sa.select(
            workflow_control.c.id,
            workflow_control.c.kind,
            workflow_control.c.reason,
            workflow_control.c.input,
            workflow_control.c.has_input,
            workflow_control.c.node,
            workflow_control.c.spec_hash,
        )
        .where(workflow_control.c.run_id == run_id, workflow_control.c.handled_at.is_(None))
        .order_by(workflow_control.c.id)
        .limit(1)
    ).one_or_none()
    if row is None:
        return None
    return ControlIn(
        id=row.id,
        kind=ControlKind.parse(row.kind),
        reason=row.reason,
        input=row.input,
        has_input=bool(row.has_input),
        node=row.node,
        spec_hash=row.spec_hash,
    )


def _signals(conn: Connection, run_id: str) -> tuple[SignalIn, ...]:
    """Signals not applied yet, in the order they were accepted."""
    rows = conn.execute(
        sa.select(workflow_signal.c.id, workflow_signal.c.name, workflow_signal.c.payload)
        .where(workflow_signal.c.run_id == run_id, workflow_signal.c.applied_at.is_(None))
        .order_by(workflow_signal.c.id)
    )
    return tuple(SignalIn(id=r.id, name=r.name, payload=r.payload) for r in rows)


def _checks(conn: Connection, state: RunState, now: datetime) -> dict[str, AttemptCheck]:
    """Claim status of in-flight attempts whose check time has come."""
    due = [
        slot.token
        for ns in state.nodes.values()
        for _, slot in slots(ns)
        if slot.token is not None and slot.check_at is not None and slot.check_at <= now
    ]
    if not due:
        return {}
    rows = conn.execute(
        sa.select(
            step_attempt.c.token,
            step_attempt.c.claimed_at,
            step_attempt.c.finished_at,
            step_attempt.c.heartbeat_at,
            sa.and_(step_attempt.c.lease_key.is_not(None), ~holds_lease()).label("waiting"),
        ).where(step_attempt.c.token.in_(due))
    )
    return {
        r.token: AttemptCheck(
            token=r.token,
            claimed_at=aware(r.claimed_at),
            finished=r.finished_at is not None,
            heartbeat_at=aware(r.heartbeat_at),
            lease_waiting=bool(r.waiting),
        )
        for r in rows
    }


def _outputs_for(
    conn: Connection, spec: WorkflowSpec, state: RunState, also: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Outputs of earlier-finished nodes that pending nodes (or the run output) read, and the
    nodes in ``also``, from their references (``engine.outputs``): a batched read per kind of
    row."""
    refs: dict[str, OutputRef | None] = {}
    for node_id in read_nodes(spec, state) | also:
        found = state.nodes.get(node_id)
        if found is not None and found.status == NodeStatus.SUCCEEDED:
            refs[node_id] = output_ref(found)
    if not refs:
        return {}
    return resolve_outputs(refs, ConnectionOutputs(conn, spec))


def _received(conn: Connection, state: RunState) -> dict[int, Any]:
    """Payloads of signals already applied to event sets that are still waiting."""
    ids = [
        i
        for ns in state.nodes.values()
        if ns.status == NodeStatus.WAITING
        for i in received_events(ns).values()
    ]
    return signal_payloads(conn, ids)
