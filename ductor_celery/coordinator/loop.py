"""The tick loop: load -> compute (pure) -> commit (versioned) -> dispatch, against any store.

``Coordinator(store, dispatcher).tick(run_id)`` is the one implementation of the loop. In
production ``runtime/tick_task.py:run_tick`` builds it over ``store.tick_store.SqlTickStore``
and the Celery dispatcher; tests build it over ``fakes.InMemoryStore`` and
``fakes.RecordingDispatcher`` and run the very same code without a database or a broker.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, Protocol, TypeVar

from ..engine import AttemptResult, TickPayload, compute_tick
from ..engine.kinds import control_rejected
from .port import (
    Dispatcher,
    Keeper,
    LoadedRun,
    OutboxRow,
    OutcomeNotCarried,
    RunBusy,
    TickStore,
    TickTransaction,
    VersionConflict,
    WorkflowIdTaken,
)

# The logger of the tick loop since before it moved here (operators filter on it).
log = logging.getLogger("ductor_celery.coordinator")

MAX_CONFLICT_RETRIES = 50

#: Reads of large values in one tick: each round reads what the last computation needed. A
#: reference inside a value the tick itself offloaded takes one more; past this the payload
#: still needs values, and the commit refuses it.
MAX_VALUE_ROUNDS = 4

TxT = TypeVar("TxT", bound=TickTransaction)


class TickOutcome(StrEnum):
    """What one tick did: ``TickResult.outcome``, ``run_tick``'s answer, a ticks metric label.
    A ``str``, so it compares, logs and serializes as its value."""

    #: It computed a change, committed it, and handed the commit's messages to the dispatcher.
    COMMITTED = "committed"
    #: Nothing to change: a duplicate or early wake-up, or a settled run.
    NOOP = "noop"
    #: No such run (never started, or pruned).
    MISSING = "missing"
    #: It gave up after ``MAX_CONFLICT_RETRIES`` recomputes; nothing was written.
    CONFLICT = "conflict"
    #: Another tick held the run's lock (an eager tick that reads under the lock: at once) or
    #: committed it since the read (an eager tick that locks at its commit, after waiting for
    #: that tick); any tick after the lock timeout.
    BUSY = "busy"


#: Outcomes after which the caller owes the run nothing: whatever woke it has been seen.
SETTLED_TICKS = frozenset({TickOutcome.COMMITTED, TickOutcome.NOOP, TickOutcome.MISSING})
#: Outcomes of a tick that loaded a run and computed it: the ticks the metrics count and time
#: (a missing run, a busy lock or a tick given up computed nothing).
COMPUTED_TICKS = frozenset({TickOutcome.COMMITTED, TickOutcome.NOOP})


@dataclass
class TickStats:
    """What ticks did, for benchmarks and metrics: outcomes and recomputes."""

    outcomes: Counter[str] = field(default_factory=Counter)
    #: Ticks computed again because the run or one of its attempts changed under them.
    conflicts: int = 0

    def count(self, outcome: TickOutcome) -> None:
        self.outcomes[outcome] += 1


@dataclass(frozen=True, slots=True, eq=False)
class TickResult:
    """What one tick did. ``outcome``: a ``TickOutcome``.
    ``payload``: what the last computation decided (None when nothing was computed);
    ``outbox``: the rows the commit wrote and the dispatcher was handed.

    Compares equal only to another result; compare ``.outcome`` with a ``TickOutcome``."""

    outcome: TickOutcome
    payload: TickPayload | None = None
    outbox: list[OutboxRow] = field(default_factory=list)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TickResult):
            return (self.outcome, self.payload, self.outbox) == (
                other.outcome,
                other.payload,
                other.outbox,
            )
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.outcome)

    def __str__(self) -> str:
        return self.outcome


class TickObserver(Protocol):
    """Told what each tick did, for metrics and traces (runtime/observe.py): ``started``
    first, ``computed`` when a change is about to commit, ``conflict`` per recompute,
    ``ended`` last (after the dispatch of a committed tick)."""

    def started(self) -> None: ...

    def computed(self, loaded: LoadedRun, payload: TickPayload) -> None: ...

    def conflict(self) -> None: ...

    def ended(self, outcome: TickOutcome) -> None: ...


class _Rejected(Exception):
    """A control was rejected by a store rule; the tick is computed again."""


_NOTHING = TickResult(TickOutcome.MISSING)
_SETTLED = TickResult(TickOutcome.NOOP)


class Coordinator(Generic[TxT]):
    """Ticks runs of one store, sending what each commit wrote through one dispatcher."""

    __slots__ = ("store", "dispatcher", "failpoint", "stats", "observer")

    def __init__(
        self,
        store: TickStore[TxT],
        dispatcher: Dispatcher,
        *,
        failpoint: Callable[[str], None] | None = None,
        stats: TickStats | None = None,
        observer: TickObserver | None = None,
    ) -> None:
        self.store = store
        self.dispatcher = dispatcher
        #: Fault tests: called at named points of the tick (runtime/failpoints.py).
        self.failpoint = failpoint
        self.stats = stats if stats is not None else TickStats()
        self.observer = observer

    def tick(
        self,
        run_id: str,
        *,
        eager: bool = False,
        carried: AttemptResult | None = None,
        keep: Keeper | None = None,
        first: bool = False,
    ) -> TickResult:
        """One tick of one run (docs/architecture.md, "One writer per run").

        ``eager``: a step worker's tick: its read does not wait for the run's lock ("busy"
        instead; a tick that locks at its commit waits there for a tick that holds the run, and
        is busy if that tick committed) and leaves the coalesced wake-up alone (a tick message
        is queued whose tick has not started; that tick clears it).

        ``carried`` (eager ticks only): the outcome of an attempt the step worker running the
        tick holds in memory, not written yet. The tick computes with it as one more result
        (the last: it finished last) and its commit writes it, finished and folded at once
        (docs/one-statement-step.md). Only a committed tick wrote it: after any other
        outcome (busy, no-op, missing, conflict) nothing of it is written, and
        ``OutcomeNotCarried`` means its attempt was finished or closed already; either way
        the worker writes it on its own.

        ``keep`` (eager ticks only): may choose one of the tick's new attempts, which the
        commit inserts claimed by that worker, with no step message (runtime/inline.py).

        ``first`` (eager ticks only): the first tick of a run just started, on the step worker
        its start message reached. It locks the run at its commit only, as a plain step's
        outcome's tick does (docs/tick-without-transaction.md): nothing else ticks a run
        that new but a coordinator woken for it, which then finds it busy or moved on.
        """
        store, stats, observer = self.store, self.stats, self.observer
        if observer is not None:
            observer.started()
        # Before the load: a result committed after this point wakes the run again.
        if not eager and store.clear_wake(run_id):
            # Settled (finished, nothing to fold): a duplicate wake-up ends here, unlocked.
            stats.count(TickOutcome.NOOP)
            if observer is not None:
                observer.ended(TickOutcome.NOOP)
            return _SETTLED
        for _ in range(MAX_CONFLICT_RETRIES):
            try:
                result = store.retrying(
                    functools.partial(
                        self._load_compute_commit, run_id, eager, carried, keep, first
                    ),
                    "tick",
                )
            except VersionConflict as conflict:
                stats.conflicts += 1
                if observer is not None:
                    observer.conflict()
                log.debug("run %s: %s; recomputing", run_id, conflict)
                continue
            except RunBusy:
                stats.count(TickOutcome.BUSY)
                return TickResult(TickOutcome.BUSY)
            except _Rejected:
                continue
            stats.count(result.outcome)
            if result.outcome != TickOutcome.COMMITTED:
                if observer is not None:
                    observer.ended(result.outcome)
                return result
            if self.failpoint is not None:
                self.failpoint(
                    "eager_after_commit_before_dispatch"
                    if eager
                    else "after_commit_before_dispatch"
                )
            if keep is not None:
                keep.committed()
            if result.outbox:
                self.dispatcher.send(result.outbox)
            if observer is not None:
                observer.ended(TickOutcome.COMMITTED)
            return result
        log.error("run %s: gave up after %d conflicting ticks", run_id, MAX_CONFLICT_RETRIES)
        return TickResult(TickOutcome.CONFLICT)

    def _load_compute_commit(
        self,
        run_id: str,
        eager: bool,
        carried: AttemptResult | None,
        keep: Keeper | None,
        first: bool = False,
    ) -> TickResult:
        payload: TickPayload | None = None
        try:
            with self.store.transaction() as tx:
                # A plain step's outcome, or a run's first tick: such a tick rarely meets
                # another one (a scatter's branches, finishing together, do), so it may lock
                # the run at its commit only (docs/tick-without-transaction.md).
                lock_late = first or (carried is not None and carried.branch is None)
                found = tx.load(run_id, wait_for_lock=not eager, lock_late=lock_late)
                if found is None:
                    log.warning("tick for unknown run %s ignored", run_id)
                    return _NOTHING
                loaded, spec, inputs = found
                if carried is not None:
                    # Not written yet, so not read: the result the commit will write.
                    inputs = dataclasses.replace(inputs, results=(*inputs.results, carried))
                payload = compute_tick(spec, loaded.state, inputs, loaded.now)
                for _ in range(MAX_VALUE_ROUNDS):
                    if not payload.needs:
                        break
                    # A path read inside a large value (or a scatter a page of an offloaded
                    # list) the load had not read: read them, compute again.
                    inputs = tx.read_values(inputs, payload.needs)
                    payload = compute_tick(spec, loaded.state, inputs, loaded.now)
                if not payload.changed:
                    # Nothing to commit; only a timer row that came due early is moved.
                    tx.refresh_stale_timer(loaded, payload.next_wake_at)
                    return TickResult(TickOutcome.NOOP, payload)
                if carried is not None and carried.token not in payload.folded:
                    # A tick that stops before it folds results (a run not started yet):
                    # folding it here would drop it; the worker writes it alone instead.
                    raise OutcomeNotCarried(carried.token)
                if self.failpoint is not None:
                    self.failpoint("before_commit")
                claim = None if keep is None else keep.choose(loaded, payload)
                if self.observer is not None:
                    self.observer.computed(loaded, payload)
                try:
                    outbox = tx.commit(loaded, payload, claim, carried)
                except (VersionConflict, RunBusy, OutcomeNotCarried):
                    # Told by the commit itself: it wrote nothing, so it claimed nothing. Any
                    # other error may have come after the commit landed (its answer lost):
                    # the choice then stays in doubt (runtime/inline.py, ``in_doubt``).
                    if keep is not None:
                        keep.refused()
                    raise
                return TickResult(TickOutcome.COMMITTED, payload, outbox)
        except WorkflowIdTaken:
            # A redrive reopening the run while another run of its workflow id is open (the
            # client checked, but a start raced it): refuse the redrive, keep the run as it is.
            if payload is None or payload.handled_control is None:
                raise
            self.store.reject_control(
                payload.handled_control.id,
                control_rejected("another run of this workflow id is open"),
            )
            raise _Rejected() from None
