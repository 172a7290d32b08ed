"""``ductor_celery.testing``: run workflows in-process, on a throwaway database, in controlled time.

::

    from ductor_celery import testing

    def test_order_ships_after_a_day():
        with testing.harness(ductor) as h:
            h.stub("shop.charge", returns={"charge_id": "ch_test"})
            handle = h.start("order", input={"id": 42})
            h.advance(days=1)                      # the day's sleep fires, without waiting
            assert h.run(handle).status == "succeeded"

It is the production code with three things swapped, and nothing else (docs/testing.md):

- the database: a SQLite file in a temporary directory, migrated to head, deleted on exit;
- the broker: a dispatcher that records every message (``h.messages``) and hands them to the
  harness, which delivers them in this thread, in order: a wake-up runs the production tick
  (``runtime.tick_task.run_tick``), a run's first tick ``runtime.steps.first_tick``, a step
  message the production attempt execution
  (``runtime.steps.execute_attempt``: claim, call, record, eager tick);
- the clock: the store's clock for that database only (``store/clock.py``). It stands still
  while messages are delivered and moves only in ``advance()``, which fires the timer rows the
  ticks wrote (sleeps, wait and approval timeouts, retry backoffs, step check times, and any
  other timer row) in time order, including timers created while it advances.

A stub (``h.stub``) replaces one step's function for the attempts the harness delivers; the
step's retry policy, timeouts and the rest of its definition stay as registered.

``harness(ductor, from_export="run.json")`` starts with an exported run's rows in that database
and the clock at the export's time (docs/replay.md); ``replay("run.json", node=...)`` calls one
node's current step function with an exported attempt's arguments, in this process.

On exit the Ductor is as it was (settings, dispatcher, database), whatever happened inside.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from .engine.kinds import DispatchKind
from .engine.status import TERMINAL_RUN_STATUSES, NodeStatus, RunStatus
from .errors import DefinitionError, DuctorError, ExportError
from .limits import EARLIEST_NOW, LATEST_NOW, time_problem
from .runtime.dispatch import FIRST_TICK_TASK_NAME
from .runtime.outbox_janitor import close_janitor, sent_outbox
from .runtime.replay import replay_attempt
from .runtime.step_context import Step, StepContext
from .runtime.steps import execute_attempt, first_tick, worker_identity
from .runtime.tick_task import run_tick
from .store import attempts, clock, migrate, schedules, sweep
from .store.db import forget_engine, get_engine
from .store.dialect import dialect_of
from .store.export_format import ExportedRun, read_export
from .store.exports import restore_rows
from .store.outbox import OutboxRow
from .views import RunHandle, RunView

if TYPE_CHECKING:
    from .ductor import Ductor

log = logging.getLogger("ductor_celery.testing")

__all__ = [
    "ExportError",
    "Harness",
    "HarnessError",
    "Message",
    "Stub",
    "UnknownStep",
    "harness",
    "replay",
]

#: More messages than this delivered at one instant of the clock: a loop that never parks.
MAX_MESSAGES_PER_INSTANT = 100_000
#: ``run()`` gives up after moving the clock to this many timers without the run parking.
MAX_STOPS_PER_RUN = 10_000

_NOTHING: Any = object()


class HarnessError(DuctorError):
    """The harness cannot do what was asked (nested harnesses, a loop that never parks...)."""


class UnknownStep(DefinitionError, KeyError, ValueError):
    """``h.stub()`` of a step name that is not registered."""

    def __str__(self) -> str:  # KeyError's own would print the message's repr
        return Exception.__str__(self)


@dataclass(frozen=True, slots=True)
class Message:
    """A message the harness's dispatcher recorded: what production would have published."""

    #: "step", "wakeup", "first_tick" (a run just started, eager ticks) or "revoke" (another
    #: kind is recorded, and not delivered).
    kind: str
    run_id: str
    #: The step's task name (step messages), ``ductor.tick`` (wake-ups),
    #: ``ductor.first_tick`` (first ticks).
    task: str
    #: The attempt's token (step and revoke messages).
    token: str | None = None


@dataclass
class Stub:
    """A step's stand-in: what it returns or raises, and the calls it received."""

    name: str
    returns: Any = None
    raises: BaseException | type[BaseException] | None = None
    #: Its attempts are claimed and never finish, as with a worker killed mid-step: the
    #: step's timeout (or heartbeat timeout) closes them when the clock passes it.
    hangs: bool = False
    #: The keyword arguments of each call, in order (the StepContext is in ``contexts``).
    calls: list[dict[str, Any]] = field(default_factory=list)
    contexts: list[StepContext] = field(default_factory=list)

    def __call__(self, ctx: StepContext, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        self.contexts.append(ctx)
        if self.raises is not None:
            raise self.raises
        return self.returns


class _RecordingDispatcher:
    """Stands in for ``runtime.dispatch.Dispatcher``: records and queues, sends nothing."""

    def __init__(self, queue: deque[Message], log: list[Message]) -> None:
        self._queue = queue
        self._log = log

    def _put(self, message: Message) -> None:
        self._log.append(message)
        if message.kind == DispatchKind.REVOKE:
            # As a broker drops a revoked message still queued.
            kept = [m for m in self._queue if not (m.kind == "step" and m.token == message.token)]
            self._queue.clear()
            self._queue.extend(kept)
            return
        self._queue.append(message)

    def send(self, rows: list[OutboxRow]) -> None:
        for row in rows:
            if row.kind == DispatchKind.STEP:
                self._put(Message("step", row.run_id, row.task, row.payload["token"]))
            elif row.kind == DispatchKind.REVOKE:
                self._put(Message("revoke", row.run_id, row.task, row.payload["token"]))
            elif row.kind == DispatchKind.WAKEUP:
                self.wake(row.run_id)
            else:  # as production's Dispatcher does: leave a trace, deliver nothing
                log.error("unknown outbox kind %r for run %s", row.kind, row.run_id)
                self._log.append(Message(str(row.kind), row.run_id, row.task))

    def wake(self, run_id: str, quick: Any = None) -> None:
        """``quick``: production's hint for the tick's messages (ignored: the harness runs
        each step from its own message)."""
        self._put(Message("wakeup", run_id, "ductor.tick"))

    def wake_many(self, run_ids: list[str]) -> None:
        for run_id in run_ids:
            self.wake(run_id)

    def first_tick(self, run_id: str) -> None:
        self._put(Message("first_tick", run_id, FIRST_TICK_TASK_NAME))


class Harness:
    """Runs one Ductor's workflows in this thread, on its own database and clock."""

    def __init__(self, ductor: Ductor, url: str, start_at: datetime) -> None:
        self._ductor = ductor
        self._url = url
        self._now = start_at
        self._queue: deque[Message] = deque()
        #: Every message recorded, delivered or not, oldest first.
        self.messages: list[Message] = []
        self._stubs: dict[str, Stub] = {}
        self.dispatcher = _RecordingDispatcher(self._queue, self.messages)
        #: The exported run loaded with ``from_export=`` (None without one).
        self.run_id: str | None = None

    def _load_export(self, exported: ExportedRun) -> None:
        """Insert the export's rows, then put what was in flight back in motion as a broker
        would: a step message for each open attempt no worker had claimed (one claimed and
        never finished is a worker lost mid-step: its timeout closes it), and a wake-up of the
        run (it folds a finished attempt or handles a control the export caught unapplied).
        Delivered by the next call that delivers."""
        rows = exported.rows
        restore_rows(self._engine(), rows, exported.source)
        self.run_id = exported.run_id
        for a in rows.attempts:
            if a["finished_at"] is None and a["claimed_at"] is None:
                self.dispatcher._put(Message("step", self.run_id, a["step"], a["token"]))
        self.dispatcher.wake(self.run_id)

    # -- time ---------------------------------------------------------------------------------

    @property
    def now(self) -> datetime:
        """The harness's clock (UTC): what every tick and attempt of its runs reads."""
        return self._now

    def _clock(self) -> datetime:
        return self._now

    def advance(
        self,
        seconds: float | timedelta = 0.0,
        *,
        minutes: float = 0.0,
        hours: float = 0.0,
        days: float = 0.0,
    ) -> datetime:
        """Move the clock forward (by ``seconds``, a timedelta, or the keywords' sum), firing
        every timer that comes due on the way, in time order, each at its own time, and
        delivering what it sets in motion, timers it creates on the way too (a chain of
        retries completes in one call). Returns the new time."""
        amounts = {"seconds": seconds, "minutes": minutes, "hours": hours, "days": days}
        try:
            if isinstance(seconds, timedelta):
                delta = seconds + timedelta(minutes=minutes, hours=hours, days=days)
            else:
                delta = timedelta(seconds=seconds, minutes=minutes, hours=hours, days=days)
            target = self._now + delta
        except (OverflowError, ValueError):  # nan, or past the calendar (days=1e12)
            given = ", ".join(f"{k}={v!r}" for k, v in amounts.items() if v)
            raise ValueError(
                f"advance({given}) is not a time the clock can move to (finite amounts, "
                f"ending before {LATEST_NOW.date()})"
            ) from None
        if delta < timedelta(0):
            raise ValueError(f"advance() moves the clock forward only, got {delta}")
        if target > LATEST_NOW:
            raise ValueError(
                f"advance() would move the clock to {target.isoformat()}, past "
                f"{LATEST_NOW.isoformat()} (the latest clock ductor runs at)"
            )
        return self._advance_to(target)

    def _advance_to(self, target: datetime) -> datetime:
        self._deliver()
        engine = self._engine()
        fired: set[tuple[str, datetime]] = set()
        while True:
            due = [t for t in sweep.timers_due_by(engine, target) if t not in fired]
            schedule_at = schedules.next_fire_by(engine, target)
            stops = [due[0][1]] if due else []
            if schedule_at is not None:
                stops.append(schedule_at)
            if not stops:
                break
            instant = max(self._now, min(stops))
            self._now = instant
            if schedule_at is not None and schedule_at <= instant:
                # As the sweeper does: start the fire time's runs, then wake them.
                for run_id in schedules.fire_due(engine, now=instant).started:
                    self.dispatcher.wake(run_id)
            for run_id, fire_at in due:
                if fire_at <= instant:
                    # A timer the tick leaves where it is (due, nothing to do) fires once.
                    fired.add((run_id, fire_at))
                    self.dispatcher.wake(run_id)
            self._deliver()
        self._now = target
        return target

    # -- stubs --------------------------------------------------------------------------------

    def stub(
        self,
        step: str | Step,
        *,
        returns: Any = _NOTHING,
        raises: BaseException | type[BaseException] | None = None,
        hangs: bool = False,
    ) -> Stub:
        """Replace a step's function inside this harness: it returns ``returns`` (default
        ``None``) or raises ``raises`` (an exception or exception class); ``hangs=True``: its
        attempts are claimed and never finish (a worker lost mid-step), so the step's timeout
        fires when the clock passes it. Its retry policy and the rest of its definition stay
        as registered. Returns the Stub, which records calls."""
        name = step.name if isinstance(step, Step) else step
        if not isinstance(name, str):
            raise TypeError(f"stub() takes a step name or step, got {type(step).__name__}")
        if self._ductor.runtime.step_named(name) is None:
            known = ", ".join(sorted(self._ductor._steps)) or "none"
            raise UnknownStep(f"no step named {name!r} is registered (registered: {known})")
        if sum((returns is not _NOTHING, raises is not None, bool(hangs))) > 1:
            raise ValueError("stub() takes one of returns=, raises= or hangs=True")
        if raises is not None and not (
            isinstance(raises, BaseException)
            or (isinstance(raises, type) and issubclass(raises, BaseException))
        ):
            raise TypeError(
                f"raises= must be an exception or exception class, got {type(raises).__name__}"
            )
        found = Stub(
            name, returns=None if returns is _NOTHING else returns, raises=raises, hangs=hangs
        )
        self._stubs[name] = found
        return found

    def unstub(self, step: str | Step) -> None:
        """The step's own function again."""
        self._stubs.pop(step.name if isinstance(step, Step) else step, None)

    # -- runs ---------------------------------------------------------------------------------

    def start(
        self, workflow: str, input: Any = None, workflow_id: str | None = None, **options: Any
    ) -> RunHandle:
        """``ductor.start(...)``, then deliver what it set in motion: returns once every run is
        parked (waiting for time, a signal, an approval) or finished."""
        handle = self._ductor.start(workflow, input=input, workflow_id=workflow_id, **options)
        self._deliver()
        return handle

    def run(self, target: RunHandle | str) -> RunView:
        """Run it until it is parked or finished, and return its view (a handle, run id or
        workflow id).

        Parked: finished, or open with no node of any run in progress (every unfinished node
        waits for a signal, an approval, a sleep or a timeout, or for its dependencies; or the
        run is paused or not started yet). While some node is in progress (a retry waiting
        for its backoff, an attempt that hangs until its timeout), the clock moves on to the
        next timer, as ``advance()`` would, so a step's retries complete here."""
        run_id = _target(target)
        self._deliver()
        for _ in range(MAX_STOPS_PER_RUN):
            view = self._ductor.get(run_id)
            if view.status in TERMINAL_RUN_STATUSES or not self._in_progress():
                return view
            stop = sweep.next_timer_after(self._engine(), self._now)
            if stop is None:
                return view
            self._advance_to(stop)
        raise HarnessError(
            f"run {run_id} did not park within {MAX_STOPS_PER_RUN} timers: a workflow that "
            "retries or loops without end?"
        )

    def _in_progress(self) -> bool:
        """Whether some open run has a node in progress (an attempt or a retry's backoff)."""
        running = self._ductor.list_runs(status=RunStatus.RUNNING.value, limit=1000)
        # A compensation counts too (docs/compensation.md): its retries wait for their backoff.
        return any(
            node.status == NodeStatus.RUNNING for view in running for node in view.nodes.values()
        ) or any(c.status == NodeStatus.RUNNING for view in running for c in view.compensations)

    def get(self, target: RunHandle | str) -> RunView:
        """The run's view as it is, delivering nothing."""
        return self._ductor.get(_target(target))

    def signal(
        self,
        target: RunHandle | str,
        name: str,
        payload: Any = None,
        idempotency_key: str | None = None,
    ) -> int:
        """``ductor.signal(...)``, then deliver what it set in motion. Returns the signal id."""
        signal_id = self._ductor.signal(
            _target(target), name, payload, idempotency_key=idempotency_key
        )
        self._deliver()
        return signal_id

    def approve(
        self, target: RunHandle | str, node: str, by: str | None = None, comment: str | None = None
    ) -> None:
        self._ductor.approve(_target(target), node, by=by, comment=comment)
        self._deliver()

    def reject(
        self, target: RunHandle | str, node: str, by: str | None = None, comment: str | None = None
    ) -> None:
        self._ductor.reject(_target(target), node, by=by, comment=comment)
        self._deliver()

    # -- delivery -----------------------------------------------------------------------------

    def _engine(self) -> Any:
        return self._ductor.runtime.engine()

    def _deliver(self) -> None:
        """Deliver queued messages in order until none is left (the clock stands still)."""
        rt = self._ductor.runtime
        delivered = 0
        while self._queue:
            message = self._queue.popleft()
            delivered += 1
            if delivered > MAX_MESSAGES_PER_INSTANT:
                self._queue.clear()
                raise HarnessError(
                    f"more than {MAX_MESSAGES_PER_INSTANT} messages at {self._now.isoformat()} "
                    "without every run parking: a workflow that loops without waiting?"
                )
            if message.kind == "wakeup":
                run_tick(rt, message.run_id)
            elif message.kind == "first_tick":
                # As a step worker takes it: the run's first tick, the first step then sent as
                # a message of its own (the harness runs each step from its message).
                first_tick(rt, message.run_id, "harness", None)
            elif message.kind == "step":
                assert message.token is not None
                stub = self._stubs.get(message.task)
                if stub is not None and stub.hangs:
                    # The production claim, and then nothing: a worker that died holding it.
                    attempts.claim(
                        self._engine(), message.token, worker_identity("harness"), step=stub.name
                    )
                    continue
                execute_attempt(rt, self._step(message.task), message.token, hostname="harness")
        # What production's janitor thread does a moment later, done now: no sent row left.
        sent_outbox(self._engine()).flush()

    def _step(self, task: str) -> Step:
        step = self._ductor.runtime.step_named(task)
        if step is None:
            raise HarnessError(f"a step message for {task!r}, which is not registered here")
        stub = self._stubs.get(task)
        return step if stub is None else dataclasses.replace(step, fn=stub)


def replay(
    file: str | os.PathLike[str] | dict[str, Any],
    node: str,
    *,
    attempt: int | None = None,
    branch: int | None = None,
    ductor: Ductor | None = None,
) -> Any:
    """Call ``node``'s step function, as registered in this process now, with the arguments
    its latest attempt in the export ``file`` received (``attempt=``: that attempt number;
    ``branch=``: that scatter branch), and return what it returns or raise what it raises,
    here, so a breakpoint in the step stops there. Nothing is written (docs/replay.md).
    ``ductor``: the Ductor whose steps to use (default: every Ductor of this process; the
    step must be registered by one of them). ``ExportError`` names a bad file, a node the
    export does not hold or a step no longer registered."""
    exported = read_export(file)
    runtimes = [ductor.runtime] if ductor is not None else [d.runtime for d in _ductors()]
    return replay_attempt(exported, node, attempt=attempt, branch=branch, runtimes=runtimes)


def _ductors() -> list[Ductor]:
    """Every Ductor of this process: each lives on its Celery app (``app._ductor``)."""
    from celery._state import _get_active_apps

    from .ductor import Ductor

    found = (getattr(app, "_ductor", None) for app in list(_get_active_apps()))
    return [d for d in found if isinstance(d, Ductor)]


def _target(target: RunHandle | str) -> str:
    return target.run_id if isinstance(target, RunHandle) else target


@contextmanager
def harness(
    ductor: Ductor,
    *,
    start_at: datetime | None = None,
    from_export: str | os.PathLike[str] | dict[str, Any] | None = None,
) -> Iterator[Harness]:
    """``with testing.harness(ductor) as h:`` the Ductor's runs, in-process, on a throwaway
    SQLite database and a controlled clock (starting at ``start_at``, an aware datetime,
    default now). ``from_export``: an export (a path or its document) whose run is loaded as
    it was (``h.run_id``), the clock starting at the export's time unless ``start_at`` is
    given. Everything is restored on exit."""
    exported = read_export(from_export) if from_export is not None else None
    if start_at is None and exported is not None:
        start_at = exported.exported_at
    if start_at is not None and (start_at.tzinfo is None or start_at.utcoffset() is None):
        raise ValueError("start_at must be an aware datetime (e.g. datetime(..., tzinfo=UTC))")
    if start_at is not None:
        problem = time_problem(start_at)
        if problem is not None:
            raise ValueError(f"start_at {problem}")
        if not EARLIEST_NOW <= start_at <= LATEST_NOW:
            raise ValueError(
                f"start_at {start_at.isoformat()} is outside {EARLIEST_NOW.isoformat()}.."
                f"{LATEST_NOW.isoformat()} (the clocks ductor runs at)"
            )
    rt = ductor.runtime
    if isinstance(rt.dispatcher, _RecordingDispatcher):
        raise HarnessError("this Ductor is inside a harness already (one at a time)")
    directory = tempfile.mkdtemp(prefix="ductor-harness-")
    url = f"sqlite:///{directory}/ductor.sqlite3"
    h = Harness(ductor, url, (start_at or datetime.now(UTC)).astimezone(UTC))
    saved = (ductor.settings, ductor.client.settings, rt.settings, rt.dispatcher, rt._schema_ready)
    try:
        engine = migrate.create_throwaway(url)
        dialect_of(engine).inject_clock(engine, h._clock)
        settings = dataclasses.replace(rt.settings, database_url=url)
        ductor.settings = ductor.client.settings = rt.settings = settings
        rt.dispatcher = h.dispatcher  # type: ignore[assignment]
        rt._schema_ready = True
        if exported is not None:
            h._load_export(exported)
        yield h
    finally:
        (ductor.settings, ductor.client.settings, rt.settings, rt.dispatcher, rt._schema_ready) = (
            saved
        )
        engine = get_engine(url)
        close_janitor(engine)
        clock.restore(engine)
        forget_engine(url)
        shutil.rmtree(directory, ignore_errors=True)
