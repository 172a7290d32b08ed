"""What a tick tells the outside once it is over: metrics (runtime/metrics.py) and its trace
span (ductor_celery/tracing.py).

The tick loop (coordinator/loop.py) calls its observer's ``started`` first, ``computed`` when a
computed change is about to commit, ``conflict`` per recompute and ``ended`` last; ``OBSERVER``
is the one ``run_tick`` hands it. What was computed waits in a
thread-local until ``tick_ended`` says the commit went through, so a tick that rolled back
and was computed again is reported once. Ticks never nest within one thread.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from .. import tracing
from ..coordinator.loop import TickOutcome
from . import metrics

if TYPE_CHECKING:
    from ..coordinator.port import LoadedRun
    from ..engine import TickPayload


class _Tick(threading.local):
    started: float = 0.0
    started_ns: int = 0
    computed: tuple[LoadedRun, TickPayload] | None = None


_tick = _Tick()


def tick_started() -> None:
    _tick.started = time.perf_counter()
    _tick.started_ns = time.time_ns()
    _tick.computed = None


def tick_computed(loaded: LoadedRun, payload: TickPayload) -> None:
    _tick.computed = (loaded, payload)


def tick_conflict() -> None:
    metrics.record_conflict()


def tick_ended(outcome: TickOutcome) -> None:
    """``committed``, ``noop``, or what else ``run_tick`` returns (not a computed tick)."""
    computed, _tick.computed = _tick.computed, None
    metrics.record_tick(outcome, time.perf_counter() - _tick.started, computed)
    if outcome == TickOutcome.COMMITTED and computed is not None:
        loaded, _ = computed
        tracing.record_tick(
            loaded.trace_context, loaded.run_id, loaded.workflow, outcome, _tick.started_ns
        )


class _Observer:
    """The tick loop's observer (``coordinator.loop.TickObserver``) in production."""

    started = staticmethod(tick_started)
    computed = staticmethod(tick_computed)
    conflict = staticmethod(tick_conflict)
    ended = staticmethod(tick_ended)


OBSERVER = _Observer()
