"""Redrive from a node, in the pure tick: that node and everything after it run again,
upstream outputs kept; a new input replaces the run's for the rerun."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from support import CFG, RUN, at, ok, pure_tick

from ductor_celery.definition import Workflow, WorkflowSpec
from ductor_celery.engine import NodeStatus, RunState, RunStatus, TickInputs
from ductor_celery.engine.inputs import ControlIn
from ductor_celery.engine.kinds import CONTROL_APPLIED
from ductor_celery.engine.outputs import AttemptOutput
from ductor_celery.engine.redrive import reads_for


def _diamond() -> WorkflowSpec:
    """a -> (b, c) -> d, and e on its own."""
    return (
        Workflow("w")
        .step("a", "s.a", args={"v": "$.input.v"})
        .step("b", "s.b", after=["a"], args={"x": "$.nodes.a.output"})
        .step("c", "s.c", after=["a"])
        .step("d", "s.d", after=["b", "c"], args={"x": "$.nodes.b.output", "v": "$.input.v"})
        .step("e", "s.e")
        .output({"d": "$.nodes.d.output"})
        .build()
    )


def _tick(spec: WorkflowSpec, state: RunState, **kw: Any) -> Any:
    kw.setdefault("input", {"v": 1})
    return pure_tick(spec, state, TickInputs(run_id=RUN, config=CFG, **kw), at(0))


def _succeeded(spec: WorkflowSpec) -> RunState:
    """Every node run once and succeeded: the run is succeeded."""
    state = _tick(spec, RunState.initial(spec.graph.order)).state
    for _ in range(5):
        running = [n for n, ns in state.nodes.items() if ns.status == NodeStatus.RUNNING]
        if not running:
            break
        results = tuple(ok(state.nodes[n].step.token or "", f"{n}-out") for n in running)
        state = _tick(spec, state, results=results).state
    assert state.status == RunStatus.SUCCEEDED
    return state


def test_a_redrive_from_a_node_reruns_it_and_its_descendants_of_a_succeeded_run() -> None:
    spec = _diamond()
    state = _succeeded(spec)
    p = _tick(
        spec,
        state,
        control=ControlIn(id=9, kind="redrive", node="b"),
        outputs={"a": "a-out", "c": "c-out"},
    )
    assert p.handled_control is not None and p.handled_control.result == CONTROL_APPLIED
    assert p.state.status == RunStatus.RUNNING and p.reopened
    statuses = {n: ns.status for n, ns in p.state.nodes.items()}
    assert statuses == {
        "a": NodeStatus.SUCCEEDED,
        "b": NodeStatus.RUNNING,  # started again at once, with a's kept output
        "c": NodeStatus.SUCCEEDED,
        "d": NodeStatus.PENDING,
        "e": NodeStatus.SUCCEEDED,
    }
    (attempt,) = p.new_attempts
    assert attempt.node == "b" and attempt.args == {"x": "a-out"} and attempt.attempt == 1
    assert attempt.generation == 2  # a new token
    assert p.state.nodes["a"].output == state.nodes["a"].output
    history = [(t.node, t.from_status, t.to_status, t.reason) for t in p.transitions]
    assert ("b", "succeeded", "pending", "redrive from 'b'") in history
    assert ("d", "succeeded", "pending", "redrive from 'b'") in history
    assert (None, "succeeded", "running", "redrive from 'b'") in history


def test_a_redrive_from_a_node_with_input_gives_the_rerun_the_new_input() -> None:
    spec = _diamond()
    state = _succeeded(spec)
    control = ControlIn(id=9, kind="redrive", node="a", input={"v": 2}, has_input=True)
    p = _tick(spec, state, control=control)
    assert p.state.input_from == 9
    (attempt,) = p.new_attempts
    assert attempt.node == "a" and attempt.args == {"v": 2}
    assert RunState.from_json(p.state.to_json()).input_from == 9


def test_a_plain_redrive_of_a_succeeded_run_is_still_rejected() -> None:
    spec = _diamond()
    state = _succeeded(spec)
    p = _tick(spec, state, control=ControlIn(id=9, kind="redrive"))
    assert p.state.status == RunStatus.SUCCEEDED
    assert p.handled_control is not None and p.handled_control.result.startswith("rejected")


def test_a_redrive_from_a_node_the_definition_lacks_is_rejected_and_changes_nothing() -> None:
    spec = _diamond()
    state = _succeeded(spec)
    p = _tick(spec, state, control=ControlIn(id=9, kind="redrive", node="zz"))
    assert p.state.status == RunStatus.SUCCEEDED and not p.new_attempts
    assert p.handled_control is not None
    assert "no node 'zz'" in p.handled_control.result
    assert p.state.nodes == state.nodes


def test_a_redrive_from_a_node_also_reruns_nodes_that_failed_elsewhere() -> None:
    spec = _diamond()
    state = _succeeded(spec)
    state.status = RunStatus.FAILED
    state.nodes["e"].status = NodeStatus.FAILED
    p = _tick(spec, state, control=ControlIn(id=9, kind="redrive", node="d"), outputs={})
    assert p.state.nodes["e"].status == NodeStatus.RUNNING
    assert p.state.nodes["a"].status == NodeStatus.SUCCEEDED


def test_the_loader_is_told_to_read_every_output_a_reset_node_may_need() -> None:
    spec = _diamond()
    assert reads_for(spec, ControlIn(id=1, kind="redrive", node="b")) == {"a", "b", "d"}
    assert reads_for(spec, ControlIn(id=1, kind="redrive")) == frozenset()
    assert reads_for(spec, None) == frozenset()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["a", "b", "c", "d", "e"]))
def test_exactly_the_node_and_its_descendants_rerun_and_upstream_outputs_stay(node: str) -> None:
    spec = _diamond()
    state = _succeeded(spec)
    below = {"a": {"a", "b", "c", "d"}, "b": {"b", "d"}, "c": {"c", "d"}, "d": {"d"}, "e": {"e"}}
    p = _tick(
        spec,
        state,
        control=ControlIn(id=3, kind="redrive", node=node),
        outputs={n: f"{n}-out" for n in "abcde"},
    )
    for n, ns in p.state.nodes.items():
        if n in below[node]:
            assert ns.status in (NodeStatus.PENDING, NodeStatus.RUNNING), n
            assert ns.output is None and ns.generation == state.nodes[n].generation + (
                ns.status == NodeStatus.RUNNING
            )
        else:
            assert ns.status == NodeStatus.SUCCEEDED
            assert isinstance(ns.output, AttemptOutput)
            assert ns.output == state.nodes[n].output
