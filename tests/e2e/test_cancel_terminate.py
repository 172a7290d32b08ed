"""Issue 14 items 2 and 5 with real workers (prefork pool, Redis): a cancel reaches a long
step through its heartbeat and it stops on its own, well inside the grace; terminate kills a
step that never looks (revoke with terminate=True); a run deadline does the same."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from ductor_celery import NodeStatus, RunStatus

pytestmark = pytest.mark.e2e


@pytest.fixture
def ductor(shared_cluster: Any, client_for: Any) -> Any:
    return client_for(shared_cluster)


def _until(check: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout}s")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _attempt(cluster: Any, token: str) -> Any:
    with cluster.engine.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT outcome, error, claimed_at, cancel_requested_at "
                "FROM eec_workflow_step_attempt WHERE token = :t"
            ),
            {"t": token},
        ).one_or_none()


def test_cancel_asks_a_long_step_to_stop_and_it_stops_through_its_heartbeat(
    ductor: Any, shared_cluster: Any
) -> None:
    handle = ductor.start("cancellable", input={"seconds": 60})
    token = f"{handle.run_id}:work:1"
    _until(lambda: (row := _attempt(shared_cluster, token)) and row.claimed_at, what="claim")
    asked = time.monotonic()
    ductor.cancel(handle.run_id, reason="not needed any more")
    view = ductor.wait(handle.run_id, timeout=30)
    # It stopped on its own (ductor_cancel_grace is 30 s): the heartbeat raised StepCancelled.
    assert time.monotonic() - asked < 20
    assert view.status == RunStatus.CANCELLED
    assert view.nodes["work"].status == NodeStatus.CANCELLED
    assert view.nodes["work"].attempts == 1
    assert view.nodes["after"].status == NodeStatus.PENDING
    row = _attempt(shared_cluster, token)
    assert row.cancel_requested_at is not None
    assert row.outcome == "cancelled" and row.error["type"] == "StepCancelled"
    assert shared_cluster.executions(handle.run_id) == 1  # never retried


def test_terminate_kills_a_long_step_that_never_looks(
    ductor: Any, shared_cluster: Any, tmp_path: Path
) -> None:
    marker = tmp_path / "stubborn.pid"
    handle = ductor.start("killable", input={"seconds": 60, "marker": str(marker)})
    pid = int(_until(lambda: marker.exists() and marker.read_text(), what="step start"))
    assert _alive(pid)
    ductor.terminate(handle.run_id, reason="stop now")
    view = ductor.wait(handle.run_id, timeout=30)
    assert view.status == RunStatus.TERMINATED
    assert view.nodes["work"].status == NodeStatus.CANCELLED
    # revoke(terminate=True): the pool process running it is killed (and replaced).
    _until(lambda: not _alive(pid), timeout=20, what="kill of the step's process")
    assert not Path(f"{marker}.done").exists()
    row = _attempt(shared_cluster, f"{handle.run_id}:work:1")
    assert row.outcome == "cancelled" and row.error["type"] == "Cancelled"


def test_a_run_deadline_times_the_run_out_and_kills_its_step(
    ductor: Any, shared_cluster: Any, tmp_path: Path
) -> None:
    marker = tmp_path / "deadline.pid"
    handle = ductor.start("killable", input={"seconds": 60, "marker": str(marker)}, deadline=3)
    pid = int(_until(lambda: marker.exists() and marker.read_text(), what="step start"))
    view = ductor.wait(handle.run_id, timeout=30)
    assert view.status == RunStatus.TIMED_OUT
    assert view.deadline_at is not None and view.finished_at is not None
    assert view.finished_at >= view.deadline_at
    assert view.error["type"] == "RunTimeout"
    _until(lambda: not _alive(pid), timeout=20, what="kill of the step's process")
    assert not Path(f"{marker}.done").exists()
