"""Prometheus metrics of a ductor worker, served on ``ductor_metrics_port`` (docs/metrics.md).

Prefork-safe: Celery's pool children do the counting (steps, ticks) and the parent serves, so
the values live in prometheus_client's multiprocess mode, one memory-mapped file per process
in a directory the parent creates before its pool forks (``PROMETHEUS_MULTIPROC_DIR``, or
the user's own when it is set). The parent's ``/metrics`` sums every process's file. Under
``-P solo`` and ``-P threads`` the same files simply have one writer.

Without ``ductor_metrics_port`` nothing is created and every ``record_*`` function returns
at its first line. No label carries a run id or workflow id: a label value per run would
grow the series without bound.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from celery import bootsteps

from ..coordinator.loop import COMPUTED_TICKS, TickOutcome
from ..engine.status import RunStatus

if TYPE_CHECKING:
    from ..coordinator.port import LoadedRun
    from ..engine import TickPayload

log = logging.getLogger("ductor_celery.metrics")

#: Step and tick durations are milliseconds to seconds; runs, seconds to days.
_FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_RUN_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 21600.0, 86400.0)


class _Metrics:
    """The metric objects; created once per process, after the multiprocess mode is set."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        # Values go to the multiprocess files whatever the registry; a private one keeps
        # them out of the default registry a user's own exporter may serve.
        registry = CollectorRegistry(auto_describe=False)
        self.runs_started = Counter(
            "ductor_runs_started",
            "Runs that started (pending -> running).",
            ["workflow"],
            registry=registry,
        )
        self.runs_finished = Counter(
            "ductor_runs_finished",
            "Runs that finished, by final status.",
            ["workflow", "status"],
            registry=registry,
        )
        self.run_duration = Histogram(
            "ductor_run_duration_seconds",
            "Run duration, from its start() to its end.",
            ["workflow"],
            buckets=_RUN_BUCKETS,
            registry=registry,
        )
        self.step_attempts = Counter(
            "ductor_step_attempts",
            "Step attempts that ended, by outcome.",
            ["step", "outcome"],
            registry=registry,
        )
        self.step_duration = Histogram(
            "ductor_step_duration_seconds",
            "Time in the step function, per attempt.",
            ["step"],
            buckets=_STEP_BUCKETS,
            registry=registry,
        )
        self.schedule_to_start = Histogram(
            "ductor_step_schedule_to_start_seconds",
            "From an attempt's dispatch to its claim by a worker.",
            ["step"],
            buckets=_STEP_BUCKETS,
            registry=registry,
        )
        self.ticks = Counter(
            "ductor_ticks",
            "Ticks computed: committed, noop, or conflict (computed again).",
            ["result"],
            registry=registry,
        )
        self.tick_duration = Histogram(
            "ductor_tick_duration_seconds",
            "A tick, from its load to its dispatch.",
            buckets=_FAST_BUCKETS,
            registry=registry,
        )
        self.sweeper_actions = Counter(
            "ductor_sweeper_actions",
            "What the sweeper did, by kind.",
            ["action"],
            registry=registry,
        )


_metrics: _Metrics | None = None
_lock = threading.Lock()


def _get() -> _Metrics | None:
    """The metric objects, or None when metrics are off (no multiprocess directory)."""
    global _metrics
    if _metrics is not None or not enabled():
        return _metrics
    with _lock:
        if _metrics is None:
            _use_multiprocess_values()
            _metrics = _Metrics()
    return _metrics


def enabled() -> bool:
    return _on


#: Set by the worker that serves metrics, inherited by its pool children.
_ENABLED_ENV = "DUCTOR_METRICS_ON"
#: The variable as this process started with it, or set since by ``MetricsBootstep`` (whose
#: forked pool children inherit the flag too): a module flag, not a lookup in ``os.environ``
#: at every recording (about 0.6% of an inline step's CPU with metrics off).
_on = bool(os.environ.get(_ENABLED_ENV))


def _use_multiprocess_values() -> None:
    """Make new metric values multiprocess ones, even if prometheus_client was imported before
    the directory was set (it picks its value class at import time)."""
    from prometheus_client import values

    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]


# -- what the code records --------------------------------------------------------------------


def record_attempt(step: str, outcome: str, seconds: float | None) -> None:
    """A worker wrote an attempt's outcome (an ``AttemptOutcome``), or found its attempt
    closed already (``closed``)."""
    m = _get()
    if m is None:
        return
    m.step_attempts.labels(step, outcome).inc()
    if seconds is not None:
        m.step_duration.labels(step).observe(seconds)


def record_claim(step: str, queued_seconds: float | None) -> None:
    m = _get()
    if m is None or queued_seconds is None:
        return
    m.schedule_to_start.labels(step).observe(max(0.0, queued_seconds))


def record_conflict() -> None:
    m = _get()
    if m is not None:
        m.ticks.labels(TickOutcome.CONFLICT).inc()


def record_tick(
    outcome: TickOutcome, seconds: float, computed: tuple[LoadedRun, TickPayload] | None
) -> None:
    """A tick ended (runtime/observe.py): ``committed`` with what it computed, ``noop``, or
    anything else (busy, missing, given up: not a computed tick, not counted)."""
    m = _get()
    if m is None or outcome not in COMPUTED_TICKS:
        return
    m.ticks.labels(outcome).inc()
    m.tick_duration.observe(seconds)
    if outcome == TickOutcome.COMMITTED and computed is not None:
        _TickCounts.of(*computed).emit(m)


def record_sweep(actions: dict[str, int]) -> None:
    m = _get()
    if m is None:
        return
    for action, count in actions.items():
        if count:
            m.sweeper_actions.labels(action).inc(count)


@dataclass(frozen=True, slots=True)
class _TickCounts:
    workflow: str
    started: bool
    finished: str | None
    run_seconds: float | None
    closed: tuple[tuple[str, str], ...]  # (step, outcome label)

    @classmethod
    def of(cls, loaded: LoadedRun, payload: TickPayload) -> _TickCounts:
        before, after = loaded.state.status, payload.state.status
        finished = after.value if payload.finished else None
        return cls(
            workflow=loaded.workflow,
            started=before == RunStatus.PENDING and after != RunStatus.PENDING,
            finished=finished,
            run_seconds=_since(loaded.created_at, loaded.now) if finished else None,
            closed=tuple(_closed_steps(payload)),
        )

    def emit(self, m: _Metrics) -> None:
        if self.started:
            m.runs_started.labels(self.workflow).inc()
        if self.finished is not None:
            m.runs_finished.labels(self.workflow, self.finished).inc()
            if self.run_seconds is not None:
                m.run_duration.labels(self.workflow).observe(self.run_seconds)
        for step, outcome in self.closed:
            m.step_attempts.labels(step, outcome).inc()


def _closed_steps(payload: TickPayload) -> Iterable[tuple[str, str]]:
    """The attempts this tick closed itself, as (step name, outcome label)."""
    for closed in payload.closed:
        yield closed.step or "unknown", "lost" if closed.lost else closed.outcome


def _since(start: datetime | None, now: datetime) -> float | None:
    return None if start is None else max(0.0, (now - start).total_seconds())


# -- serving ------------------------------------------------------------------------------------


class MetricsBootstep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Serves ``/metrics`` from the worker's main process when ``ductor_metrics_port`` is set.

    ``__init__`` runs before the pool starts (the Pool step ``requires`` nothing of ours and
    we ask to come first), so the children forked afterwards inherit the directory."""

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.server: Any = None
        self.thread: Any = None
        self.own_dir: str | None = None
        rt = getattr(worker.app, "_ductor_runtime", None)
        self.port = None if rt is None else rt.settings.metrics_port
        self.host = "0.0.0.0" if rt is None else rt.settings.metrics_host
        if self.port is None:
            return
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            self.own_dir = tempfile.mkdtemp(prefix="ductor-metrics-")
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = self.own_dir
        os.environ[_ENABLED_ENV] = "1"  # for a child started anew (spawned)
        global _on
        _on = True

    def start(self, worker: Any) -> None:
        if self.port is None:
            return
        from prometheus_client import CollectorRegistry, start_http_server
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        try:
            self.server, self.thread = start_http_server(self.port, self.host, registry)
        except OSError as exc:
            log.error(
                "ductor metrics: cannot listen on %s:%s (%s); set ductor_metrics_port to a "
                "free port per worker on one host",
                self.host,
                self.port,
                exc,
            )
            return
        log.info("ductor metrics on http://%s:%s/metrics", self.host, self.port)

    def stop(self, worker: Any) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        if self.own_dir is not None:
            shutil.rmtree(self.own_dir, ignore_errors=True)
            self.own_dir = None

    shutdown = stop
