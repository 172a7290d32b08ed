"""The coordinator's tick in a Celery process: ``run_tick`` drives ``coordinator.Coordinator``
over the production store (``store.tick_store.SqlTickStore``) and the Celery dispatcher.

Load and commit share one transaction (one connection, one BEGIN). The load locks the run row
(``store.load.load_on``): that lock is the run's tick lock, so two processes never compute one
run at once, and the commit stays conditional on ``record_version`` as the last line of defence.

The same code runs in two places (docs/architecture.md, "Who runs a tick"):
- on the coordinator queue (``ductor.tick``), waiting for the run's lock;
- eagerly, in the step worker that has just written an attempt's outcome
  (``ductor_eager_ticks``), only if it can take the lock without waiting; otherwise that
  worker sends the wake-up to the coordinator queue instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..coordinator import (
    MAX_CONFLICT_RETRIES,
    Coordinator,
    Keeper,
    OutboxRow,
    OutcomeNotCarried,
    TickOutcome,
    TickStats,
    VersionConflict,
)
from ..store.tick_store import SqlTickStore
from . import observe
from .inline import InlineChain, bundler
from .outbox_janitor import sent_outbox

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from ..engine import AttemptResult
    from .dispatch import Dispatcher, QuickBranches
    from .ports import WorkerPort

__all__ = [
    "MAX_CONFLICT_RETRIES",
    "TICK_STATS",
    "Coordinator",
    "Keeper",
    "OutcomeNotCarried",
    "TickStats",
    "VersionConflict",
    "run_tick",
]

#: Per process (a prefork child has its own).
TICK_STATS = TickStats()


class _SendThenForget:
    """The coordinator's dispatcher in a Celery process: send the rows, then hand their ids
    to this process's outbox janitor. Deleting them is off the critical path: a background
    thread deletes them in batches; a row this process dies before deleting is sent again by
    the sweeper (harmless: claims are by token).

    ``bundle`` (an inline chain's eager tick): the step messages as sent, some of them
    carrying others (``InlineChain.bundle``); every row is forgotten once they are sent."""

    __slots__ = ("_bundle", "_dispatcher", "_engine")

    def __init__(
        self,
        dispatcher: Dispatcher,
        engine: Engine,
        bundle: Callable[[list[OutboxRow]], list[OutboxRow]] | None = None,
    ) -> None:
        self._dispatcher = dispatcher
        self._engine = engine
        self._bundle = bundle

    def send(self, rows: list[OutboxRow]) -> None:
        self._dispatcher.send(rows if self._bundle is None else self._bundle(rows))
        sent_outbox(self._engine).add([r.id for r in rows])


def run_tick(
    rt: WorkerPort,
    run_id: str,
    *,
    eager: bool = False,
    carried: AttemptResult | None = None,
    keep: Keeper | None = None,
    first: bool = False,
    quick: QuickBranches | None = None,
) -> TickOutcome:
    """One tick of one run: what it did (``TickOutcome``); ``BUSY`` when another tick holds
    the run's lock: with ``eager`` at once (the caller then wakes the
    coordinator, which waits for it), otherwise after waiting ``TICK_LOCK_TIMEOUT`` for a tick
    that stalled (the sweeper's lost-wake-up scan comes back to the run: store/tick_store.py).

    An eager tick leaves the coalesced wake-up row alone: a row there means a tick message is
    queued whose tick has not started, and that tick clears it (store/wakes.py).

    ``carried`` (eager ticks only): the outcome of the attempt the step worker has just run,
    not written yet: the tick computes with it and its commit writes it, finished and folded
    at once, so an inline step costs one commit and one write of its attempt row
    (docs/one-statement-step.md). The tick is the coordinator's code: still one writer of the
    run row. Only ``COMMITTED`` means it was written; after any other outcome, or
    ``OutcomeNotCarried`` (its attempt was finished or closed already), the worker writes it
    on its own (``attempts.finish``).

    ``keep`` (eager ticks only): may choose one of the tick's new attempts, which the commit
    then inserts as claimed by the step worker running the tick, with no step message: that
    worker runs it next (``ductor_inline_steps``, runtime/inline.py). If it dies first, the
    claimed attempt is retried by its step timeout, as after any worker lost mid-step.

    ``first`` (eager ticks only): the first tick of a run just started, on the step worker its
    start message reached (``steps.first_tick``): it reads and commits without a transaction
    of its own, as a plain step's tick does (``Coordinator.tick``'s ``first``).

    ``quick`` (a wake-up's hint, ``dispatch.QUICK_HEADER``): a scatter node whose branches a
    step worker has just run quickly; their messages go out bundled (``inline.bundler``), as
    an inline chain's own tick sends them (``InlineChain.bundle``).
    """
    engine = rt.engine()
    coordinator = Coordinator(
        SqlTickStore(engine, rt.spec_for, rt.settings.engine_config()),
        _SendThenForget(
            rt.dispatcher,
            engine,
            keep.bundle if isinstance(keep, InlineChain) else bundler(rt, run_id, quick),
        ),
        failpoint=rt.failpoint,
        stats=TICK_STATS,
        observer=observe.OBSERVER,
    )
    return coordinator.tick(run_id, eager=eager, carried=carried, keep=keep, first=first).outcome
