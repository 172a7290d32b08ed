"""The unhappy paths users fear, with real worker processes: kills, crashes, lost messages,
a PostgreSQL restart. The invariant each time: every run finishes, no result applied twice."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from brokers import purge, queue_length

from ductor_celery import RunStatus

pytestmark = pytest.mark.e2e


@pytest.fixture(params=[pytest.param("eager", marks=pytest.mark.broker_core), "coordinator-only"])
def cluster_factory(request: pytest.FixtureRequest, cluster_factory: Any) -> Any:
    """Every fault test runs twice: with eager ticks (step workers tick the run they just
    advanced) and with every tick on the coordinator queue (``ductor_eager_ticks=False``).
    The eager one is in the core run again over RabbitMQ (conftest.py, "broker_core")."""
    eager = "1" if request.param == "eager" else "0"

    def make(**env: str) -> Any:
        return cluster_factory(**{"E2E_EAGER": eager, **env})

    return make


def _wait_for_file(path: Path, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def test_sigkill_of_the_step_worker_mid_step_is_recovered(
    cluster_factory: Any, client_for: Any, tmp_path: Path
) -> None:
    marker = tmp_path / "slow-started"
    # The default 30 s re-send window: the lost claim must be caught by the 3 s step timeout.
    cluster = cluster_factory(E2E_SLOW_MARKER=str(marker), E2E_SLOW_TIMEOUT="3")
    cluster.start_coordinator()
    steps = cluster.start_steps(concurrency=1)
    ductor = client_for(cluster)
    handle = ductor.start("slow", input={"seconds": 60})
    _wait_for_file(marker)
    steps.kill()  # SIGKILL the worker and its pool child mid-step
    cluster.start_steps(concurrency=1, name="steps-again")
    view = ductor.wait(handle.run_id, timeout=25)  # well before the 30 s re-send window
    assert view.status == RunStatus.SUCCEEDED, cluster.logs()
    assert view.output == "slept on attempt 2"
    attempts = cluster.attempts(handle.run_id)
    assert [a.outcome for a in attempts] == ["timed_out", "succeeded"]
    assert cluster.executions(handle.run_id) == 2  # the killed one and its retry, no more


def test_coordinator_killed_between_commit_and_dispatch_loses_nothing(
    cluster_factory: Any, client_for: Any, tmp_path: Path
) -> None:
    fired = tmp_path / "failpoint-fired"
    cluster = cluster_factory()
    cluster.start_steps(concurrency=2)
    doomed = cluster.start_coordinator(
        name="doomed",
        DUCTOR_FAILPOINT="after_commit_before_dispatch",
        DUCTOR_FAILPOINT_MARKER=str(fired),
    )
    ductor = client_for(cluster)
    # Delayed: its first tick is the coordinator's with eager ticks too (a run started now
    # would have it on a step worker; that fault is test_eager_ticks.py's).
    handle = ductor.start("chain10", input={"value": 3}, delay=0.5)
    _wait_for_file(fired)
    # The pool child died right after its commit; the outbox row is all that is left.
    with cluster.engine.connect() as conn:
        unsent = conn.execute(sa.text("SELECT count(*) FROM eec_workflow_outbox")).scalar_one()
    assert unsent >= 1
    doomed.kill()
    cluster.start_coordinator(name="coord-again")
    view = ductor.wait(handle.run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED, cluster.logs()
    assert view.output == 3
    assert cluster.executions(handle.run_id) == 10
    assert all(a.outcome == "succeeded" for a in cluster.attempts(handle.run_id))


def test_coordinator_killed_between_two_sends_of_one_tick_loses_nothing(
    cluster_factory: Any, client_for: Any, tmp_path: Path
) -> None:
    """The fan-out after ``start`` is one tick sending two step messages; the coordinator dies
    after the first (failpoint ``mid_dispatch``). The second is still an outbox row, which the
    next coordinator's sweeper sends; the one sent is not sent twice to any effect."""
    fired = tmp_path / "failpoint-fired"
    cluster = cluster_factory(E2E_EAGER="0")  # the fan-out tick runs on the coordinator
    cluster.start_steps(concurrency=2)
    doomed = cluster.start_coordinator(
        name="doomed", DUCTOR_FAILPOINT="mid_dispatch", DUCTOR_FAILPOINT_MARKER=str(fired)
    )
    ductor = client_for(cluster)
    handle = ductor.start("diamond", input={"x": 1})
    _wait_for_file(fired)
    doomed.kill()
    cluster.start_coordinator(name="coord-again")
    view = ductor.wait(handle.run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED, cluster.logs()
    for node in ("start", "left", "right", "join"):
        assert cluster.executions(handle.run_id, node) == 1, node
    assert view.nodes["extra"].status == "skipped"


def test_a_lost_step_message_is_resent_with_the_same_token(
    cluster_factory: Any, client_for: Any
) -> None:
    cluster = cluster_factory(E2E_RESEND_AFTER="1")
    cluster.start_coordinator()
    ductor = client_for(cluster)
    handle = ductor.start("flaky", input={"fail_times": 0})
    # No step worker yet: wait for the step message, then throw it away (a lost message).
    deadline = time.monotonic() + 15
    while queue_length(cluster.broker_url, "ductor-steps") == 0:
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.05)
    purge(cluster.broker_url, "ductor-steps")
    cluster.start_steps(concurrency=1)
    view = ductor.wait(handle.run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED, cluster.logs()
    attempts = cluster.attempts(handle.run_id)
    assert len(attempts) == 1  # same token, not a retry
    assert cluster.executions(handle.run_id) == 1


def test_a_lost_wakeup_is_replaced_by_the_sweeper(cluster_factory: Any, client_for: Any) -> None:
    cluster = cluster_factory()
    cluster.start_steps(concurrency=1)
    ductor = client_for(cluster)
    handle = ductor.start("chain10", input={"value": 9})
    # No coordinator yet: throw away every wake-up sent so far.
    time.sleep(1.0)
    purge(cluster.broker_url, "ductor-coord")
    cluster.start_coordinator()
    view = ductor.wait(handle.run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED, cluster.logs()
    assert cluster.executions(handle.run_id) == 10


def test_postgresql_restart_with_runs_in_flight_loses_nothing(
    cluster_factory: Any, client_for: Any, pg_server: Any
) -> None:
    cluster = cluster_factory()
    cluster.start_steps(concurrency=2)
    cluster.start_coordinator()
    ductor = client_for(cluster)
    handles = [ductor.start("chain10", input={"value": i}) for i in range(10)]
    time.sleep(0.3)
    pg_server.restart()
    for i, handle in enumerate(handles):
        view = ductor.wait(handle.run_id, timeout=120)
        assert view.status == RunStatus.SUCCEEDED, cluster.logs()
        assert view.output == i
        # Each step's result applied exactly once: one succeeded attempt per node, all folded.
        attempts = cluster.attempts(handle.run_id)
        succeeded = [a for a in attempts if a.outcome == "succeeded"]
        assert sorted(a.node for a in succeeded) == sorted(f"s{k}" for k in range(10))
        assert all(a.folded for a in attempts)
