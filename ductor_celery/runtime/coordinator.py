"""The coordinator's tick: load -> compute (pure) -> commit (versioned) -> dispatch.

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

import functools
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ..engine import compute_tick
from ..engine.kinds import control_rejected
from ..store import wakes
from ..store.db import with_retry
from ..store.load import LoadedRun, RunBusy, load_on
from ..store.outbox import OutboxRow
from ..store.ticks import (
    TickClaim,
    VersionConflict,
    WorkflowIdTaken,
    commit_on,
    refresh_stale_timer,
    reject_control,
)
from . import observe
from .outbox_janitor import sent_outbox

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from ..engine import TickPayload
    from .runtime import Runtime

log = logging.getLogger("ductor_celery.coordinator")

MAX_CONFLICT_RETRIES = 50


@dataclass
class TickStats:
    """What this process's ticks did, for benchmarks and metrics: outcomes and recomputes."""

    outcomes: Counter[str] = field(default_factory=Counter)
    #: Ticks computed again because the run or one of its attempts changed under them.
    conflicts: int = 0

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] += 1


#: Per process (a prefork child has its own).
TICK_STATS = TickStats()


#: Runs first in a tick's transaction (the step worker writing its attempt's outcome); False:
#: it had nothing to write, and the tick is not run (``PreludeRefused``).
Prelude = Callable[["Connection"], bool]


class Keeper(Protocol):
    """The step worker running an eager tick, which may run one of its new attempts itself
    (runtime/inline.py)."""

    def choose(self, loaded: LoadedRun, payload: TickPayload) -> TickClaim | None:
        """Before the commit: the new attempt to claim in it, if any."""

    def committed(self) -> None:
        """After the commit: the attempt last chosen is this worker's to run."""


class PreludeRefused(Exception):
    """The prelude wrote nothing (the attempt was closed or leased): no tick was run, and the
    caller takes its ordinary path."""


def run_tick(
    rt: Runtime,
    run_id: str,
    *,
    eager: bool = False,
    prelude: Prelude | None = None,
    keep: Keeper | None = None,
) -> str:
    """One tick of one run. Returns "missing", "noop", "committed" or "conflict"; with
    ``eager``, "busy" when another tick holds the run's lock (the caller then wakes the
    coordinator, which waits for it).

    An eager tick leaves the coalesced wake-up row alone: a row there means a tick message is
    queued whose tick has not started, and that tick clears it (store/wakes.py).

    ``prelude`` (eager ticks only): a write made first in the tick's own transaction, so the
    step worker's outcome and the tick that folds it commit together, one transaction instead
    of two. The prelude is the worker's write, the tick is the coordinator's code: still one
    writer of the run row. It is committed even when the run is busy ("busy": the write alone);
    it is rolled back with the tick on a conflict and written again by the recomputed tick;
    "conflict" (given up) means it was not written.

    ``keep`` (eager ticks only): may choose one of the tick's new attempts, which the commit
    then inserts as claimed by the step worker running the tick, with no step message: that
    worker runs it next (``ductor_inline_steps``, runtime/inline.py). If it dies first, the
    claimed attempt is retried by its step timeout, as after any worker lost mid-step.
    """
    engine = rt.engine()
    observe.tick_started()
    if not eager:
        # Before the load: a result committed after this point wakes the run again.
        with_retry(functools.partial(wakes.clear_wake, engine, run_id), what="clear wake-up")
    for _ in range(MAX_CONFLICT_RETRIES):
        try:
            outcome, payload, outbox = with_retry(
                functools.partial(_load_compute_commit, rt, run_id, eager, prelude, keep),
                what="tick",
            )
        except VersionConflict as conflict:
            TICK_STATS.conflicts += 1
            observe.tick_conflict()
            log.debug("run %s: %s; recomputing", run_id, conflict)
            continue
        except RunBusy:
            TICK_STATS.count("busy")
            return "busy"
        except _Rejected:
            continue
        TICK_STATS.count(outcome)
        if outcome != "committed":  # "busy" too, when a prelude's write was committed alone
            observe.tick_ended(outcome)
            return outcome
        rt.failpoint(
            "eager_after_commit_before_dispatch" if eager else "after_commit_before_dispatch"
        )
        if keep is not None:
            keep.committed()
        if outbox:
            rt.dispatcher.send(outbox)
            # Off the critical path: deleted in batches by a background thread. A row this
            # process dies before deleting is sent again by the sweeper (harmless: by token).
            sent_outbox(engine).add([r.id for r in outbox])
        observe.tick_ended("committed")
        return "committed"
    log.error("run %s: gave up after %d conflicting ticks", run_id, MAX_CONFLICT_RETRIES)
    return "conflict"


class _Rejected(Exception):
    """A control was rejected by a database rule; the tick is computed again."""


def _load_compute_commit(
    rt: Runtime,
    run_id: str,
    eager: bool = False,
    prelude: Prelude | None = None,
    keep: Keeper | None = None,
) -> tuple[str, TickPayload | None, list[OutboxRow]]:
    engine = rt.engine()
    config = rt.settings.engine_config()
    payload: TickPayload | None = None
    try:
        with engine.begin() as conn:
            if prelude is not None and not prelude(conn):
                raise PreludeRefused(run_id)
            try:
                loaded_all = load_on(conn, run_id, rt.spec_for, config, wait_for_lock=not eager)
            except RunBusy:
                if prelude is None:
                    raise
                return "busy", None, []  # leaving the block commits the prelude's write
            if loaded_all is None:
                log.warning("tick for unknown run %s ignored", run_id)
                return "missing", None, []
            loaded, spec, inputs = loaded_all
            payload = compute_tick(spec, loaded.state, inputs, loaded.now)
            if not payload.changed:
                # Nothing to commit; only a timer row that came due early is moved.
                refresh_stale_timer(conn, loaded, payload.next_wake_at)
                return "noop", payload, []
            rt.failpoint("before_commit")
            claim = None if keep is None else keep.choose(loaded, payload)
            observe.tick_computed(loaded, payload)
            return "committed", payload, commit_on(conn, loaded, payload, claim)
    except WorkflowIdTaken:
        # A redrive reopening the run while another run of its workflow id is open (the client
        # checked, but a start raced it): refuse the redrive, keep the run as it is.
        if payload is None or payload.handled_control is None:
            raise
        reject_control(
            engine,
            payload.handled_control.id,
            control_rejected("another run of this workflow id is open"),
        )
        raise _Rejected() from None
