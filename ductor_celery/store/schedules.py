"""Schedule rows: define, pause, list, trigger, and fire them (the sweeper's part).

Exactly one run per fire time, however many sweepers run: a schedule row is handled in one
transaction that locks it (``FOR UPDATE SKIP LOCKED`` on PostgreSQL; SQLite's ``BEGIN
IMMEDIATE`` serializes writers), inserts the runs of its due fire times and advances
``next_fire_at`` past them before it commits. A second sweeper either skips the locked row or
reads it already advanced. The run of a fire time has the workflow id
``<name>@<fire time ISO 8601 UTC>`` (``engine.fire_times.fire_id``); a run with that id that
already exists is never started again.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from ..definition.spec import WorkflowSpec
from ..engine.deadline import deadline_after
from ..engine.fire_times import Cadence, DueFires, due_fires, fire_id
from ..engine.kinds import AuditAction, AuditSource
from ..engine.state import RunState
from ..engine.status import OPEN_RUN_STATUSES
from .audit import Who, record
from .db import aware, db_now
from .dialect import dialect_of
from .runs import pending_run, start_entry
from .schema import workflow_definition, workflow_run, workflow_schedule

log = logging.getLogger("ductor_celery.schedules")

#: What a fire time does while the schedule's previous run is still open.
OVERLAP_POLICIES = ("skip", "buffer_one", "allow")


@dataclass(frozen=True, slots=True)
class ScheduleRow:
    name: str
    workflow: str
    cron: str | None
    every: float | None
    timezone: str
    input: Any
    overlap: str
    catchup_window: float
    paused: bool
    next_fire_at: datetime
    buffered_fire_at: datetime | None
    last_workflow_id: str | None

    @property
    def cadence(self) -> Cadence:
        return Cadence(cron=self.cron, every=self.every, timezone=self.timezone)

    @classmethod
    def from_row(cls, row: Any) -> ScheduleRow:
        next_fire_at = aware(row.next_fire_at)
        assert next_fire_at is not None
        return cls(
            name=row.name,
            workflow=row.workflow,
            cron=row.cron,
            every=row.every,
            timezone=row.timezone,
            input=row.input,
            overlap=row.overlap,
            catchup_window=row.catchup_window,
            paused=bool(row.paused),
            next_fire_at=next_fire_at,
            buffered_fire_at=aware(row.buffered_fire_at),
            last_workflow_id=row.last_workflow_id,
        )


def save_schedule(engine: Engine, row: ScheduleRow, who: Who | None = None) -> None:
    """Insert the schedule, or replace the one of that name (its previous run stays its
    previous run, for the overlap policy); ``who``: its audit entry, in the same transaction."""
    values = {
        "name": row.name,
        "workflow": row.workflow,
        "cron": row.cron,
        "every": row.every,
        "timezone": row.timezone,
        "input": row.input,
        "overlap": row.overlap,
        "catchup_window": row.catchup_window,
        "paused": row.paused,
        "next_fire_at": row.next_fire_at,
        "buffered_fire_at": None,
    }
    insert = dialect_of(engine).insert
    stmt = insert(workflow_schedule).values(**values)
    replace = {k: v for k, v in values.items() if k != "name"}
    with engine.begin() as conn:
        conn.execute(
            stmt.on_conflict_do_update(
                index_elements=[workflow_schedule.c.name],
                set_={**replace, "updated_at": sa.func.now()},
            )
        )
        if who is not None:
            cadence = {"cron": row.cron} if row.cron is not None else {"every": row.every}
            record(
                conn,
                AuditAction.SCHEDULE,
                actor=who.actor,
                source=who.source,
                detail={"schedule": row.name, "workflow": row.workflow, **cadence},
            )


def delete_schedule(engine: Engine, name: str, who: Who | None = None) -> bool:
    with engine.begin() as conn:
        deleted = conn.execute(
            sa.delete(workflow_schedule).where(workflow_schedule.c.name == name)
        ).rowcount
        if deleted and who is not None:
            record(
                conn,
                AuditAction.UNSCHEDULE,
                actor=who.actor,
                source=who.source,
                detail={"schedule": name},
            )
    return bool(deleted)


def set_paused(engine: Engine, name: str, paused: bool, next_fire_at: datetime | None) -> bool:
    """Pause, or resume from ``next_fire_at`` (fire times passed while paused are not fired)."""
    values: dict[str, Any] = {"paused": paused, "updated_at": sa.func.now()}
    if next_fire_at is not None:
        values["next_fire_at"] = next_fire_at
    with engine.begin() as conn:
        changed = conn.execute(
            sa.update(workflow_schedule).where(workflow_schedule.c.name == name).values(**values)
        ).rowcount
    return bool(changed)


def get_schedule(engine: Engine, name: str) -> ScheduleRow | None:
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(workflow_schedule).where(workflow_schedule.c.name == name)
        ).one_or_none()
    return ScheduleRow.from_row(row) if row is not None else None


def list_schedules(engine: Engine) -> list[ScheduleRow]:
    with engine.connect() as conn:
        rows = conn.execute(sa.select(workflow_schedule).order_by(workflow_schedule.c.name))
        return [ScheduleRow.from_row(r) for r in rows]


@dataclass(slots=True)
class FireResult:
    #: Runs inserted (pending): the caller wakes them after the commits.
    started: list[str] = field(default_factory=list)
    #: Fire times not started because the previous run was open (overlap ``skip``, or a
    #: ``buffer_one`` schedule whose one buffered start was taken).
    skipped: int = 0
    #: Fire times missed by more than the catch-up window.
    missed: int = 0
    #: Fire times held back (``buffer_one``) until the previous run ends.
    buffered: int = 0


#: The catch-up window is at least this: the sweeper fires a little after each fire time.
MIN_CATCHUP_WINDOW_S = 10.0


def fire_due(
    engine: Engine,
    *,
    limit: int = 100,
    min_window: float = MIN_CATCHUP_WINDOW_S,
    now: datetime | None = None,
) -> FireResult:
    """Start the runs of every due fire time of every unpaused schedule, one short
    transaction per schedule. ``min_window``: the least catch-up window, whatever a schedule
    says (a sweep comes some time after a fire time; that fire time is not "missed").
    ``now``: the database's clock unless given (a test harness with a controlled clock)."""
    now = db_now(engine) if now is None else now
    result = FireResult()
    with engine.connect() as conn:
        names = list(
            conn.execute(
                _due(now).with_only_columns(workflow_schedule.c.name).limit(limit)
            ).scalars()
        )
    for name in names:
        with engine.begin() as conn:
            query = _due(now).where(workflow_schedule.c.name == name)
            query = dialect_of(engine).lock_rows(query, skip_locked=True)
            row = conn.execute(query).one_or_none()
            if row is None:
                continue  # another sweeper holds it, or has just handled it
            _fire(conn, ScheduleRow.from_row(row), now, result, min_window)
    return result


def next_fire_by(engine: Engine, until: datetime) -> datetime | None:
    """The earliest fire time of an unpaused schedule at or before ``until``: the next stop
    of a controlled clock (``ductor_celery.testing``) besides timer rows."""
    with engine.connect() as conn:
        value = conn.execute(
            sa.select(sa.func.min(workflow_schedule.c.next_fire_at)).where(
                sa.not_(workflow_schedule.c.paused), workflow_schedule.c.next_fire_at <= until
            )
        ).scalar_one_or_none()
    return None if value is None else aware(value)


def _due(now: datetime) -> sa.Select[Any]:
    return (
        sa.select(workflow_schedule)
        .where(
            sa.not_(workflow_schedule.c.paused),
            sa.or_(
                workflow_schedule.c.next_fire_at <= now,
                workflow_schedule.c.buffered_fire_at.is_not(None),
            ),
        )
        .order_by(workflow_schedule.c.next_fire_at)
    )


def _fire(
    conn: Connection, s: ScheduleRow, now: datetime, result: FireResult, min_window: float
) -> None:
    """Handle one locked schedule row: its buffered start, then its due fire times by the
    overlap policy; advance the row in the same transaction."""
    window = max(s.catchup_window, min_window)
    if s.next_fire_at <= now:
        due = due_fires(s.cadence, s.next_fire_at, now, window)
    else:
        due = DueFires(fires=(), missed=0, next_fire_at=s.next_fire_at)
    if due.missed:
        log.warning(
            "schedule %r: %d fire times missed by more than the catch-up window (%gs)",
            s.name,
            due.missed,
            window,
        )
    result.missed += due.missed
    starter = _Starter(conn, s, now)
    buffered = s.buffered_fire_at
    if buffered is not None and not starter.previous_open():
        starter.start(buffered)
        buffered = None
    for fire in due.fires:
        if s.overlap == "allow" or not starter.previous_open():
            starter.start(fire)
        elif s.overlap == "buffer_one" and buffered is None:
            buffered = fire
            result.buffered += 1
        else:
            result.skipped += 1
    result.started.extend(starter.started)
    conn.execute(
        sa.update(workflow_schedule)
        .where(workflow_schedule.c.name == s.name)
        .values(
            next_fire_at=due.next_fire_at,
            buffered_fire_at=buffered,
            last_workflow_id=starter.last,
            updated_at=now,
        )
    )


class _Starter:
    """Inserts a schedule's runs on the schedule's transaction, tracking its newest run."""

    def __init__(self, conn: Connection, s: ScheduleRow, now: datetime) -> None:
        self.conn = conn
        self.s = s
        #: When the runs are started: a run's deadline (its workflow's) counts from then.
        self.now = now
        self.last = s.last_workflow_id
        self.started: list[str] = []
        self._spec: WorkflowSpec | None = None

    def previous_open(self) -> bool:
        return self.last is not None and open_run_of(self.conn, self.last) is not None

    def start(self, fire_at: datetime) -> str | None:
        workflow_id = fire_id(self.s.name, fire_at)
        if run_of(self.conn, workflow_id) is not None:
            self.last = workflow_id
            return None  # this fire time has its run already (never two)
        if self._spec is None:
            self._spec = latest_spec(self.conn, self.s.workflow)
        if self._spec is None:
            log.error(
                "schedule %r: workflow %r has no stored definition; fire time %s not started",
                self.s.name,
                self.s.workflow,
                fire_at.isoformat(),
            )
            return None
        run_id = uuid.uuid4().hex
        try:
            with self.conn.begin_nested():
                insert_run_on(self.conn, run_id, workflow_id, self._spec, self.s.input, self.now)
                # Who started it: the schedule (its name), as the sweeper fires it.
                self.conn.execute(
                    start_entry(
                        Who(self.s.name, AuditSource.SCHEDULE), run_id, workflow_id, self._spec
                    )
                )
        except IntegrityError:
            # An open run took the id meanwhile (someone started "<name>@<time>" by hand):
            # that is the fire time's run. Without the savepoint the schedule's transaction
            # would fail on every sweep from now on.
            self.last = workflow_id
            return None
        self.last = workflow_id
        self.started.append(run_id)
        return run_id


def trigger(engine: Engine, name: str) -> tuple[str, str] | None:
    """Start a run of the schedule now, whatever its overlap policy or pause (the operator
    asked for it); its fire time is now. Returns (run_id, workflow_id), None if unknown."""
    with engine.begin() as conn:
        query = sa.select(workflow_schedule).where(workflow_schedule.c.name == name)
        query = dialect_of(engine).lock_rows(query)
        row = conn.execute(query).one_or_none()
        if row is None:
            return None
        s = ScheduleRow.from_row(row)
        now = db_now_on(conn)
        starter = _Starter(conn, s, now)
        run_id = starter.start(now)
        if run_id is None:
            raise LookupError(f"workflow {s.workflow!r} has no stored definition")
        conn.execute(
            sa.update(workflow_schedule)
            .where(workflow_schedule.c.name == name)
            .values(last_workflow_id=starter.last, updated_at=sa.func.now())
        )
    assert starter.last is not None
    return run_id, starter.last


def db_now_on(conn: Connection) -> datetime:
    # The statement's clock: the transaction's would be the same for two triggers inside one.
    return dialect_of(conn).statement_now(conn)


def open_run_of(conn: Connection, workflow_id: str) -> str | None:
    return conn.execute(
        sa.select(workflow_run.c.run_id).where(
            workflow_run.c.workflow_id == workflow_id,
            workflow_run.c.status.in_([s.value for s in OPEN_RUN_STATUSES]),
        )
    ).scalar_one_or_none()


def run_of(conn: Connection, workflow_id: str) -> str | None:
    return conn.execute(
        sa.select(workflow_run.c.run_id).where(workflow_run.c.workflow_id == workflow_id).limit(1)
    ).scalar_one_or_none()


def latest_spec(conn: Connection, workflow: str) -> WorkflowSpec | None:
    """The newest stored definition of a workflow name: what a fired run starts."""
    spec = conn.execute(
        sa.select(workflow_definition.c.spec)
        .where(workflow_definition.c.name == workflow)
        .order_by(workflow_definition.c.version.desc(), workflow_definition.c.created_at.desc())
        .limit(1)
    ).scalar_one_or_none()
    return WorkflowSpec.model_validate(spec) if spec is not None else None


def insert_run_on(
    conn: Connection,
    run_id: str,
    workflow_id: str,
    spec: WorkflowSpec,
    input: Any,
    now: datetime,
) -> None:
    # The workflow's default deadline counts from when the sweeper starts the run (a fire
    # time caught up late still gets its whole deadline).
    deadline_at = deadline_after(now, spec.deadline)
    conn.execute(
        sa.insert(workflow_run).values(
            pending_run(
                run_id=run_id,
                workflow_id=workflow_id,
                workflow=spec.name,
                version=spec.version,
                spec_hash=spec.spec_hash,
                state=RunState.initial(spec.graph.order, deadline_at=deadline_at),
                input=input,
                priority=spec.priority,
            )
        )
    )
