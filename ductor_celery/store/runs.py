"""The client's side of the store: definitions, inserting runs, reading run views.

Clients insert a run's first row and then only read; the coordinator owns every update.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import weakref
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from .. import limits
from ..definition.spec import WorkflowSpec
from ..engine.kinds import AuditAction, ControlKind
from ..engine.state import RunState
from ..engine.status import OPEN_RUN_STATUSES, TERMINAL_RUN_STATUSES, RunStatus
from . import audit, blobs, clock, history
from . import tags as run_tags
from .composed import outputs_cache
from .db import autocommit, aware, driver_cursor
from .dialect import dialect_of
from .done_nodes import full_state
from .schema import audit as audit_table
from .schema import (
    step_attempt,
    workflow_control,
    workflow_definition,
    workflow_run,
    workflow_timer,
)
from .start_requests import Requested, RequestKey, record_on, request_insert
from .start_requests import find_on as find_request

RUN_COLUMNS = (
    workflow_run.c.run_id,
    workflow_run.c.workflow_id,
    workflow_run.c.workflow,
    workflow_run.c.version,
    workflow_run.c.spec_hash,
    workflow_run.c.status,
    full_state().label("state"),
    workflow_run.c.input,
    workflow_run.c.output,
    workflow_run.c.error,
    workflow_run.c.record_version,
    workflow_run.c.parent_run_id,
    workflow_run.c.continued_from,
    workflow_run.c.continued_to,
    workflow_run.c.created_at,
    workflow_run.c.finished_at,
)


@dataclass(frozen=True, slots=True)
class RunRow:
    run_id: str
    workflow_id: str
    workflow: str
    version: int
    spec_hash: str
    status: RunStatus
    state: RunState
    input: Any
    output: Any
    error: Any
    record_version: int
    parent_run_id: str | None
    continued_from: str | None
    continued_to: str | None
    created_at: datetime
    finished_at: datetime | None

    @classmethod
    def from_row(cls, row: Any) -> RunRow:
        created = aware(row.created_at)
        assert created is not None
        return cls(
            run_id=row.run_id,
            workflow_id=row.workflow_id,
            workflow=row.workflow,
            version=row.version,
            spec_hash=row.spec_hash,
            status=RunStatus(row.status),
            state=RunState.from_json(row.state),
            input=row.input,
            output=row.output,
            error=row.error,
            record_version=row.record_version,
            parent_run_id=row.parent_run_id,
            continued_from=row.continued_from,
            continued_to=row.continued_to,
            created_at=created,
            finished_at=aware(row.finished_at),
        )


def definition_insert(spec: WorkflowSpec) -> sa.Insert:
    """The row of a stored spec (inserted by ``save_definition``, or in a caller's transaction
    by ``store/joined.py``)."""
    return sa.insert(workflow_definition).values(
        spec_hash=spec.spec_hash,
        name=spec.name,
        version=spec.version,
        spec=spec.model_dump(mode="json"),
    )


def definition_exists(spec_hash: str) -> sa.Select[Any]:
    return sa.select(workflow_definition.c.spec_hash).where(
        workflow_definition.c.spec_hash == spec_hash
    )


#: A run's own definition this process found stored, by engine (its database): the next start
#: of the same definition reads nothing for it (``save_definition(..., remember=True)``). Only
#: a run's own: its insert checks it again for free (the run row's foreign key), and one found
#: gone (deleted by hand, or lost with a failover to a standby that missed its commit) is
#: stored again and the insert retried (``insert_run_requested``). The definitions a run's
#: children pin have no such check at the start, so they are looked up every time, as on
#: SQLite, which enforces no foreign key.
_saved: weakref.WeakKeyDictionary[Engine, set[str]] = weakref.WeakKeyDictionary()


def save_definition(engine: Engine, spec: WorkflowSpec, *, remember: bool = False) -> None:
    """Store a spec under its hash; a second save of the same spec is a no-op. ``remember``
    (a run's own definition, at its start, on PostgreSQL): once found stored, the process's
    next saves of it send no statement (a transaction less per start)."""
    # Without foreign keys (SQLite) nothing would find a remembered one gone.
    remember = remember and dialect_of(engine).enforces_foreign_keys
    saved = _saved.get(engine) if remember else None
    if saved is not None and spec.spec_hash in saved:
        return
    with engine.begin() as conn:
        if not conn.execute(definition_exists(spec.spec_hash)).first():
            try:
                with conn.begin_nested():
                    conn.execute(definition_insert(spec))
            except IntegrityError:
                pass  # saved concurrently by another client: same hash, same spec
    if remember:
        _saved.setdefault(engine, set()).add(spec.spec_hash)


def _forget_saved(engine: Engine, spec_hash: str) -> None:
    _saved.get(engine, set()).discard(spec_hash)


#: The run row's foreign key to its definition (``schema.workflow_run``).
_SPEC_FOREIGN_KEY = "eec_workflow_run_spec_fk"


def load_definition(engine: Engine | Connection, spec_hash: str) -> WorkflowSpec | None:
    query = sa.select(workflow_definition.c.spec).where(
        workflow_definition.c.spec_hash == spec_hash
    )
    if isinstance(engine, Connection):
        spec = engine.execute(query).scalar_one_or_none()
    else:
        with engine.connect() as conn:
            spec = conn.execute(query).scalar_one_or_none()
    return WorkflowSpec.model_validate(spec) if spec is not None else None


def latest_definition(engine: Engine, name: str) -> WorkflowSpec | None:
    with engine.connect() as conn:
        spec = conn.execute(
            sa.select(workflow_definition.c.spec)
            .where(workflow_definition.c.name == name)
            .order_by(workflow_definition.c.version.desc(), workflow_definition.c.created_at.desc())
            .limit(1)
        ).scalar_one_or_none()
    return WorkflowSpec.model_validate(spec) if spec is not None else None


def definition_of_version(engine: Engine, name: str, version: int) -> WorkflowSpec | None:
    """The stored definition of ``name`` at ``version`` (the newest stored, were there two)."""
    with engine.connect() as conn:
        spec = conn.execute(
            sa.select(workflow_definition.c.spec)
            .where(workflow_definition.c.name == name, workflow_definition.c.version == version)
            .order_by(workflow_definition.c.created_at.desc())
            .limit(1)
        ).scalar_one_or_none()
    return WorkflowSpec.model_validate(spec) if spec is not None else None


def stored_versions(engine: Engine, name: str) -> list[int]:
    """The versions of ``name`` stored (each started at least once), ascending."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(workflow_definition.c.version)
            .where(workflow_definition.c.name == name)
            .distinct()
            .order_by(workflow_definition.c.version)
        )
        return [int(v) for (v,) in rows]


def pending_run(
    *,
    run_id: str,
    workflow_id: str,
    workflow: str,
    version: int,
    spec_hash: str,
    state: RunState,
    input: Any,
    **links: Any,
) -> dict[str, Any]:
    """The values of a new run row (a client's start, a successor, a child): pending, version 0.
    ``links``: parent_run_id, parent_node, continued_from, created_at, updated_at."""
    return {
        "run_id": run_id,
        "workflow_id": workflow_id,
        "workflow": workflow,
        "version": version,
        "spec_hash": spec_hash,
        "status": RunStatus.PENDING.value,
        "state": state.to_json(),
        "input": input,
        "record_version": 0,
        "transition_count": 0,
        **links,
    }


def run_insert(**values: Any) -> sa.Insert:
    """The INSERT of a run a client starts (``insert_run``, or ``store/joined.py`` in the
    caller's own transaction): ``started_run_values``' row."""
    return sa.insert(workflow_run).values(started_run_values(**values))


def started_run_values(
    *,
    run_id: str,
    workflow_id: str,
    spec: WorkflowSpec,
    input: Any,
    parent_run_id: str | None = None,
    created_at: datetime | None = None,
    trace_context: str | None = None,
    start_at: datetime | None = None,
    deadline_at: datetime | None = None,
    priority: int | None = None,
    tags: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The row of a run a client starts. ``created_at``: the store's clock when one is
    injected (store/clock.py), else the database's ``now()``."""
    times = {} if created_at is None else {"created_at": created_at, "updated_at": created_at}
    return pending_run(
        run_id=run_id,
        workflow_id=workflow_id,
        workflow=spec.name,
        version=spec.version,
        spec_hash=spec.spec_hash,
        state=RunState.initial(
            spec.graph.order, start_at=start_at, deadline_at=deadline_at, tags=tags
        ),
        input=input,
        parent_run_id=parent_run_id,
        trace_context=trace_context,
        # the workflow's default unless the start says otherwise
        priority=spec.priority if priority is None else priority,
        **times,
    )


def timer_insert(run_id: str, fire_at: datetime) -> sa.Insert:
    """A delayed run's timer row: the sweeper wakes the run when it is due."""
    return sa.insert(workflow_timer).values(run_id=run_id, fire_at=fire_at)


def open_run_of(workflow_id: str) -> sa.Select[Any]:
    """The open run of a workflow id (at most one: a unique index says so)."""
    return sa.select(workflow_run.c.run_id).where(
        workflow_run.c.workflow_id == workflow_id,
        workflow_run.c.status.in_([s.value for s in OPEN_RUN_STATUSES]),
    )


#: Inserts a start tries: one more each time the open run its insert met has ended by the time
#: it is looked for (the next insert then finds no open run, or another one).
INSERT_ROUNDS = 5


def insert_run(
    engine: Engine,
    *,
    run_id: str,
    workflow_id: str,
    spec: WorkflowSpec,
    input: Any,
    parent_run_id: str | None = None,
    trace_context: str | None = None,
    start_at: datetime | None = None,
    deadline_at: datetime | None = None,
    who: audit.Who | None = None,
    request: RequestKey | None = None,
    priority: int | None = None,
    tags: dict[str, str] | None = None,
) -> tuple[str, bool]:
    """Insert a pending run. Returns (run_id, created); an open run of the same workflow id wins.
    ``insert_run_requested`` says the rest."""
    found, created = insert_run_requested(
        engine,
        run_id=run_id,
        workflow_id=workflow_id,
        spec=spec,
        input=input,
        parent_run_id=parent_run_id,
        trace_context=trace_context,
        start_at=start_at,
        deadline_at=deadline_at,
        who=who,
        request=request,
        priority=priority,
        tags=tags,
    )
    return found.run_id, created


def insert_run_requested(
    engine: Engine,
    *,
    run_id: str,
    workflow_id: str,
    spec: WorkflowSpec,
    input: Any,
    parent_run_id: str | None = None,
    trace_context: str | None = None,
    start_at: datetime | None = None,
    deadline_at: datetime | None = None,
    who: audit.Who | None = None,
    request: RequestKey | None = None,
    priority: int | None = None,
    tags: dict[str, str] | None = None,
) -> tuple[Requested, bool]:
    """Insert a pending run. Returns (the run and its workflow id, created); an open run of the
    same workflow id wins. ``who``: the start's audit entry, in the same transaction.

    A delayed run (``start_at``) gets its timer row in the same transaction: the sweeper wakes
    it when it is due, so no wake-up need be sent now.

    ``request``: the run is that request's (store/start_requests.py), its row inserted in the
    same transaction. When the request was made before (a concurrent repeat committed first),
    nothing is inserted and the run it started is returned, not created. When an open run of
    the workflow id is there instead, the request's row naming that run is inserted in the
    transaction that reads it (``_existing``): no crash between the two, and no prune of the
    run in between, can leave the request recorded for a run that is gone or unrecorded once
    its answer was given.
    """
    row = started_run_values(
        run_id=run_id,
        workflow_id=workflow_id,
        spec=spec,
        input=input,
        parent_run_id=parent_run_id,
        created_at=clock.injected_now(engine),
        trace_context=trace_context,
        start_at=start_at,
        deadline_at=deadline_at,
        priority=priority,
        tags=tags,
    )
    # The tags' rows in the run's own transaction: a run is never seen without them.
    tag_rows = run_tags.tags_insert(run_id, tags or {})
    # A large input is stored by reference (docs/large-values.md), in the run's transaction:
    # a start that loses to an open run leaves no blob behind. Its JSON is made once, here.
    large = blobs.large_text(input, blobs.threshold(engine))
    # Most starts write the run row and its audit entry and nothing else: on PostgreSQL one
    # statement does both (the run's insert a data-modifying WITH of the entry's), committed
    # by itself: one round trip instead of four (BEGIN, two inserts, COMMIT) on the path from
    # start() to the run's first tick.
    alone = (
        dialect_of(engine).one_statement
        and start_at is None
        and tag_rows is None
        and request is None
        and large is None
    )
    for _ in range(INSERT_ROUNDS):
        try:
            if alone:
                with autocommit(engine) as conn:
                    if who is None:
                        conn.execute(sa.insert(workflow_run).values(row))
                    else:
                        _insert_started(conn, row, start_values(who, run_id, workflow_id, spec))
                return Requested(run_id=run_id, workflow_id=workflow_id), True
            with engine.begin() as conn:
                if start_at is not None:
                    conn.execute(timer_insert(run_id, start_at))
                values = row
                if large is not None:
                    stored = blobs.write(conn, run_id, input, large).to_json()
                    values = {**row, "input": stored}
                conn.execute(sa.insert(workflow_run).values(values))
                if tag_rows is not None:
                    conn.execute(tag_rows)
                if request is not None:
                    conn.execute(request_insert(request, run_id=run_id, workflow_id=workflow_id))
                if who is not None:
                    conn.execute(start_entry(who, run_id, workflow_id, spec, request))
            return Requested(run_id=run_id, workflow_id=workflow_id), True
        except IntegrityError as exc:
            conflict = exc
            diag = getattr(exc.orig, "diag", None)
            if getattr(diag, "constraint_name", None) == _SPEC_FOREIGN_KEY:
                # The definition this process had stored is gone (deleted by hand): store it
                # again and insert again.
                _forget_saved(engine, spec.spec_hash)
                save_definition(engine, spec, remember=True)
                continue
        found = _existing(engine, run_id, workflow_id, request)
        if found is not None:
            return found
    raise conflict


def _existing(
    engine: Engine, run_id: str, workflow_id: str, request: RequestKey | None
) -> tuple[Requested, bool] | None:
    """After a start's insert failed on a key: our own run (its commit went through, but its
    answer was lost), the run the request started before, or the open run of the workflow id,
    which becomes the request's in this same transaction; None when there is none of them (the
    open run ended meanwhile: the insert is worth another try)."""
    if request is None:
        with engine.connect() as conn:
            if run_exists(conn, run_id):
                return Requested(run_id=run_id, workflow_id=workflow_id), True
            open_id = conn.execute(open_run_of(workflow_id)).scalar_one_or_none()
        if open_id is None:
            return None
        return Requested(run_id=open_id, workflow_id=workflow_id), False
    query = open_run_of(workflow_id)
    # The run row is locked until the request's row commits: a prune (which picks runs
    # FOR UPDATE SKIP LOCKED) passes this run by, so the row never names a deleted run; a
    # tick of the run (FOR UPDATE) waits for this short transaction. On SQLite the
    # transaction's BEGIN IMMEDIATE keeps every other writer out until it commits.
    query = dialect_of(engine).lock_rows(query, read=True, key_share=True)
    with engine.begin() as conn:
        if run_exists(conn, run_id):
            return Requested(run_id=run_id, workflow_id=workflow_id), True
        earlier = find_request(conn, request)
        if earlier is not None:
            return earlier, False
        open_id = conn.execute(query).scalar_one_or_none()
        if open_id is None:
            return None
        return record_on(conn, request, open_id, workflow_id), False


def start_entry(
    who: audit.Who,
    run_id: str,
    workflow_id: str,
    spec: WorkflowSpec,
    request: RequestKey | None = None,
) -> Any:
    """The audit entry of a run's start (``request``: the request that started it)."""
    return sa.insert(audit_table).values(start_values(who, run_id, workflow_id, spec, request))


def start_values(
    who: audit.Who,
    run_id: str,
    workflow_id: str,
    spec: WorkflowSpec,
    request: RequestKey | None = None,
) -> dict[str, Any]:
    """``start_entry``'s row."""
    detail: dict[str, Any] = {"workflow": spec.name, "version": spec.version}
    if request is not None:
        detail["request"] = request.detail()
    return audit.entry_values(
        AuditAction.START,
        actor=who.actor,
        source=who.source,
        run_id=run_id,
        workflow_id=workflow_id,
        detail=detail,
    )


def _insert_started(conn: Connection, run: dict[str, Any], entry: dict[str, Any]) -> None:
    """A run's row and its start's audit entry, in one statement on ``conn`` (autocommit):
    the run's insert a data-modifying WITH of the entry's.

    With psycopg, the statement is SQLAlchemy's own, compiled once per set of columns
    (``_started_statement``), and sent to psycopg's cursor with each value passed through
    the bind processor SQLAlchemy would apply (the JSON columns' serializer): building and
    compiling the INSERT for every start cost about 0.3 ms of the client's CPU, half of a
    ``start()``. Its errors are SQLAlchemy's (a key conflict an ``IntegrityError``), as on
    its own path."""
    if conn.dialect.driver != "psycopg":
        conn.execute(
            sa.insert(audit_table)
            .values(entry)
            .add_cte(sa.insert(workflow_run).values(run).cte("started_run"))
        )
        return
    text, processors = _started_statement(conn.dialect, tuple(run), tuple(entry))
    params: dict[str, Any] = {}
    for prefix, row in (("r_", run), ("a_", entry)):
        for column, value in row.items():
            name = prefix + column
            process = processors[name]
            params[name] = value if process is None else process(value)
    try:
        with driver_cursor(conn) as cursor:
            cursor.execute(text, params)
    except psycopg.Error as exc:
        # SQLAlchemy's class for it (IntegrityError, OperationalError, ...), as its own
        # execution raises: callers and ``with_retry`` see what they saw before.
        # A lost connection was invalidated (``driver_errors``): said so, as SQLAlchemy
        # does, which is what makes a read-only server's error transient (``is_transient``).
        raise sa.exc.DBAPIError.instance(
            text, None, exc, psycopg.Error, connection_invalidated=conn.invalidated
        ) from exc


@functools.cache
def _started_statement(
    dialect: sa.Dialect, run_columns: tuple[str, ...], entry_columns: tuple[str, ...]
) -> tuple[str, dict[str, Any]]:
    """``_insert_started``'s statement for these columns, as ``dialect`` compiles it, and
    each parameter's bind processor (None: the value as it is)."""
    run = sa.insert(workflow_run).values(
        {c: sa.bindparam(f"r_{c}", type_=workflow_run.c[c].type) for c in run_columns}
    )
    entry = (
        sa.insert(audit_table)
        .values({c: sa.bindparam(f"a_{c}", type_=audit_table.c[c].type) for c in entry_columns})
        .add_cte(run.cte("started_run"))
    )
    compiled = entry.compile(dialect=dialect)
    processors = {
        name: bind.type.dialect_impl(dialect).bind_processor(dialect)
        for name, bind in compiled.binds.items()
    }
    return compiled.string, processors


def run_exists(conn: Connection, run_id: str) -> bool:
    return (
        conn.execute(
            sa.select(workflow_run.c.run_id).where(workflow_run.c.run_id == run_id)
        ).first()
        is not None
    )


def open_run_id(engine: Engine, workflow_id: str) -> str | None:
    with engine.connect() as conn:
        return conn.execute(open_run_of(workflow_id)).scalar_one_or_none()


def _reading(engine: Engine) -> Any:
    """A connection for reads that are one statement each: on PostgreSQL in autocommit (no
    ``BEGIN``/``ROLLBACK`` round trips around the statement); on SQLite an ordinary one
    (in-process: nothing to save, and its connections keep the isolation they were made
    with)."""
    return autocommit(engine) if dialect_of(engine).one_statement else engine.connect()


def find_run(engine: Engine, target: str) -> RunRow | None:
    """A run by run id, else the newest run of that workflow id. Each read is one statement
    on its own (``_reading``)."""
    with _reading(engine) as conn:
        row = conn.execute(
            sa.select(*RUN_COLUMNS).where(workflow_run.c.run_id == target)
        ).one_or_none()
        if row is None:
            row = conn.execute(
                sa.select(*RUN_COLUMNS)
                .where(workflow_run.c.workflow_id == target)
                .order_by(workflow_run.c.created_at.desc(), workflow_run.c.run_id.desc())
                .limit(1)
            ).one_or_none()
    return RunRow.from_row(row) if row is not None else None


def find_run_for_wait(engine: Engine, target: str) -> tuple[RunRow, bool] | None:
    """``find_run`` and whether a redrive of that run is queued but not applied yet, in one
    statement, so in one snapshot: a redrive applied meanwhile shows in the row (the commit
    that reopens the run marks its control handled). ``Client.wait``'s look at the run after
    each notification, on the path from a run's finishing commit to ``wait()`` returning:
    one round trip, not three (``_reading``).

    On PostgreSQL the same statement reads, for a finished run, the outputs of the attempts
    its nodes name (``output_token``) and keeps them in the outputs cache, where the run's
    view looks first (``store/outputs.attempt_outputs``): the view ``wait()`` returns then
    needs no read of its own (on a run read from another process, a transaction of three
    round trips)."""
    one_statement = dialect_of(engine).one_statement
    with _reading(engine) as conn:
        row = conn.execute(_WAIT_READS[one_statement, False], {"target": target}).one_or_none()
        if row is None:
            row = conn.execute(_WAIT_READS[one_statement, True], {"target": target}).one_or_none()
    if row is None:
        return None
    if one_statement and row.outputs:
        cache = outputs_cache(engine)
        for token, output in row.outputs.items():
            cache.put(token, output)
    return RunRow.from_row(row), bool(row.redrive_pending)


#: At most this many bytes of outputs (their JSON text) ride with a finished run's
#: read, by token order; the view reads any others itself, as before. One ``jsonb`` value is
#: capped at 255 MB, and a run of many nodes with large inline outputs must not fail its read.
WAIT_READ_OUTPUTS_MAX_BYTES = 1 << 20


def _finished_outputs() -> Any:
    """The outputs of the finished attempts a finished run's nodes name, as one JSON object
    (token -> output), or NULL (an open run, or none), up to ``WAIT_READ_OUTPUTS_MAX_BYTES``:
    PostgreSQL's ``jsonb`` functions read the tokens out of the state
    (``engine/state.output_to_json`` writes ``output_token``)."""
    node = sa.func.jsonb_each(full_state()["nodes"]).table_valued("value").alias("node")
    named = (
        sa.select(node.c.value.op("->>")("output_token")).correlate(workflow_run).scalar_subquery()
    )
    # As text: the size the aggregate holds (``pg_column_size`` would give the compressed one).
    size = sa.func.octet_length(sa.cast(step_attempt.c.output, sa.Text))
    attempt = (
        sa.select(
            step_attempt.c.token,
            step_attempt.c.output,
            sa.func.sum(size).over(order_by=step_attempt.c.token).label("running"),
        )
        # ``= ANY`` of the array, not ``IN`` the subquery: ``IN`` is a semi-join PostgreSQL
        # plans as a scan of the whole attempts table while it holds a few thousand rows
        # (and a prepared statement keeps that plan as the table grows); the array's tokens
        # are looked up by the key at every size (tests/integration/test_wait_reads_outputs.py).
        .where(
            step_attempt.c.token == sa.any_(sa.func.array(named)),
            step_attempt.c.finished_at.is_not(None),
        )
        .correlate(workflow_run)
        .subquery("named_attempt")
    )
    outputs = (
        sa.select(
            sa.func.jsonb_object_agg(
                attempt.c.token, attempt.c.output, type_=step_attempt.c.output.type
            )
        )
        .where(sa.func.coalesce(attempt.c.running, 0) <= WAIT_READ_OUTPUTS_MAX_BYTES)
        .scalar_subquery()
    )
    terminal = workflow_run.c.status.in_([s.value for s in TERMINAL_RUN_STATUSES])
    return sa.case((terminal, outputs), else_=None).label("outputs")


def _wait_read(one_statement: bool, by_workflow_id: bool) -> Any:
    """``find_run_for_wait``'s statement, built once: by run id, or the newest run of a
    workflow id; with the finished run's outputs on PostgreSQL."""
    pending = exists_redrive(workflow_run.c.run_id).label("redrive_pending")
    columns = [*RUN_COLUMNS, pending, *([_finished_outputs()] if one_statement else [])]
    target = sa.bindparam("target", type_=sa.String)
    if not by_workflow_id:
        return sa.select(*columns).where(workflow_run.c.run_id == target)
    return (
        sa.select(*columns)
        .where(workflow_run.c.workflow_id == target)
        .order_by(workflow_run.c.created_at.desc(), workflow_run.c.run_id.desc())
        .limit(1)
    )


def exists_redrive(run_id: Any) -> Any:
    """Whether a redrive control of ``run_id`` (a column or a value) waits to be applied."""
    return sa.exists(
        sa.select(sa.literal_column("1"))
        .select_from(workflow_control)
        .where(
            workflow_control.c.run_id == run_id,
            workflow_control.c.handled_at.is_(None),
            workflow_control.c.kind == ControlKind.REDRIVE.value,
        )
    )


_WAIT_READS = {
    (one_statement, by_workflow_id): _wait_read(one_statement, by_workflow_id)
    for one_statement in (False, True)
    for by_workflow_id in (False, True)
}


@dataclass(frozen=True, slots=True)
class RunFilter:
    """What ``list_runs`` and ``count_by_status`` select: every field ``None`` means "any".
    ``since`` is inclusive, ``until`` exclusive, both on ``created_at``."""

    status: str | None = None
    workflow: str | None = None
    workflow_id: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    #: Runs with every one of these (key, value) tags (docs/tags.md).
    tags: tuple[tuple[str, str], ...] = ()


#: The position of a run in the newest-first order: (created_at, run_id).
RunKey = tuple[datetime, str]


def _created(conn: Connection) -> Any:
    """``created_at`` as the list orders and compares it.

    SQLite keeps timestamps as text whose format depends on who wrote them (its own
    ``CURRENT_TIMESTAMP`` has no fraction, SQLAlchemy writes microseconds): compared as text,
    equal times would differ. There both sides go through one ``strftime`` format instead.
    """
    return dialect_of(conn).sortable_time(workflow_run.c.created_at)


def _at(conn: Connection, value: datetime) -> Any:
    """A datetime bound for comparison with ``_created`` (UTC on SQLite, as stored)."""
    return dialect_of(conn).bound_time(value)


def _filtered(conn: Connection, query: Any, where: RunFilter) -> Any:
    if where.status is not None:
        query = query.where(workflow_run.c.status == where.status)
    if where.workflow is not None:
        query = query.where(workflow_run.c.workflow == where.workflow)
    if where.workflow_id is not None:
        query = query.where(workflow_run.c.workflow_id == where.workflow_id)
    if where.since is not None:
        query = query.where(_created(conn) >= _at(conn, where.since))
    if where.until is not None:
        query = query.where(_created(conn) < _at(conn, where.until))
    if where.tags:
        query = run_tags.matching(query, dict(where.tags))
    return query


def list_runs(
    engine: Engine,
    *,
    status: str | None = None,
    workflow: str | None = None,
    limit: int = 50,
    where: RunFilter | None = None,
    after: RunKey | None = None,
) -> tuple[list[RunRow], RunKey | None]:
    """Runs newest first (``created_at``, then ``run_id``, both descending), at most ``limit``,
    strictly after the key ``after``; and the key to continue from, or ``None`` when no run
    is left. Keyset pagination: a page costs the same however deep it is, and runs started
    meanwhile never shift the pages after the first."""
    where = where or RunFilter(status=status, workflow=workflow)
    with engine.connect() as conn:
        query = _filtered(conn, sa.select(*RUN_COLUMNS), where)
        created = _created(conn)
        if after is not None:
            query = query.where(
                sa.tuple_(created, workflow_run.c.run_id)
                < sa.tuple_(_at(conn, after[0]), sa.literal(after[1]))
            )
        query = query.order_by(created.desc(), workflow_run.c.run_id.desc())
        rows = conn.execute(query.limit(limit + 1)).all()
    found = [RunRow.from_row(r) for r in rows[:limit]]
    more = len(rows) > limit and found
    return found, (found[-1].created_at, found[-1].run_id) if more else None


def encode_cursor(key: RunKey) -> str:
    """The opaque cursor of a page's position: URL-safe, no padding."""
    text = json.dumps([key[0].isoformat(), key[1]], separators=(",", ":"))
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> RunKey:
    """The position a cursor from ``encode_cursor`` names; ValueError for anything else."""
    problem = f"cursor {cursor[:40]!r} is not a cursor that list_runs returned"
    if len(cursor) > 1000:
        raise ValueError(f"{problem} (it is {len(cursor)} characters long)")
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        at, run_id = json.loads(text)
        created = datetime.fromisoformat(at)
    except (ValueError, TypeError, UnicodeDecodeError, binascii.Error):
        raise ValueError(problem) from None
    if not isinstance(run_id, str) or limits.id_problem(run_id):
        raise ValueError(problem)
    # Naive, or past either end of the calendar in UTC (0001-01-01T00:00+14:00): no cursor
    # list_runs returns, and no comparison could use it.
    why = limits.time_problem(created)
    if why is not None:
        raise ValueError(f"{problem} (its time {why})")
    utc = limits.in_utc(created)
    assert utc is not None
    return utc, run_id


def count_by_status(engine: Engine, where: RunFilter) -> dict[str, int]:
    """How many runs match ``where`` in each status (``where.status`` is ignored)."""
    with engine.connect() as conn:
        query = _filtered(
            conn,
            sa.select(workflow_run.c.status, sa.func.count()).group_by(workflow_run.c.status),
            RunFilter(
                workflow=where.workflow,
                workflow_id=where.workflow_id,
                since=where.since,
                until=where.until,
                tags=where.tags,
            ),
        )
        return {status: int(n) for status, n in conn.execute(query).all()}


def attempt_outputs(engine: Engine, tokens: list[str]) -> dict[str, Any]:
    if not tokens:
        return {}
    with engine.connect() as conn:
        return dict(
            conn.execute(
                sa.select(step_attempt.c.token, step_attempt.c.output).where(
                    step_attempt.c.token.in_(tokens)
                )
            ).all()
        )


def attempts_of(engine: Engine, run_id: str) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.select(step_attempt)
                .where(step_attempt.c.run_id == run_id)
                .order_by(step_attempt.c.created_at, step_attempt.c.token)
            ).all()
        )


def transitions_of(engine: Engine, run_id: str, limit: int = 200) -> list[Any]:
    """The run's most recent transitions, oldest first."""
    h = history.view.c
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(history.view).where(h.run_id == run_id).order_by(h.seq.desc()).limit(limit)
        ).all()
    return list(reversed(rows))


def run_ids_of(engine: Engine, target: str) -> list[str]:
    """The run ``target`` names (a run id), or every run of a workflow id."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.select(workflow_run.c.run_id).where(
                    sa.or_(workflow_run.c.run_id == target, workflow_run.c.workflow_id == target)
                )
            ).scalars()
        )
