"""Scatter/gather end to end, with real workers: in-flight bound, item order, failure policies."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa

from ductor_celery import NodeStatus, RunStatus

pytestmark = [pytest.mark.e2e, pytest.mark.broker_core]


@pytest.fixture
def ductor(shared_cluster: Any, client_for: Any) -> Any:
    return client_for(shared_cluster)


def _branch_rows(cluster: Any, run_id: str) -> list[Any]:
    with cluster.engine.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT branch, created_at, finished_at, outcome FROM eec_workflow_step_attempt "
                "WHERE run_id = :r AND node = 'squares' ORDER BY created_at"
            ),
            {"r": run_id},
        ).all()


class _OpenWatcher(threading.Thread):
    """Polls the committed number of open (unfinished) branch attempts while a run goes on."""

    def __init__(self, cluster: Any, run_id: str) -> None:
        super().__init__(daemon=True)
        self.cluster, self.run_id = cluster, run_id
        self.peak = self.samples = 0
        self.done = threading.Event()

    def run(self) -> None:
        with self.cluster.engine.connect() as conn:
            while not self.done.is_set():
                count = conn.execute(
                    sa.text(
                        "SELECT count(*) FROM eec_workflow_step_attempt WHERE run_id = :r "
                        "AND node = 'squares' AND finished_at IS NULL"
                    ),
                    {"r": self.run_id},
                ).scalar_one()
                conn.rollback()
                self.peak = max(self.peak, int(count))
                self.samples += 1
                time.sleep(0.002)


def test_200_items_with_max_parallel_10_gather_in_order(ductor: Any, shared_cluster: Any) -> None:
    items = list(range(200))
    handle = ductor.start("scatter", input={"items": items})
    watcher = _OpenWatcher(shared_cluster, handle.run_id)
    watcher.start()
    view = ductor.wait(handle.run_id, timeout=120)
    watcher.done.set()
    watcher.join()
    assert view.status == RunStatus.SUCCEEDED, view.error
    assert view.output["squares"] == [i * i for i in items]
    assert view.output["total"] == sum(i * i for i in items)
    assert view.nodes["squares"].output == [i * i for i in items]
    rows = _branch_rows(shared_cluster, handle.run_id)
    assert sorted(r.branch for r in rows) == items, "each branch ran exactly once"
    assert watcher.samples > 50
    assert 2 <= watcher.peak <= 10
    assert shared_cluster.executions(handle.run_id, "squares") == 200


def test_an_empty_list_gives_an_empty_list(ductor: Any) -> None:
    view = ductor.wait(ductor.start("scatter", input={"items": []}).run_id, timeout=30)
    assert view.status == RunStatus.SUCCEEDED
    assert view.output == {"squares": [], "total": 0}


def test_fail_fast_fails_the_run_and_closes_every_branch(ductor: Any, shared_cluster: Any) -> None:
    handle = ductor.start("scatter", input={"items": list(range(60)), "refuse": [12]})
    view = ductor.wait(handle.run_id, timeout=60)
    assert view.status == RunStatus.FAILED
    assert view.nodes["squares"].status == NodeStatus.FAILED
    assert view.error["node"] == "squares"
    assert "item 12 refused" in view.error["message"]
    assert view.nodes["total"].status == NodeStatus.PENDING
    rows = _branch_rows(shared_cluster, handle.run_id)
    assert all(r.finished_at is not None for r in rows), "no attempt left open"
    # Dispatching stops once a tick folds the failure. How many rows exist by then says
    # little: with inline steps both workers may run branch after branch in their own chains
    # while branch 12's message waits in the queue, so it can fail late. What must hold:
    # nothing is dispatched after it failed, but by the one tick that held the run's lock
    # while its outcome committed (that tick loaded before it: at most max_parallel=10).
    [failed] = [r for r in rows if r.branch == 12]
    later = [r.branch for r in rows if r.created_at > failed.finished_at]
    assert len(later) <= 10, f"branches {later} were dispatched after branch 12 failed"


@pytest.mark.parametrize("workflow", ["scatter_tolerant", "scatter_ratio"])
def test_tolerated_failures_leave_errors_in_their_places(ductor: Any, workflow: str) -> None:
    items = list(range(20))
    view = ductor.wait(
        ductor.start(workflow, input={"items": items, "refuse": [3, 17]}).run_id, timeout=60
    )
    assert view.status == RunStatus.SUCCEEDED, view.error
    squares = view.output["squares"]
    for i in items:
        if i in (3, 17):
            assert squares[i]["error"]["message"] == f"item {i} refused"
            assert squares[i]["error"]["type"] == "NonRetryableError"
        else:
            assert squares[i] == i * i
    assert view.output["total"] == sum(i * i for i in items if i not in (3, 17))


def test_one_failure_too_many_fails_the_tolerant_scatter(ductor: Any) -> None:
    view = ductor.wait(
        ductor.start(
            "scatter_tolerant", input={"items": list(range(20)), "refuse": [1, 2, 3]}
        ).run_id,
        timeout=60,
    )
    assert view.status == RunStatus.FAILED
    assert view.nodes["squares"].error["type"] == "BranchFailed"
