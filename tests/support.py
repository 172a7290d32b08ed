"""Helpers the test tiers share: a step stand-in, the pure tick's fixtures, and one store tick.

Importable as ``support`` from every test (``tests/`` is on ``sys.path``, as for ``servers``
and ``cluster``).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from ductor_celery.coordinator import Coordinator, TickResult
from ductor_celery.definition import RetryPolicy, WorkflowSpec
from ductor_celery.definition.retry import ConcurrencyLimit
from ductor_celery.engine import (
    AttemptResult,
    EngineConfig,
    NodeState,
    RunState,
    TickInputs,
    TickPayload,
    compute_tick,
)
from ductor_celery.engine.outputs import AttemptOutput, EventsOutput, LiteralOutput, SignalOutput
from ductor_celery.engine.state import OPEN_KEY, UNSTARTED_KEY
from ductor_celery.engine.status import TERMINAL_RUN_STATUSES
from ductor_celery.fakes import RecordingDispatcher
from ductor_celery.settings import Settings
from ductor_celery.store.load import LoadedRun, load_on
from ductor_celery.store.outbox import OutboxRow
from ductor_celery.store.schema import step_attempt
from ductor_celery.store.tick_store import SqlTickStore
from ductor_celery.store.ticks import commit_on

# -- a step -------------------------------------------------------------------------------------


@dataclass
class FakeStep:
    """Stands in for a ``@ductor.step`` object: what the workflow builder reads of one (the
    ``StepLike`` protocol, plus the optional ``heartbeat_timeout``, ``concurrency`` and
    ``schedule_to_start_timeout``)."""

    name: str = "s.x"
    retry: RetryPolicy = RetryPolicy()
    timeout: float | None = None
    queue: str | None = None
    heartbeat_timeout: float | None = None
    concurrency: ConcurrencyLimit | None = None
    schedule_to_start_timeout: float | None = None


# -- the pure tick ------------------------------------------------------------------------------


def token_of(ns: NodeState) -> str | None:
    """The attempt row a node's output is in (``AttemptOutput``), or None."""
    return ns.output.token if isinstance(ns.output, AttemptOutput) else None


def signal_of(ns: NodeState) -> int | None:
    """The signal row a wait's or approval's output is in (``SignalOutput``), or None."""
    return ns.output.signal if isinstance(ns.output, SignalOutput) else None


def events_of(ns: NodeState) -> dict[str, int] | None:
    """An event set's event -> signal row references (``EventsOutput``), or None."""
    return dict(ns.output.events) if isinstance(ns.output, EventsOutput) else None


def literal_of(ns: NodeState) -> Any:
    """A literal output kept in the state (``LiteralOutput``), or None."""
    return ns.output.value if isinstance(ns.output, LiteralOutput) else None


RUN = "r1"
NOW = datetime(2024, 1, 1, 12, 0, tzinfo=UTC)
#: cancel_grace=0: a cancel closes what is in flight at once, the behaviour these pure-tick
#: tests were written for; the cooperative cancel (a grace) has its own tests
#: (tests/unit/test_tick_cancel.py).
CFG = EngineConfig(resend_unclaimed_after=30.0, default_step_timeout=300.0, cancel_grace=0)
#: The run's own transition on its first tick.
RUN_STARTED = (None, "pending", "running", "started")


def at(seconds: float) -> datetime:
    return NOW + timedelta(seconds=seconds)


def iso(seconds: float) -> str:
    return at(seconds).isoformat()


def pure_tick(
    spec: WorkflowSpec, state: RunState, inputs: TickInputs, now: datetime
) -> TickPayload:
    """compute_tick, asserting that the input state is left untouched."""
    before = copy.deepcopy(state)
    before_json = copy.deepcopy(state.to_json())
    payload = compute_tick(spec, state, inputs, now)
    assert state == before
    assert state.to_json() == before_json
    assert payload.state is not state
    return payload


def payload_of(
    done: TickResult,
    run_id: str,
    spec: WorkflowSpec,
    before: RunState,
    config: EngineConfig,
    now: datetime,
) -> TickPayload:
    """What a coordinator tick decided. A tick of a settled run (finished, nothing to fold)
    ends before its load and computes nothing: then the full computation over the state it
    skipped, which must agree that there was nothing to do."""
    if done.payload is not None:
        return done.payload
    assert done.outcome == "noop", done
    assert before.status in TERMINAL_RUN_STATUSES, before.status
    payload = compute_tick(spec, before, TickInputs(run_id=run_id, config=config), now)
    assert not payload.changed, "a tick ended as settled had something to do"
    return payload


def ok(token: str, output: Any = None, patch: dict[str, Any] | None = None) -> AttemptResult:
    """A succeeded attempt of the node named in ``token`` (``run:node:generation``)."""
    return AttemptResult(
        token=token, node=token.split(":")[1], outcome="succeeded", output=output, patch=patch
    )


def err(token: str, message: str = "boom", retryable: bool = True) -> AttemptResult:
    """A failed attempt of the node named in ``token``."""
    return AttemptResult(
        token=token,
        node=token.split(":")[1],
        outcome="failed",
        error={"type": "RuntimeError", "message": message},
        retryable=retryable,
    )


def summary(**overrides: Any) -> dict[str, Any]:
    """The describe() of a tick that did nothing, with ``overrides`` applied."""
    base: dict[str, Any] = {
        "status": "running",
        "nodes": {},
        "new_attempts": [],
        "closed": [],
        "folded": [],
        "dispatches": [],
        "transitions": [],
        "next_wake_at": None,
        "output": None,
        "error": None,
    }
    base.update(overrides)
    return base


# -- a tick against the store -------------------------------------------------------------------
# ``tick_once`` is the production tick loop (coordinator.Coordinator over the SQL store), with
# the dispatcher recording instead of sending. ``load_tick``/``commit_tick`` split a tick in
# two transactions on purpose, for tests that change the store between the load and the
# commit (a conflicting writer, a worker finishing meanwhile).

#: The engine settings of a default ``Settings()``, but with a cancel closing what is in flight
#: at once (no grace), the behaviour these hand-driven ticks were written for; the cooperative
#: cancel has its own tests (tests/integration/test_cooperative_cancel.py).
CONFIG = dataclasses.replace(Settings().engine_config(), cancel_grace=0)


def load_tick(
    engine: Engine,
    run_id: str,
    spec_for: Callable[[str], WorkflowSpec],
    config: EngineConfig,
) -> tuple[LoadedRun, WorkflowSpec, TickInputs] | None:
    """Read everything one tick needs on a connection of its own. None: no such run."""
    with engine.connect() as conn:
        return load_on(conn, run_id, lambda spec_hash, _conn: spec_for(spec_hash), config)


def commit_tick(engine: Engine, loaded: LoadedRun, payload: TickPayload) -> list[OutboxRow]:
    """Write the payload in one transaction, or raise VersionConflict and write nothing."""
    with engine.begin() as conn:
        return commit_on(conn, loaded, payload)


def sql_coordinator(
    engine: Engine, spec_for: Callable[[str], WorkflowSpec], config: EngineConfig = CONFIG
) -> tuple[Coordinator[Any], RecordingDispatcher]:
    """The production tick loop over ``engine``, sending into a recording dispatcher."""
    sent = RecordingDispatcher()
    store = SqlTickStore(engine, lambda spec_hash, _conn: spec_for(spec_hash), config)
    return Coordinator(store, sent), sent


def tick_once(
    engine: Engine, run_id: str, spec_for: Callable[[str], WorkflowSpec]
) -> list[OutboxRow]:
    """One coordinator tick of the run: the outbox rows its commit wrote (none for a no-op)."""
    coordinator, _ = sql_coordinator(engine, spec_for)
    return coordinator.tick(run_id).outbox


def unclaimed_attempts(engine: Engine, run_id: str) -> list[tuple[str, str]]:
    """The run's attempts no worker has claimed or finished, as (token, step), by token: what
    a test delivers by hand in place of the broker."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(step_attempt.c.token, step_attempt.c.step)
            .where(
                step_attempt.c.run_id == run_id,
                step_attempt.c.claimed_at.is_(None),
                step_attempt.c.finished_at.is_(None),
            )
            .order_by(step_attempt.c.token)
        ).all()
    return [(r.token, r.step) for r in rows]


def grow_attempts(engine: Engine, rows: int, *, run: str = "grown", folded: bool = True) -> None:
    """The attempts table grown by ``rows`` finished attempts of another run (as a scatter
    leaves them), ``<run>:s:1``...: for the plans PostgreSQL makes on a table of that size."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO eec_workflow_step_attempt (token, run_id, node, branch, "
                "generation, attempt, step, queue, args, timeout, created_at, folded, "
                "finished_at, outcome) SELECT :run || ':s:' || g, :run, 's', g, 1, 1, 'c', "
                "'q', '{}'::jsonb, 60, now(), :folded, now(), 'succeeded' "
                "FROM generate_series(1, :rows) AS g"
            ),
            {"folded": folded, "rows": rows, "run": run},
        )


def attempts_scanned(conn: Any) -> int:
    """The attempt rows this backend has read by scanning the whole table so far, including
    what it has not reported to the shared statistics yet (it reports between transactions:
    two reads in one transaction give what happened between them)."""
    return int(
        conn.exec_driver_sql(
            "SELECT coalesce(seq_tup_read, 0) FROM pg_stat_xact_user_tables "
            "WHERE relname = 'eec_workflow_step_attempt'"
        ).scalar_one()
    )


def attempt_reads_so_far(conn: Any) -> tuple[int, int]:
    """This transaction's attempt rows read by scanning the table and fetched by an index."""
    scanned = attempts_scanned(conn)
    fetched = conn.exec_driver_sql(
        "SELECT coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables "
        "WHERE relname = 'eec_workflow_step_attempt'"
    ).scalar_one()
    return scanned, int(fetched)


def record_psycopg_statements(monkeypatch: Any) -> list[tuple[str, bool]]:
    """Every statement psycopg sends from now on (until ``monkeypatch`` undoes it) on this
    thread, through SQLAlchemy or straight to psycopg's cursor (the hot paths: a start's
    insert, a tick's statements), with whether it went in autocommit (then no ``BEGIN``
    went before it, and no ``COMMIT``/``ROLLBACK`` follows). Other threads' are not the
    call's: the outbox janitor deletes sent rows in the background (runtime/outbox_janitor.py)."""
    import psycopg

    seen: list[tuple[str, bool]] = []
    execute = psycopg.Cursor.execute
    recording = threading.get_ident()

    def record(cursor: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == recording:
            seen.append((str(query), bool(cursor.connection.autocommit)))
        return execute(cursor, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", record)
    return seen


def recording_ductor(database_url: str, name: str) -> Any:
    """A Ductor on ``database_url`` whose dispatcher records every message into its ``queue``
    (``ductor_celery.testing``'s), for ``run_to_end`` to deliver."""
    from collections import deque

    from celery import Celery

    from ductor_celery import Ductor
    from ductor_celery.testing import _RecordingDispatcher

    app = Celery(name, set_as_current=False)
    app.conf.broker_url = "memory://"
    d = Ductor(app, database_url=database_url)
    d.queue = deque()  # type: ignore[attr-defined]
    d.runtime.dispatcher = _RecordingDispatcher(d.queue, [])  # type: ignore[attr-defined,assignment]
    return d


def run_to_end(d: Any, workflow: str, input: Any, queue: str = "ductor-steps") -> str:
    """Start a run on ``d`` (``recording_ductor``'s) and deliver every message the way a step
    worker and the coordinator handle them (a run's first tick, inline steps, eager ticks)
    until it ends."""
    from ductor_celery.runtime.dispatch import first_tick_id
    from ductor_celery.runtime.steps import execute_attempt, first_tick
    from ductor_celery.runtime.tick_task import run_tick

    run_id: str = d.start(workflow, input=input).run_id
    rt = d.runtime
    for _ in range(500):
        if d.queue:
            message = d.queue.popleft()
            if message.kind == "first_tick":
                first_tick(rt, message.run_id, "h", queue, first_tick_id(message.run_id))
            elif message.kind == "step":
                step = rt.step_named(message.task)
                execute_attempt(
                    rt, step, message.token, hostname="h", queue=queue, carrier=message.token
                )
            elif message.kind == "wakeup":
                run_tick(rt, message.run_id)
        elif d.get(run_id).status in TERMINAL_RUN_STATUSES:
            return run_id
        else:
            run_tick(rt, run_id)  # a retry's backoff of 0 s is due: what its timer would do
    raise AssertionError(f"run {run_id} did not end: {d.get(run_id).status}")


def with_unstarted(stored: dict[str, Any]) -> dict[str, Any]:
    """A stored state's JSON (``store/state_text.py``) with its held nodes under ``nodes`` and
    its ``unstarted`` names given back as pending nodes, as ``eec_run_state`` (migration 0020)
    gives them back; its ``done`` ones need their attempt rows, and stay named."""
    if OPEN_KEY not in stored:
        return stored
    whole = {k: v for k, v in stored.items() if k not in (OPEN_KEY, UNSTARTED_KEY)}
    names = stored.get(UNSTARTED_KEY)
    unstarted = {n: {"status": "pending"} for n in names.split(",")} if names else {}
    whole["nodes"] = {**stored[OPEN_KEY], **unstarted}
    return whole
