"""The console's ``/metrics``: gauges read from the database at each scrape.

A registry of its own (never prometheus_client's global one), so these gauges never collide
with the worker metrics a process may also export.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.engine import Engine

from ..store import console


class DatabaseGauges(Collector):
    def __init__(self, engine: Callable[[], Engine]) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self._engine()
        runs = GaugeMetricFamily(
            "ductor_runs", "Open runs (pending, running, paused)", labels=["workflow", "status"]
        )
        for workflow, status, count in console.open_runs_by_workflow(engine):
            runs.add_metric([workflow, status], count)
        yield runs
        yield GaugeMetricFamily(
            "ductor_outbox_backlog",
            "Dispatch intents committed and not yet sent",
            value=console.outbox_backlog(engine),
        )
        waiters = GaugeMetricFamily(
            "ductor_lease_waiters",
            "Attempts waiting for a concurrency slot",
            labels=["step"],
        )
        for step, count in sorted(console.lease_waiters(engine).items()):
            waiters.add_metric([step], count)
        yield waiters


def registry_for(engine: Callable[[], Engine]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseGauges(engine))
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
