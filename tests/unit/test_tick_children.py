"""Child runs in the pure tick: deterministic ids, waiting, checkpoints, parent-close."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from support import FakeStep, literal_of

from ductor_celery.definition import Workflow
from ductor_celery.engine import RunState, RunStatus, TickInputs, compute_tick
from ductor_celery.engine.children import child_run_id
from ductor_celery.engine.inputs import ChildSnapshot, ControlIn
from ductor_celery.errors import DefinitionError

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _child() -> Any:
    wf = Workflow("child")
    wf.step("a", FakeStep())
    wf.checkpoint("printed", after=["a"])
    return wf.build()


def _parent(policy: str = "terminate", until: str | None = None) -> Any:
    child = _child()
    wf = Workflow("parent")
    wf.subworkflow(
        "sub", workflow="child", input={"id": "$.input.id"}, until=until, parent_close=policy
    )
    wf.output("$.nodes.sub.output")
    return wf.build(None, {"child": child}.get)


def _tick(spec: Any, state: RunState, **inputs: Any) -> Any:
    return compute_tick(spec, state, TickInputs(run_id="p", input={"id": 7}, **inputs), T0)


def test_starting_a_child_is_deterministic_and_pins_its_definition() -> None:
    spec = _parent()
    first, again = _tick(spec, RunState()), _tick(spec, RunState())
    (start,) = first.child_starts
    assert start == again.child_starts[0], "a recomputed tick names the same child"
    assert start.run_id == child_run_id("p", "sub", None, 1)
    assert start.spec_hash == _child().spec_hash
    assert start.input == {"id": 7}
    assert start.workflow_id_suffix == "/sub"
    assert first.state.nodes["sub"].status == "waiting"
    assert first.state.nodes["sub"].child.child_run == start.run_id


def test_the_child_output_becomes_the_node_output() -> None:
    spec = _parent()
    s0 = _tick(spec, RunState()).state
    child = s0.nodes["sub"].child.child_run
    running = _tick(spec, s0, children={child: ChildSnapshot(child, "running")})
    assert not running.changed
    done = _tick(spec, s0, children={child: ChildSnapshot(child, "succeeded", output={"x": 1})})
    assert done.state.status == RunStatus.SUCCEEDED
    assert done.output == {"x": 1}


@pytest.mark.parametrize("status", ["failed", "cancelled", "terminated", "missing"])
def test_a_child_that_does_not_succeed_fails_the_node(status: str) -> None:
    spec = _parent()
    s0 = _tick(spec, RunState()).state
    child = s0.nodes["sub"].child.child_run
    snap = ChildSnapshot(child, status, error={"message": "boom"} if status == "failed" else None)
    p = _tick(spec, s0, children={child: snap})
    assert p.state.status == RunStatus.FAILED
    error = p.state.nodes["sub"].error
    assert error["type"] == "ChildRunFailed" and error["child_run_id"] == child
    if status == "missing":
        assert "could not be started" in error["message"]
    elif status == "failed":
        assert error["message"].endswith("failed: boom")


def test_until_a_checkpoint_takes_the_context_there() -> None:
    spec = _parent(until="printed")
    s0 = _tick(spec, RunState()).state
    child = s0.nodes["sub"].child.child_run
    snap = ChildSnapshot(child, "running", checkpoints={"printed": {"label": "L7"}})
    p = _tick(spec, s0, children={child: snap})
    assert p.state.status == RunStatus.SUCCEEDED
    assert p.output == {"label": "L7"}
    # a child that finished without passing the checkpoint fails the wait
    p2 = _tick(spec, s0, children={child: ChildSnapshot(child, "succeeded")})
    assert "without reaching checkpoint 'printed'" in p2.state.nodes["sub"].error["message"]


def test_a_checkpoint_node_snapshots_the_context_and_flags_the_commit() -> None:
    spec = _child()
    s0 = _tick(spec, RunState()).state
    from ductor_celery.engine import AttemptResult

    done = AttemptResult(
        token="p:a:1", node="a", outcome="succeeded", output=1, patch={"label": "L7"}
    )
    p = _tick(spec, s0, results=(done,))
    assert p.checkpoint_reached
    assert literal_of(p.state.nodes["printed"]) == {"label": "L7"}
    assert p.state.nodes["printed"].status == "succeeded"


@pytest.mark.parametrize(
    ("policy", "kind"), [("terminate", "terminate"), ("cancel", "cancel"), ("abandon", None)]
)
def test_closing_the_parent_applies_the_policy(policy: str, kind: str | None) -> None:
    spec = _parent(policy)
    s0 = _tick(spec, RunState()).state
    child = s0.nodes["sub"].child.child_run
    p = _tick(spec, s0, control=ControlIn(id=1, kind="cancel", reason="bye"))
    assert p.state.status == RunStatus.CANCELLED
    assert p.state.nodes["sub"].status == "cancelled"
    assert [(c.run_id, c.kind) for c in p.child_controls] == ([(child, kind)] if kind else [])


def test_a_child_that_finished_already_gets_no_control() -> None:
    spec = _parent()
    s0 = _tick(spec, RunState()).state
    child = s0.nodes["sub"].child.child_run
    p = _tick(
        spec,
        s0,
        control=ControlIn(id=1, kind="terminate"),
        children={child: ChildSnapshot(child, "failed")},
    )
    assert p.child_controls == []


def _holding_parent(policy: str = "terminate", *, fails: bool = False) -> Any:
    """A parent that goes on after its child's checkpoint and stays open: it waits for a
    signal (or, ``fails``, runs a step that will fail)."""
    child = _child()
    wf = Workflow("parent")
    wf.subworkflow(
        "sub", workflow="child", input={"id": "$.input.id"}, until="printed", parent_close=policy
    )
    if fails:
        wf.step("after", FakeStep(), after=["sub"])
    else:
        wf.wait_signal("hold", signal="hold", after=["sub"])
    return wf.build(None, {"child": child}.get)


def _past_checkpoint(spec: Any) -> tuple[RunState, str]:
    """The parent with its child past the checkpoint: the sub node succeeded, the child runs."""
    s0 = _tick(spec, RunState()).state
    child = s0.nodes["sub"].child.child_run
    snap = ChildSnapshot(child, "running", checkpoints={"printed": {"label": "L7"}})
    p = _tick(spec, s0, children={child: snap})
    assert p.state.nodes["sub"].status == "succeeded"
    assert p.state.status == RunStatus.RUNNING and p.child_controls == []
    return p.state, child


@pytest.mark.parametrize("control", ["terminate", "cancel"])
@pytest.mark.parametrize(
    ("policy", "kind"), [("terminate", "terminate"), ("cancel", "cancel"), ("abandon", None)]
)
def test_stopping_the_parent_closes_a_child_past_its_checkpoint(
    control: str, policy: str, kind: str | None
) -> None:
    spec = _holding_parent(policy)
    state, child = _past_checkpoint(spec)
    p = _tick(
        spec,
        state,
        control=ControlIn(id=1, kind=control, reason="bye"),
        children={child: ChildSnapshot(child, "paused")},
    )
    assert p.state.status == (
        RunStatus.TERMINATED if control == "terminate" else RunStatus.CANCELLED
    )
    assert p.state.nodes["sub"].status == "succeeded"  # the node keeps what it got
    assert [(c.run_id, c.kind) for c in p.child_controls] == ([(child, kind)] if kind else [])
    assert all("parent run p" in c.reason for c in p.child_controls)


def test_a_parent_timing_out_closes_a_child_past_its_checkpoint() -> None:
    spec = _holding_parent()
    state, child = _past_checkpoint(spec)
    state.deadline_at = T0
    p = _tick(spec, state, children={child: ChildSnapshot(child, "running")})
    assert p.state.status == RunStatus.TIMED_OUT
    assert [(c.run_id, c.kind) for c in p.child_controls] == [(child, "terminate")]


def test_a_cooperative_cancel_closes_a_child_past_its_checkpoint_when_it_settles() -> None:
    """The cancel waits for an attempt in flight; the child is closed with the run."""
    spec = _holding_parent(fails=True)
    state, child = _past_checkpoint(spec)
    assert state.nodes["after"].status == "running"
    asked = _tick(spec, state, control=ControlIn(id=1, kind="cancel"), children={})
    assert asked.state.cancel is not None and asked.child_controls == []
    from ductor_celery.engine import AttemptResult

    stopped = AttemptResult(
        token=asked.state.nodes["after"].step.token or "",
        node="after",
        outcome="cancelled",
        error={"type": "StepCancelled", "message": "stopped"},
        retryable=False,
    )
    p = _tick(
        spec,
        asked.state,
        results=(stopped,),
        children={child: ChildSnapshot(child, "running")},
    )
    assert p.state.status == RunStatus.CANCELLED
    assert [(c.run_id, c.kind) for c in p.child_controls] == [(child, "terminate")]


def test_a_finished_child_past_its_checkpoint_gets_no_control() -> None:
    spec = _holding_parent()
    state, child = _past_checkpoint(spec)
    for status in ("succeeded", "failed", "terminated", "cancelled", "timed_out"):
        p = _tick(
            spec,
            state,
            control=ControlIn(id=1, kind="terminate"),
            children={child: ChildSnapshot(child, status)},
        )
        assert p.state.status == RunStatus.TERMINATED and p.child_controls == [], status


def test_a_parent_that_succeeds_or_fails_leaves_a_child_past_its_checkpoint_running() -> None:
    spec = _holding_parent()
    state, child = _past_checkpoint(spec)
    from ductor_celery.engine.inputs import SignalIn

    done = _tick(
        spec,
        state,
        signals=(SignalIn(id=1, name="hold", payload=None),),
        children={child: ChildSnapshot(child, "running")},
    )
    assert done.state.status == RunStatus.SUCCEEDED and done.child_controls == []
    spec = _holding_parent(fails=True)
    state, child = _past_checkpoint(spec)
    from ductor_celery.engine import AttemptResult

    failed = AttemptResult(
        token=state.nodes["after"].step.token or "",
        node="after",
        outcome="failed",
        error={"type": "ValueError", "message": "no"},
        retryable=False,
    )
    p = _tick(spec, state, results=(failed,), children={child: ChildSnapshot(child, "running")})
    assert p.state.status == RunStatus.FAILED and p.child_controls == []


def test_the_loaders_read_children_past_their_checkpoint_only_when_the_run_may_stop() -> None:
    from ductor_celery.engine.children import children_to_read, may_stop

    spec = _holding_parent()
    state, child = _past_checkpoint(spec)
    assert children_to_read(spec, state, stopping=False) == {}
    assert children_to_read(spec, state, stopping=True) == {child: None}
    assert not may_stop(state, None, T0)
    assert not may_stop(state, ControlIn(id=1, kind="pause"), T0)
    assert may_stop(state, ControlIn(id=1, kind="terminate"), T0)
    assert may_stop(state, ControlIn(id=1, kind="cancel"), T0)
    state.deadline_at = T0
    assert may_stop(state, None, T0)
    state.deadline_at = None
    state.cancel = {"reason": "r", "grace_until": T0.isoformat()}
    assert may_stop(state, None, T0)


def test_redrive_starts_a_new_child_under_a_new_id() -> None:
    spec = _parent()
    s0 = _tick(spec, RunState()).state
    first = s0.nodes["sub"].child.child_run
    failed = _tick(spec, s0, children={first: ChildSnapshot(first, "failed")}).state
    p = _tick(spec, failed, control=ControlIn(id=2, kind="redrive"))
    (start,) = p.child_starts
    assert start.run_id != first and start.workflow_id_suffix == "/sub~2"


def test_child_definitions_are_checked_at_register() -> None:
    child = _child()
    wf = Workflow("p")
    wf.subworkflow("s", workflow="later")  # registered later: resolved by name at start
    assert wf.build(None, {"child": child}.get).nodes[0].workflow_hash is None
    wf = Workflow("p")
    wf.subworkflow("s", workflow="child", until="a")
    with pytest.raises(DefinitionError, match="has no checkpoint 'a'"):
        wf.build(None, {"child": child}.get)
    wf = Workflow("p")
    wf.subworkflow("s", workflow="child", parent_close="ignore")
    with pytest.raises(DefinitionError, match="parent_close must be"):
        wf.build(None, {"child": child}.get)
    wf = Workflow("p")
    wf.scatter("s", workflow="child", over="$.input.items")
    with pytest.raises(DefinitionError, match="as_child_runs=True"):
        wf.build(None, {"child": child}.get)


def _fan(tolerated: int | None = None) -> Any:
    wf = Workflow("fan")
    wf.scatter(
        "kids",
        workflow="child",
        over="$.input.items",
        as_child_runs=True,
        input={"id": "$.item"},
        max_parallel=2,
        tolerated_failures=tolerated,
    )
    wf.output("$.nodes.kids.output")
    return wf.build(None, {"child": _child()}.get)


def _fan_tick(spec: Any, state: RunState, **inputs: Any) -> Any:
    return compute_tick(
        spec, state, TickInputs(run_id="p", input={"items": [10, 11, 12, 13]}, **inputs), T0
    )


def test_child_run_scatter_keeps_at_most_max_parallel_children_open() -> None:
    spec = _fan()
    p = _fan_tick(spec, RunState())
    assert p.state.nodes["kids"].status == "waiting"
    assert [(c.input, c.workflow_id_suffix) for c in p.child_starts] == [
        ({"id": 10}, "/kids[0]"),
        ({"id": 11}, "/kids[1]"),
    ]
    first = p.child_starts[0].run_id
    p2 = _fan_tick(spec, p.state, children={first: ChildSnapshot(first, "succeeded", output=1)})
    assert [c.input for c in p2.child_starts] == [{"id": 12}]
    assert len(p2.state.nodes["kids"].scatter.branches) == 2


def test_child_run_scatter_fails_fast_and_closes_open_children() -> None:
    spec = _fan()
    p = _fan_tick(spec, RunState())
    a, b = (c.run_id for c in p.child_starts)
    p2 = _fan_tick(spec, p.state, children={a: ChildSnapshot(a, "failed", error={"message": "x"})})
    assert p2.state.status == RunStatus.FAILED
    assert p2.state.nodes["kids"].error["type"] == "BranchFailed"
    assert [(c.run_id, c.kind) for c in p2.child_controls] == [(b, "terminate")]
    assert p2.child_starts == []


def test_child_run_scatter_tolerates_and_gathers() -> None:
    spec = _fan(tolerated=1)
    state = _fan_tick(spec, RunState()).state
    started: list[str] = []
    for _ in range(10):
        sc = state.nodes["kids"].scatter
        if sc.gathering:
            break
        snaps = {
            b.token: ChildSnapshot(b.token, "failed" if i == 1 else "succeeded", output=i)
            for i, b in sc.branches.items()
        }
        p = _fan_tick(spec, state, children=snaps)
        started += [c.run_id for c in p.child_starts]
        state = p.state
    assert state.nodes["kids"].scatter.gathering
    done = _fan_tick(spec, state, gathered={"kids": [0, {"error": {}}, 2, 3]})
    assert done.state.status == RunStatus.SUCCEEDED and done.output == [0, {"error": {}}, 2, 3]
    assert len(set(started)) == 2


def test_a_child_scatter_carried_over_continue_as_new_names_children_after_its_first_run() -> None:
    spec = _fan()
    p = _fan_tick(spec, RunState())
    first = p.child_starts[0].run_id
    moved = _fan_tick(spec, p.state, control=ControlIn(id=1, kind="continue_as_new"))
    assert moved.successor is not None
    carried = moved.successor.state
    sc = carried.nodes["kids"].scatter
    assert carried.nodes["kids"].status == "waiting" and sc.run == "p"
    nxt = compute_tick(
        spec,
        carried,
        TickInputs(
            run_id=moved.successor.run_id,
            input={"items": [10, 11, 12, 13]},
            children={first: ChildSnapshot(first, "succeeded", output=0)},
        ),
        T0,
    )
    [start] = nxt.child_starts
    assert start.run_id == child_run_id("p", "kids", 2, sc.base)


def test_a_waiting_parent_polls_its_children_as_a_backstop() -> None:
    spec = _parent()
    s0 = _tick(spec, RunState()).state
    child = s0.nodes["sub"].child.child_run
    assert s0.nodes["sub"].deadline is not None
    poll = s0.nodes["sub"].deadline
    running = ChildSnapshot(child, "running")
    early = compute_tick(
        spec, s0, TickInputs(run_id="p", input={"id": 7}, children={child: running}), T0
    )
    assert not early.changed
    late = compute_tick(
        spec, s0, TickInputs(run_id="p", input={"id": 7}, children={child: running}), poll
    )
    assert late.changed and late.state.nodes["sub"].status == "waiting", "never a wait timeout"
    assert late.next_wake_at is not None and late.next_wake_at > poll


def test_a_gathering_child_scatter_keeps_a_timer() -> None:
    spec = _fan()
    state = _fan_tick(spec, RunState()).state
    for _ in range(5):
        sc = state.nodes["kids"].scatter
        if sc.gathering:
            break
        snaps = {
            b.token: ChildSnapshot(b.token, "succeeded", output=i) for i, b in sc.branches.items()
        }
        p = _fan_tick(spec, state, children=snaps)
        state = p.state
    assert state.nodes["kids"].scatter.gathering
    assert p.next_wake_at == T0


def test_continue_as_new_with_new_input_closes_the_children() -> None:
    spec = _parent()
    s0 = _tick(spec, RunState()).state
    child = s0.nodes["sub"].child.child_run
    p = _tick(
        spec, s0, control=ControlIn(id=1, kind="continue_as_new", input={"id": 8}, has_input=True)
    )
    assert p.successor is not None
    assert [(c.run_id, c.kind) for c in p.child_controls] == [(child, "terminate")]
