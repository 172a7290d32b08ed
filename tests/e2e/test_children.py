"""Child runs end to end: sub-workflows, checkpoints, parent-close policies, child scatter."""

from __future__ import annotations

import time
from typing import Any

import pytest

from ductor_celery import NodeStatus, RunStatus

pytestmark = pytest.mark.e2e


@pytest.fixture
def ductor(shared_cluster: Any, client_for: Any) -> Any:
    return client_for(shared_cluster)


def _children(ductor: Any, parent: str) -> list[Any]:
    return [r for r in ductor.list_runs(limit=200) if r.parent_run_id == parent]


def _until(predicate: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not reached in time")


def test_parent_proceeds_at_the_checkpoint_while_the_child_keeps_running(ductor: Any) -> None:
    parent = ductor.start("e2e_until_checkpoint", input={"id": 7})
    view = ductor.wait(parent.run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED, view.error
    # the node's output is the child's context at the checkpoint
    assert view.output == {"collected": ["label"]}
    assert view.nodes["child"].output == {"collected": ["label"]}
    (child,) = _children(ductor, parent.run_id)
    assert child.workflow_id == f"{parent.workflow_id}/child"
    assert ductor.get(child.run_id).status == RunStatus.RUNNING, "the child keeps running"
    assert ductor.get(child.run_id).nodes["go"].status == NodeStatus.WAITING
    ductor.signal(child.workflow_id, "go", {"ok": 1})
    done = ductor.wait(child.run_id, timeout=60)
    assert done.status == RunStatus.SUCCEEDED
    assert done.output == {"label": 7, "go": {"ok": 1}}


def test_subworkflow_waits_for_the_child_and_takes_its_output(ductor: Any) -> None:
    parent = ductor.start("e2e_parent_terminate", input={"id": 3})
    child = _until(lambda: _children(ductor, parent.run_id))[0]
    _until(lambda: ductor.get(child.run_id).nodes["go"].status == NodeStatus.WAITING)
    assert ductor.get(parent.run_id).nodes["child"].status == NodeStatus.WAITING
    ductor.signal(child.run_id, "go", "now")
    view = ductor.wait(parent.run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED, view.error
    assert view.output == {"label": 3, "go": "now"}


@pytest.mark.parametrize(
    ("policy", "child_status"),
    [
        ("terminate", RunStatus.TERMINATED),
        ("cancel", RunStatus.CANCELLED),
        ("abandon", RunStatus.RUNNING),
    ],
)
def test_cancelling_the_parent_applies_the_parent_close_policy(
    ductor: Any, policy: str, child_status: RunStatus
) -> None:
    parent = ductor.start(f"e2e_parent_{policy}", input={"id": 1})
    child = _until(lambda: _children(ductor, parent.run_id))[0]
    _until(lambda: ductor.get(child.run_id).nodes["go"].status == NodeStatus.WAITING)
    ductor.cancel(parent.run_id, reason="customer left")
    view = ductor.wait(parent.run_id, timeout=30)
    assert view.status == RunStatus.CANCELLED
    assert view.nodes["child"].status == NodeStatus.CANCELLED
    if child_status == RunStatus.RUNNING:
        time.sleep(1.0)
        assert ductor.get(child.run_id).status == RunStatus.RUNNING
        ductor.terminate(child.run_id)  # tidy up the abandoned child
    else:
        assert ductor.wait(child.run_id, timeout=30).status == child_status


def _past_the_checkpoint(ductor: Any, policy: str, **start: Any) -> tuple[Any, Any]:
    """A parent whose child passed its checkpoint (the node succeeded), the child waiting for
    "go" and the parent for "hold"."""
    parent = ductor.start(f"e2e_cp_parent_{policy}", input={"id": 1}, **start)
    child = _until(lambda: _children(ductor, parent.run_id))[0]
    _until(lambda: ductor.get(parent.run_id).nodes["child"].status == NodeStatus.SUCCEEDED)
    _until(lambda: ductor.get(child.run_id).nodes["go"].status == NodeStatus.WAITING)
    assert ductor.get(parent.run_id).status == RunStatus.RUNNING
    return parent, child


@pytest.mark.parametrize(
    ("policy", "control", "child_status"),
    [
        ("terminate", "terminate", RunStatus.TERMINATED),
        ("cancel", "terminate", RunStatus.CANCELLED),
        ("terminate", "cancel", RunStatus.TERMINATED),
        ("abandon", "terminate", RunStatus.RUNNING),
    ],
)
def test_stopping_the_parent_applies_the_policy_to_a_child_past_its_checkpoint(
    ductor: Any, policy: str, control: str, child_status: RunStatus
) -> None:
    parent, child = _past_the_checkpoint(ductor, policy)
    getattr(ductor, control)(parent.run_id, reason="stop")
    view = ductor.wait(parent.run_id, timeout=30)
    assert view.status in (RunStatus.TERMINATED, RunStatus.CANCELLED)
    assert view.nodes["child"].status == NodeStatus.SUCCEEDED
    if child_status == RunStatus.RUNNING:
        time.sleep(1.0)
        assert ductor.get(child.run_id).status == RunStatus.RUNNING
        ductor.terminate(child.run_id)  # tidy up the abandoned child
    else:
        assert ductor.wait(child.run_id, timeout=30).status == child_status


def test_a_parent_timing_out_terminates_its_child_past_its_checkpoint(ductor: Any) -> None:
    parent, child = _past_the_checkpoint(ductor, "terminate", deadline=5)
    assert ductor.wait(parent.run_id, timeout=30).status == RunStatus.TIMED_OUT
    assert ductor.wait(child.run_id, timeout=30).status == RunStatus.TERMINATED


def test_a_parent_that_succeeds_leaves_its_child_past_its_checkpoint_running(ductor: Any) -> None:
    parent, child = _past_the_checkpoint(ductor, "terminate")
    ductor.signal(parent.run_id, "hold")
    assert ductor.wait(parent.run_id, timeout=30).status == RunStatus.SUCCEEDED
    time.sleep(1.0)
    assert ductor.get(child.run_id).status == RunStatus.RUNNING
    ductor.signal(child.run_id, "go", "now")
    assert ductor.wait(child.run_id, timeout=30).status == RunStatus.SUCCEEDED


def test_child_run_scatter_gathers_child_outputs_with_tolerated_failures(ductor: Any) -> None:
    groups = [[1, 2], [3], [4, 5, 6], [], [7]]
    parent = ductor.start("e2e_child_scatter", input={"groups": groups, "refuse": [3]})
    view = ductor.wait(parent.run_id, timeout=90)
    assert view.status == RunStatus.SUCCEEDED, view.error
    out = view.output
    assert out[0] == [1, 4] and out[2] == [16, 25, 36] and out[3] == [] and out[4] == [49]
    assert out[1]["error"]["type"] == "ChildRunFailed"
    kids = _children(ductor, parent.run_id)
    assert len(kids) == 5
    assert {k.workflow_id for k in kids} == {f"{parent.workflow_id}/kids[{i}]" for i in range(5)}


def test_one_child_failure_too_many_fails_the_child_scatter(ductor: Any) -> None:
    parent = ductor.start(
        "e2e_child_scatter", input={"groups": [[1], [2], [3], [4]], "refuse": [1, 2]}
    )
    view = ductor.wait(parent.run_id, timeout=90)
    assert view.status == RunStatus.FAILED
    assert view.nodes["kids"].error["type"] == "BranchFailed"
    # children still open when the scatter failed were closed by the default policy
    for kid in _children(ductor, parent.run_id):
        assert ductor.wait(kid.run_id, timeout=30).status in (
            RunStatus.FAILED,
            RunStatus.TERMINATED,
            RunStatus.SUCCEEDED,
        )
