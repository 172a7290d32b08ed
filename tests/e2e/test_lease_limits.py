"""Concurrency leases end to end: real ``celery worker`` processes, many runs on one key.

The limited step (tests/lease_app.py) writes when it enters and leaves into ``lease_log`` with
the database clock; the tests compute from those intervals how many executions of one key
overlapped, and a watcher samples the lease table while the runs go on. The limit is 2; the
workers have more processes than that, so only the leases hold them back.
"""

from __future__ import annotations

import importlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from ductor_celery import RunStatus

pytestmark = pytest.mark.e2e

LIMIT = 2


@pytest.fixture
def lease_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """lease_app's Ductor in this process, pointed at a cluster's database and broker."""

    def make(cluster: Any) -> Any:
        monkeypatch.setenv("DUCTOR_DATABASE_URL", cluster.database_url)
        monkeypatch.setenv("E2E_BROKER_URL", cluster.broker_url)
        for name, value in cluster.env.items():
            if name.startswith("LEASE_"):  # the same definitions as the workers (timeouts)
                monkeypatch.setenv(name, value)
        sys.modules.pop("lease_app", None)
        module = importlib.import_module("lease_app")
        with cluster.engine.begin() as conn:
            conn.execute(sa.text(module.LOG_DDL))
        return module.ductor

    yield make
    sys.modules.pop("lease_app", None)


class _LeaseWatcher(threading.Thread):
    """Samples the committed lease rows per key while the runs go on."""

    def __init__(self, engine: Any) -> None:
        super().__init__(daemon=True)
        self.engine = engine
        self.peak: dict[str, int] = {}
        self.samples = 0
        self.done = threading.Event()

    def run(self) -> None:
        with self.engine.connect() as conn:
            while not self.done.is_set():
                for key, count in conn.execute(
                    sa.text("SELECT key, count(*) FROM eec_concurrency_lease GROUP BY key")
                ):
                    self.peak[key] = max(self.peak.get(key, 0), int(count))
                conn.rollback()
                self.samples += 1
                time.sleep(0.005)

    def stop(self) -> dict[str, int]:
        self.done.set()
        self.join(5)
        assert self.samples > 10
        return self.peak


def _log(cluster: Any) -> list[Any]:
    with cluster.engine.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT run_id, attempt, customer, entered_at, exited_at FROM lease_log "
                "ORDER BY entered_at"
            )
        ).all()


def _peak_overlap(rows: list[Any]) -> dict[str, int]:
    """Per customer: the most executions inside the step at one moment. An exit and an
    entry at the same instant do not overlap."""
    events: dict[str, list[tuple[Any, int]]] = {}
    for r in rows:
        assert r.exited_at is not None, r
        events.setdefault(r.customer, []).extend([(r.entered_at, 1), (r.exited_at, -1)])
    peaks = {}
    for customer, evs in events.items():
        now = peak = 0
        for _, delta in sorted(evs, key=lambda e: (e[0], e[1])):
            now += delta
            peak = max(peak, now)
        peaks[customer] = peak
    return peaks


def _handoffs(rows: list[Any], customer: str) -> list[float]:
    """Seconds from each exit to the next entry of the same key while others wait: how long
    a freed slot stays unused (release, grant, message, claim)."""
    mine = [r for r in rows if r.customer == customer]
    gaps = []
    for r in mine:
        later = [x.entered_at for x in mine if x.entered_at >= r.exited_at]
        if later:
            gaps.append((min(later) - r.exited_at).total_seconds())
    return gaps


def _lease_rows(cluster: Any) -> int:
    with cluster.engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM eec_concurrency_lease")).scalar_one())


def test_many_runs_on_one_key_never_run_more_than_the_limit_at_once(
    cluster_factory: Any, lease_client: Any
) -> None:
    cluster = cluster_factory(app="lease_app")
    ductor = lease_client(cluster)
    cluster.start_coordinator()
    cluster.start_steps(concurrency=3, name="steps-a")  # six step processes in two workers
    cluster.start_steps(concurrency=3, name="steps-b")
    watcher = _LeaseWatcher(cluster.engine)
    watcher.start()
    started = time.monotonic()
    handles = [
        ductor.start("limited", input={"customer": "acme", "seconds": 0.5}) for _ in range(12)
    ] + [ductor.start("limited", input={"customer": "globex", "seconds": 0.5}) for _ in range(4)]
    for handle in handles:
        view = ductor.wait(handle.run_id, timeout=50)
        assert view.status == RunStatus.SUCCEEDED, cluster.logs()
    elapsed = time.monotonic() - started
    sampled = watcher.stop()

    rows = _log(cluster)
    assert len(rows) == 16  # each run's step ran exactly once
    assert sorted({r.run_id for r in rows}) == sorted(h.run_id for h in handles)
    peaks = _peak_overlap(rows)
    assert peaks["acme"] == LIMIT, peaks  # reached, never exceeded
    assert peaks["globex"] <= LIMIT, peaks
    assert max(sampled.values()) <= LIMIT, sampled
    assert _lease_rows(cluster) == 0
    # Twelve half-second steps two at a time take three seconds at the least.
    assert elapsed >= 12 * 0.5 / LIMIT
    gaps = sorted(_handoffs(rows, "acme"))
    print(  # noqa: T201
        f"\n16 runs, limit {LIMIT}: {elapsed:.1f}s; overlap {peaks}; slot handoff "
        f"median {gaps[len(gaps) // 2] * 1000:.0f} ms, max {gaps[-1] * 1000:.0f} ms"
    )


def _wait_running(cluster: Any, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with cluster.engine.connect() as conn:
            inside = conn.execute(
                sa.text("SELECT count(*) FROM lease_log WHERE exited_at IS NULL")
            ).scalar_one()
        if inside >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"never {count} steps running at once:\n{cluster.logs()}")


def test_a_step_worker_killed_while_holding_leases_leaks_none(
    cluster_factory: Any, lease_client: Any
) -> None:
    # A 3 s step timeout: the killed holders are declared lost 3 s after their claims, which
    # frees their slots; the default 30 s re-send window plays no part.
    cluster = cluster_factory(app="lease_app", LEASE_STEP_TIMEOUT="3")
    ductor = lease_client(cluster)
    cluster.start_coordinator()
    steps = cluster.start_steps(concurrency=4)
    watcher = _LeaseWatcher(cluster.engine)
    watcher.start()
    started = time.monotonic()
    handles = [
        ductor.start("limited", input={"customer": "acme", "seconds": 1.5}) for _ in range(8)
    ]
    _wait_running(cluster, LIMIT)  # both slots held, both holders inside the step
    steps.kill()  # SIGKILL the worker and its pool children mid-step
    with cluster.engine.begin() as conn:
        # The killed executions ended at the kill at the latest (taken after it: conservative).
        killed = (
            conn.execute(
                sa.text(
                    "UPDATE lease_log SET exited_at = clock_timestamp() WHERE exited_at IS NULL "
                    "RETURNING run_id"
                )
            )
            .scalars()
            .all()
        )
        held = conn.execute(sa.text("SELECT count(*) FROM eec_concurrency_lease")).scalar_one()
    assert len(killed) == LIMIT
    assert held == LIMIT  # the dead holders still hold: only their end may free the slots
    cluster.start_steps(concurrency=4, name="steps-again")
    for handle in handles:
        view = ductor.wait(handle.run_id, timeout=45)
        assert view.status == RunStatus.SUCCEEDED, cluster.logs()
    elapsed = time.monotonic() - started
    sampled = watcher.stop()
    assert _lease_rows(cluster) == 0  # no leaked lease
    peaks = _peak_overlap(_log(cluster))
    assert peaks["acme"] <= LIMIT, peaks
    assert max(sampled.values()) <= LIMIT, sampled
    with cluster.engine.connect() as conn:
        outcomes = conn.execute(
            sa.text(
                "SELECT run_id, outcome FROM eec_workflow_step_attempt ORDER BY run_id, attempt"
            )
        ).all()
    timed_out = sorted(r.run_id for r in outcomes if r.outcome == "timed_out")
    assert timed_out == sorted(killed)  # exactly the killed holders, each retried once
    assert sum(r.outcome == "succeeded" for r in outcomes) == len(handles)
    for run_id in killed:
        assert ductor.get(run_id).output == {"customer": "acme", "attempt": 2}
    print(f"\nkill with {LIMIT} leases held, 8 runs: {elapsed:.1f}s; overlap {peaks}")  # noqa: T201
