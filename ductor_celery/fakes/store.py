"""``InMemoryStore``: the coordinator's store port over dicts, with a clock the test moves.

It plays three parts a test needs, each as the SQL store would: the tick's store (``load``,
``commit`` conditional on ``record_version``, timers, controls), the step workers' side of an
attempt row (``claim``, ``heartbeat``, ``finish``: the token's one write) and the client's
inserts (``start``, ``signal``, ``control``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any, TypeVar

from ..coordinator.port import Loaded, LoadedRun, OutboxRow, RunBusy, TickClaim
from ..definition.blobrefs import BlobNeeds
from ..definition.spec import WorkflowSpec
from ..engine import AttemptResult, EngineConfig, RunState, TickInputs, TickPayload
from ..engine.deadline import deadline_after
from ..engine.kinds import ControlKind
from ..engine.status import OPEN_RUN_STATUSES, TERMINAL_RUN_STATUSES, AttemptOutcome, RunStatus
from ..engine.tags import checked_tags
from ..errors import DanglingReference
from . import commit as committing
from .load import load
from .tables import AttemptRow, ControlRow, RunRow, SignalRow, Tables, json_copy

T = TypeVar("T")

#: Where the clock starts unless told otherwise: a fixed instant, so runs repeat exactly.
EPOCH = datetime(2024, 1, 1, tzinfo=UTC)


class InMemoryStore:
    """Runs, attempts, signals, controls, outbox and timer rows in memory; one thread."""

    def __init__(self, *, now: datetime | None = None, config: EngineConfig | None = None) -> None:
        if now is not None and now.tzinfo is None:
            raise ValueError("InMemoryStore(now=...) needs an aware datetime")
        #: The store's clock: what a tick's load reads as ``now`` (the database's now()).
        self.now = now or EPOCH
        self.config = config or EngineConfig()
        self.tables = Tables()
        self.specs: dict[str, WorkflowSpec] = {}
        #: Runs whose lock another (pretend) tick holds: ``held_elsewhere``.
        self._held: set[str] = set()

    # -- the clock ---------------------------------------------------------------------------

    def advance(self, seconds: float) -> datetime:
        if seconds < 0:
            raise ValueError(f"the clock only moves forward (advance({seconds}))")
        self.now += timedelta(seconds=seconds)
        return self.now

    # -- the coordinator's port ----------------------------------------------------------------

    def transaction(self) -> InMemoryTransaction:
        return InMemoryTransaction(self)

    def retrying(self, fn: Callable[[], T], what: str) -> T:
        del what  # memory is never briefly unreachable
        return fn()

    def clear_wake(self, run_id: str) -> bool:
        tables = self.tables
        tables.wakes.discard(run_id)
        run = tables.runs.get(run_id)
        due = tables.timers.get(run_id)
        return (
            run is not None
            and RunStatus(run.status) in TERMINAL_RUN_STATUSES
            and not any(
                a.run_id == run_id and a.finished_at is not None and not a.folded
                for a in tables.attempts.values()
            )
            and not any(c.run_id == run_id and c.handled_at is None for c in tables.controls)
            and (due is None or due > self.now)
        )

    def reject_control(self, control_id: int, result: str) -> None:
        for c in self.tables.controls:
            if c.id == control_id and c.handled_at is None:
                c.handled_at, c.result = self.now, result[:2000]

    @contextmanager
    def held_elsewhere(self, run_id: str) -> Iterator[None]:
        """While inside, another tick holds the run's lock: an eager tick finds it busy."""
        self._held.add(run_id)
        try:
            yield
        finally:
            self._held.discard(run_id)

    # -- the client's inserts ------------------------------------------------------------------

    def add_definition(self, spec: WorkflowSpec) -> str:
        """Store a definition (``register`` + the start's definition row); its hash."""
        self.specs[spec.spec_hash] = spec
        return spec.spec_hash

    def start(
        self,
        spec: WorkflowSpec,
        input: Any = None,
        *,
        run_id: str | None = None,
        workflow_id: str | None = None,
        deadline: float | None = None,
        tags: dict[str, str] | None = None,
    ) -> str:
        """Insert a pending run (no tick yet). An open run of ``workflow_id`` wins: its id is
        returned and nothing is inserted, as ``ductor.start`` does. ``deadline``: seconds from
        now (default: the workflow's), as ``ductor.start(deadline=...)``; ``tags`` as
        ``ductor.start(tags=...)`` (checked the same way)."""
        run_tags = checked_tags(tags)
        self.add_definition(spec)
        run_id = run_id or uuid.uuid4().hex
        workflow_id = workflow_id or run_id
        if run_id in self.tables.runs:
            raise ValueError(f"run {run_id!r} exists")
        open_statuses = {s.value for s in OPEN_RUN_STATUSES}
        for row in self.tables.runs.values():
            if row.workflow_id == workflow_id and row.status in open_statuses:
                return row.run_id
        self.tables.runs[run_id] = committing.new_run(
            run_id=run_id,
            workflow_id=workflow_id,
            spec=spec,
            state=RunState.initial(
                list(spec.graph.order),
                deadline_at=deadline_after(
                    self.now, deadline if deadline is not None else spec.deadline
                ),
                tags=run_tags,
            ),
            input=input,
            now=self.now,
        )
        if run_tags:
            self.tables.tags[run_id] = run_tags
        self.tables.wakes.add(run_id)
        return run_id

    def signal(self, run_id: str, name: str, payload: Any = None) -> int:
        """Accept a signal (or an approval decision, named ``approval_signal(node)``)."""
        run = self.run(run_id)
        row = SignalRow(
            id=self.tables.next_id("signal"),
            run_id=run_id,
            workflow_id=run.workflow_id,
            name=name,
            payload=json_copy(payload),
            created_at=self.now,
        )
        self.tables.signals.append(row)
        return row.id

    def control(
        self, run_id: str, kind: ControlKind | str, *, reason: str | None = None, **input: Any
    ) -> int:
        """Queue an operator control. ``input=...`` (continue-as-new, redrive), ``node=`` (a
        redrive's from-node) and ``spec_hash=`` (a continue-as-new's target definition, added
        with ``add_definition``) are passed through."""
        self.run(run_id)
        target = {k: input.pop(k) for k in ("node", "spec_hash") if k in input}
        unknown = set(input) - {"input"}
        if unknown:
            raise TypeError(f"control() got unexpected keyword arguments {sorted(unknown)}")
        row = ControlRow(
            id=self.tables.next_id("control"),
            run_id=run_id,
            kind=str(kind),
            reason=reason,
            input=json_copy(input.get("input")),
            has_input="input" in input,
            requested_by=None,
            created_at=self.now,
            **target,
        )
        self.tables.controls.append(row)
        return row.id

    # -- the step worker's writes --------------------------------------------------------------

    def claim(self, token: str, worker: str = "fake-worker", carrier: str | None = None) -> bool:
        """The worker's claim: only an attempt nobody claimed and nobody closed. ``carrier``:
        the task id of the message the worker runs it under (``store.attempts.claim``)."""
        row = self.attempt(token)
        if row.claimed_at is not None or row.finished_at is not None:
            return False
        row.claimed_at, row.claimed_by, row.carrier = self.now, worker, carrier
        return True

    def heartbeat(self, token: str) -> bool:
        row = self.attempt(token)
        if row.finished_at is not None:
            return False
        row.heartbeat_at = self.now
        return True

    def should_stop(self, token: str) -> bool:
        """What the worker's heartbeat learns (``store.attempts.heartbeat``): its run's
        cooperative cancel was requested, or the attempt was closed."""
        row = self.attempt(token)
        return row.cancel_requested_at is not None or row.finished_at is not None

    def finish(
        self,
        token: str,
        *,
        output: Any = None,
        error: dict[str, Any] | None = None,
        retryable: bool = True,
        patch: dict[str, Any] | None = None,
        cancelled: bool = False,
        tags: list[list[str]] | None = None,
    ) -> bool:
        """The outcome, written once: succeeded unless ``error`` is given (``cancelled``: the
        step stopped on a cancel, ``StepCancelled``). False: the attempt was finished or
        closed already (a late or duplicate outcome)."""
        row = self.attempt(token)
        if row.finished_at is not None:
            return False
        row.finished_at, row.finished_seq = self.now, self.tables.next_id("finish")
        row.outcome = (
            AttemptOutcome.CANCELLED
            if cancelled
            else AttemptOutcome.FAILED
            if error is not None
            else AttemptOutcome.SUCCEEDED
        )
        row.output, row.error = json_copy(output), json_copy(error)
        row.retryable, row.patch, row.tags = retryable, json_copy(patch), json_copy(tags)
        self.tables.wakes.add(row.run_id)
        return True

    # -- reading -------------------------------------------------------------------------------

    def run(self, run_id: str) -> RunRow:
        found = self.tables.runs.get(run_id)
        if found is None:
            raise KeyError(f"no run {run_id!r}")
        return found

    def state(self, run_id: str) -> RunState:
        return RunState.from_json(self.run(run_id).state)

    def attempt(self, token: str) -> AttemptRow:
        found = self.tables.attempts.get(token)
        if found is None:
            raise KeyError(f"no attempt {token!r}")
        return found

    def open_attempts(self, run_id: str | None = None) -> list[AttemptRow]:
        """Attempts not finished yet, oldest first (of one run, or of every run)."""
        return [
            a
            for a in self.tables.attempts.values()
            if a.finished_at is None and run_id in (None, a.run_id)
        ]

    def delete_outbox(self, ids: list[int]) -> None:
        """What the outbox janitor does with rows once they are sent."""
        for i in ids:
            self.tables.outbox.pop(i, None)


class InMemoryTransaction:
    """One tick's transaction: everything written in it is undone if it ends in an error
    (it keeps a copy of the tables from its start: fine for a test's few runs)."""

    __slots__ = ("_store", "_before")

    def __init__(self, store: InMemoryStore) -> None:
        self._store = store
        self._before: Tables | None = None

    def __enter__(self) -> InMemoryTransaction:
        self._before = self._store.tables.snapshot()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None and self._before is not None:
            self._store.tables = self._before

    def load(self, run_id: str, *, wait_for_lock: bool, lock_late: bool = False) -> Loaded | None:
        del lock_late  # held from the load on: what every tick may assume
        store = self._store
        if run_id in store._held:
            if not wait_for_lock:
                raise RunBusy(run_id)
            raise RuntimeError(f"run {run_id} is held by another tick; one thread cannot wait")
        return load(store.tables, store.specs, run_id, store.now, store.config)

    def commit(
        self,
        loaded: LoadedRun,
        payload: TickPayload,
        claim: TickClaim | None,
        carried: AttemptResult | None = None,
    ) -> list[OutboxRow]:
        store = self._store
        return committing.commit(store.tables, store.specs, loaded, payload, claim, carried)

    def read_values(self, inputs: TickInputs, needs: BlobNeeds) -> TickInputs:
        """The in-memory store keeps every value inline (it never offloads one), so a
        reference here was never written by ductor: it dangles."""
        missing = sorted({*needs.values, *needs.pages})
        raise DanglingReference(
            f"blob {', '.join(missing)} referenced by run {inputs.run_id} "
            "does not exist (the in-memory store holds no blobs)"
        )

    def refresh_stale_timer(self, loaded: LoadedRun, fire_at: datetime | None) -> bool:
        current = loaded.timer_at
        if current is None or current > loaded.now or current == fire_at:
            return False
        tables = self._store.tables
        committing.set_timer(tables, loaded, fire_at)
        # store/ticks.py: a timer row moved gives the run a new version.
        tables.runs[loaded.run_id].record_version += 1
        return True
