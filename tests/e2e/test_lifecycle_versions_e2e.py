"""Issue 14 items 6-8 with real workers: pause on exhaustion, fix the code, deploy, resume;
rerun from a node; versions with runs in flight."""

from __future__ import annotations

import time
from typing import Any

import pytest

from ductor_celery import NodeStatus, RunStatus

pytestmark = pytest.mark.e2e


def _wait_status(ductor: Any, run_id: str, status: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        view = ductor.get(run_id)
        if view.status == status:
            return view
        assert time.monotonic() < deadline, f"run is {view.status}, not {status}"
        time.sleep(0.1)


def test_a_bug_pauses_the_run_then_the_fixed_deploy_resumes_it(
    cluster_factory: Any, client_for: Any
) -> None:
    cluster = cluster_factory()
    buggy = cluster.start_steps(E2E_BUG="1")
    cluster.start_coordinator()
    ductor = client_for(cluster)
    handle = ductor.start("deployable", input={"value": 41})
    view = _wait_status(ductor, handle.run_id, RunStatus.PAUSED)
    fix = view.nodes["fix"]
    assert fix.status == NodeStatus.FAILED and fix.attempts == 2
    assert fix.error is not None and "off by one" in fix.error["message"]
    assert view.nodes["c"].status == NodeStatus.PENDING
    assert cluster.executions(handle.run_id, "fix") == 2

    buggy.stop()  # deploy the fix: a new worker without the bug
    cluster.start_steps(name="fixed")
    ductor.resume(handle.run_id)
    done = ductor.wait(handle.run_id, timeout=30)
    assert done.status == RunStatus.SUCCEEDED and done.output == 42
    assert done.nodes["fix"].attempts == 3
    assert cluster.executions(handle.run_id, "a") == 1  # upstream did not run again


def test_rerun_from_a_node_of_a_succeeded_run(shared_cluster: Any, client_for: Any) -> None:
    ductor = client_for(shared_cluster)
    handle = ductor.start("deployable", input={"value": 1})
    assert ductor.wait(handle.run_id, timeout=30).output == 2
    ductor.redrive(handle.run_id, from_node="fix")
    again = ductor.wait(handle.run_id, timeout=30)
    assert again.status == RunStatus.SUCCEEDED and again.output == 2
    assert shared_cluster.executions(handle.run_id, "a") == 1
    assert shared_cluster.executions(handle.run_id, "fix") == 2
    ductor.redrive(handle.workflow_id, from_node="a", input={"value": 10})
    third = ductor.wait(handle.run_id, timeout=30)
    assert third.status == RunStatus.SUCCEEDED and third.output == 11
    assert third.input == {"value": 10}
    assert shared_cluster.executions(handle.run_id, "a") == 2


def _parked(ductor: Any, run_id: str) -> None:
    deadline = time.monotonic() + 30
    while ductor.get(run_id).nodes["hold"].status != NodeStatus.WAITING:
        assert time.monotonic() < deadline, ductor.get(run_id)
        time.sleep(0.1)


def test_runs_in_flight_keep_their_version_across_a_deploy(
    cluster_factory: Any, client_for: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = cluster_factory()
    old_steps = cluster.start_steps()
    old_coord = cluster.start_coordinator()
    old = client_for(cluster)
    in_flight = old.start("versioned")
    _parked(old, in_flight.run_id)

    # The deploy: new workers with version 2 only, the old ones stopped.
    old_steps.stop()
    old_coord.stop()
    cluster.start_steps(name="steps_v2", E2E_VERSIONED="2")
    cluster.start_coordinator(name="coord_v2", E2E_VERSIONED="2")
    monkeypatch.setenv("E2E_VERSIONED", "2")
    new = client_for(cluster)
    fresh = new.start("versioned")
    pinned = new.start("versioned", version=1)  # stored when the old deploy started one
    moved = new.start("versioned", version=1)
    for handle in (fresh, pinned, moved):
        _parked(new, handle.run_id)
    new.continue_as_new(moved.run_id, version="latest")
    deadline = time.monotonic() + 30
    while (view := new.get(moved.run_id)).status != RunStatus.CONTINUED:
        assert time.monotonic() < deadline, view
        time.sleep(0.1)
    for handle in (in_flight, fresh, pinned, moved):
        new.signal(handle.workflow_id, "go")
    done = {
        name: new.wait(h.workflow_id, timeout=30)
        for name, h in (("in_flight", in_flight), ("fresh", fresh), ("pinned", pinned))
    }
    done["moved"] = new.wait(moved.workflow_id, timeout=30)
    assert {k: v.status for k, v in done.items()} == dict.fromkeys(done, RunStatus.SUCCEEDED)
    assert {k: v.version for k, v in done.items()} == {
        "in_flight": 1,
        "fresh": 2,
        "pinned": 1,
        "moved": 2,
    }
    assert done["in_flight"].output == {"version": 1} and "c" not in done["in_flight"].nodes
    assert done["fresh"].output == {"version": 2}
    assert done["moved"].output == {"version": 2} and done["moved"].continued_from
    assert cluster.executions(done["moved"].run_id, "a") == 0  # carried, not run again
