"""The coordinator's narrow interfaces: the store it ticks against and the dispatcher it
sends through, with the values and errors that cross them.

Two stores implement ``TickStore``: ``store.tick_store.SqlTickStore`` (PostgreSQL and SQLite,
production) and ``fakes.InMemoryStore`` (pure Python, for tests). Both are driven by the same
``Coordinator`` (``coordinator/loop.py``), so a test of the fake exercises the production
tick loop: only the rows are kept elsewhere.

Nothing here imports SQLAlchemy, Celery, ``store/`` or ``runtime/``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, TypeVar

from ..definition.blobrefs import BlobNeeds
from ..definition.spec import WorkflowSpec
from ..engine import AttemptResult, RunState, TickInputs, TickPayload
from ..engine.kinds import DispatchKind

T = TypeVar("T")
TxT_co = TypeVar("TxT_co", bound="TickTransaction", covariant=True)


@dataclass(slots=True)
class LoadedRun:
    """The run row as a tick's load read it: what the commit is conditional on."""

    run_id: str
    workflow_id: str
    workflow: str
    spec_hash: str
    record_version: int
    state: RunState
    now: datetime
    parent_run_id: str | None = None
    #: When the run's timer row fires (None: no row), so a commit can leave a good one alone.
    timer_at: datetime | None = None
    #: When the run was inserted (its duration, for metrics).
    created_at: datetime | None = None
    #: The run's W3C traceparent (ductor_celery/tracing.py); None: not traced.
    trace_context: str | None = None
    #: Run concurrency: the run's key and its workflow's limit, when it has one; the commit
    #: that ends the run releases its slot (store/run_slots.py).
    concurrency_key: str | None = None
    concurrency_limit: int = 0
    #: The run's priority (0..9, higher first).
    priority: int = 0
    #: The nodes its stored state left to their attempt rows (store/done_nodes.py), given
    #: back in ``state``: a commit may leave them there again.
    done: frozenset[str] = frozenset()


#: What a load returns: the run, its pinned definition, and the tick's inputs.
Loaded = tuple[LoadedRun, WorkflowSpec, TickInputs]


@dataclass(slots=True)
class RateTake:
    """The rate-limit token of a claimed attempt, taken by the tick's commit itself
    (store/ticks.py): its bucket, N and the period in seconds. ``taken`` is the commit's
    answer: False means the bucket had no token (or another attempt of the key was ahead in
    line), and the attempt was inserted waiting in line, not claimed: the worker must not run
    it (docs/flow-control.md)."""

    key: str
    limit: int
    period: float
    taken: bool | None = None


@dataclass(frozen=True, slots=True)
class TickClaim:
    """One of the tick's new attempts, claimed in the tick's own commit by the step worker
    running the tick, which runs it next (runtime/inline.py): it gets no outbox row."""

    token: str
    worker: str
    #: More new attempts the same worker runs after that one, one at a time (a scatter's
    #: quick branches, runtime/inline.py): no outbox row, and inserted unclaimed; the worker
    #: claims each as it starts it, as a message would. Left unclaimed (the worker died),
    #: the tick re-sends them as messages after ``ductor_resend_unclaimed_after``.
    held: tuple[str, ...] = ()
    #: The task id of the Celery message the worker runs the claimed attempt under (the
    #: message that began its inline chain), written with the claim: a terminate revokes it
    #: with ``terminate=True``, which kills the step although it has no message of its own.
    carrier: str | None = None
    #: The claimed attempt is rate-limited: its token is taken in the same commit.
    rate: RateTake | None = None


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """One dispatch intent written by a commit, sent after it."""

    id: int
    run_id: str
    #: A str only for a kind this version does not know (a row written by a newer ductor,
    #: read back by the sweeper): the dispatcher logs it and drops the row.
    kind: DispatchKind | str
    task: str
    queue: str | None
    payload: dict[str, Any]


class VersionConflict(Exception):
    """Someone else committed this run (or an attempt changed) since we loaded it."""


class WorkflowIdTaken(Exception):
    """A redrive would reopen the run while another run of its workflow id is open (a start
    raced the client's check): the store refused it; roll back."""


class RunBusy(Exception):
    """Another tick holds the run's lock (when asked not to wait for it), held it past the lock
    timeout, or committed the run since this tick read it (a tick that locks at its commit)."""


class OutcomeNotCarried(Exception):
    """The commit could not write the outcome the tick carried (``Coordinator.tick``'s
    ``carried``): its attempt is finished or closed already (a timeout or terminate closed
    it, or an earlier commit whose acknowledgement was lost wrote it) or holds a lease. The
    transaction is rolled back, nothing of the tick is written, and the worker takes its
    ordinary path (``attempts.finish``, then a tick or a wake-up)."""


class TickTransaction(Protocol):
    """One tick's transaction: the load holds the run's lock until it ends. Leaving its
    context normally commits everything written in it; an exception rolls it all back.

    Given ``lock_late``, a store may instead lock the run from its first write to the end, at
    the version the load read (docs/tick-without-transaction.md): its commit then raises
    ``RunBusy``, writing nothing, if another tick holds the run or committed it since the
    load."""

    def load(self, run_id: str, *, wait_for_lock: bool, lock_late: bool = False) -> Loaded | None:
        """The run and everything its tick reads, the run locked for this transaction. None:
        no such run. ``wait_for_lock=False``: raise ``RunBusy`` if another tick holds it.
        ``lock_late``: the lock may be taken at the commit instead (the class's note)."""

    def commit(
        self,
        loaded: LoadedRun,
        payload: TickPayload,
        claim: TickClaim | None,
        carried: AttemptResult | None = None,
    ) -> list[OutboxRow]:
        """Write the payload, conditional on ``loaded.record_version``: the outbox rows to send
        after the transaction. ``VersionConflict`` and ``WorkflowIdTaken`` mean roll back.
        ``carried``: a step's outcome the load did not read (the worker holds it), written
        finished and folded by this commit, conditional on its attempt being open and
        unleased (``OutcomeNotCarried``: roll back)."""

    def refresh_stale_timer(self, loaded: LoadedRun, fire_at: datetime | None) -> bool:
        """A tick with nothing to commit still moves a timer row that came due early, and then
        gives the run a new version (``record_version``): a tick that read the run before and
        locks it only at its commit, at the version it read, must not keep the earlier row
        (docs/tick-without-transaction.md, "The timer row")."""

    def read_values(self, inputs: TickInputs, needs: BlobNeeds) -> TickInputs:
        """``inputs`` with the large values and list pages a computation needed read in
        (docs/large-values.md); ``DanglingReference`` names a blob that is gone."""


class TickStore(Protocol[TxT_co]):
    """Where runs live, as the coordinator sees them."""

    def transaction(self) -> AbstractContextManager[TxT_co]:
        """Begin one tick's transaction."""

    def retrying(self, fn: Callable[[], T], what: str) -> T:
        """Run ``fn`` (one tick attempt, its transaction included), again while the store is
        briefly unreachable."""

    def clear_wake(self, run_id: str) -> bool:
        """A coordinator tick of the run starts: later results need a wake-up of their own.
        True when the run is settled (finished, with no outcome to fold, no control to handle
        and no timer row come due): the tick has nothing to do. A cheap read without the
        run's lock, so a duplicate wake-up of a finished run costs no more."""

    def reject_control(self, control_id: int, result: str) -> None:
        """Mark a control handled without applying it (its commit broke a store rule), in a
        transaction of its own."""


class Dispatcher(Protocol):
    """Sends a commit's outbox rows: a hint channel, at least once."""

    def send(self, rows: list[OutboxRow]) -> None: ...


class Keeper(Protocol):
    """The step worker running an eager tick, which may run one of its new attempts itself
    (runtime/inline.py)."""

    def choose(self, loaded: LoadedRun, payload: TickPayload) -> TickClaim | None:
        """Before the commit: the new attempt to claim in it, if any."""

    def committed(self) -> None:
        """After the commit: the attempt last chosen is this worker's to run."""

    def refused(self) -> None:
        """The commit ran and wrote nothing (the run busy or moved on, the outcome it carried
        not written): the attempt last chosen was not claimed."""
