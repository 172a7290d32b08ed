"""continue_as_new(version=...) in the pure tick: the successor runs the other definition and
carries only the finished nodes that definition has unchanged (and all upstream of them)."""

from __future__ import annotations

from typing import Any

from support import CFG, RUN, at, ok, pure_tick

from ductor_celery.definition import Workflow, WorkflowSpec
from ductor_celery.engine import NodeStatus, RunState, RunStatus, TickInputs
from ductor_celery.engine.inputs import ControlIn
from ductor_celery.engine.versions import successor_spec_hash


def _v1() -> WorkflowSpec:
    wf = Workflow("order", version=1)
    wf.step("a", "s.a").step("b", "s.b", after=["a"]).step("c", "s.c", after=["b"])
    wf.wait_signal("hold", signal="go", after=["c"])
    return wf.build()


def _v2() -> WorkflowSpec:
    """b changed (new args): b and everything after it start again; a is carried."""
    wf = Workflow("order", version=2)
    wf.step("a", "s.a").step("b", "s.b", after=["a"], args={"k": 1})
    wf.step("c", "s.c", after=["b"]).step("d", "s.d", after=["c"])
    wf.wait_signal("hold", signal="go", after=["d"])
    return wf.build()


def _tick(spec: WorkflowSpec, state: RunState, **kw: Any) -> Any:
    return pure_tick(spec, state, TickInputs(run_id=RUN, config=CFG, **kw), at(0))


def _parked(spec: WorkflowSpec) -> RunState:
    state = _tick(spec, RunState.initial(spec.graph.order)).state
    for node in ("a", "b", "c"):
        state = _tick(spec, state, results=(ok(f"{RUN}:{node}:1", node),)).state
    assert state.nodes["hold"].status == NodeStatus.WAITING
    return state


def test_a_continue_as_new_to_another_version_carries_what_is_unchanged_upstream() -> None:
    v1, v2 = _v1(), _v2()
    state = _parked(v1)
    control = ControlIn(id=1, kind="continue_as_new", spec_hash=v2.spec_hash)
    assert successor_spec_hash(state, control) == v2.spec_hash
    p = _tick(v1, state, control=control, successor_spec=v2)
    assert p.state.status == RunStatus.CONTINUED
    successor = p.successor
    assert successor is not None
    assert successor.spec_hash == v2.spec_hash and successor.version == 2
    carried = {n: ns.status for n, ns in successor.state.nodes.items()}
    assert carried == {
        "a": NodeStatus.SUCCEEDED,
        "b": NodeStatus.PENDING,
        "c": NodeStatus.PENDING,  # unchanged, but downstream of b
        "d": NodeStatus.PENDING,
        "hold": NodeStatus.PENDING,
    }
    assert successor.state.nodes["a"].output == state.nodes["a"].output


def test_the_same_definition_carries_as_before() -> None:
    v1 = _v1()
    state = _parked(v1)
    p = _tick(v1, state, control=ControlIn(id=1, kind="continue_as_new"))
    assert p.successor is not None and p.successor.spec_hash is None
    assert p.successor.version is None
    assert p.successor.state.nodes["c"].status == NodeStatus.SUCCEEDED
    assert p.successor.state.nodes["hold"].status == NodeStatus.WAITING


def test_with_input_the_new_version_starts_from_the_top() -> None:
    v1, v2 = _v1(), _v2()
    state = _parked(v1)
    control = ControlIn(
        id=1, kind="continue_as_new", spec_hash=v2.spec_hash, input={"n": 2}, has_input=True
    )
    p = _tick(v1, state, control=control, successor_spec=v2)
    assert p.successor is not None and p.successor.input == {"n": 2}
    assert set(p.successor.state.nodes) == set(v2.graph.order)
    assert all(ns.status == NodeStatus.PENDING for ns in p.successor.state.nodes.values())


def test_a_target_the_loader_could_not_read_drops_the_continue_as_new_saying_so() -> None:
    v1, v2 = _v1(), _v2()
    state = _parked(v1)
    control = ControlIn(id=1, kind="continue_as_new", spec_hash=v2.spec_hash)
    p = _tick(v1, state, control=control)  # no successor_spec
    assert p.successor is None and p.state.status == RunStatus.RUNNING
    assert p.state.continue_pending is None
    assert any("continue-as-new dropped" in t.reason for t in p.transitions)


def test_draining_keeps_the_target_until_the_attempts_in_flight_finish() -> None:
    v1, v2 = _v1(), _v2()
    state = _tick(v1, RunState.initial(v1.graph.order)).state  # a is running
    control = ControlIn(id=1, kind="continue_as_new", spec_hash=v2.spec_hash)
    p = _tick(v1, state, control=control, successor_spec=v2)
    assert p.successor is None and p.state.continue_pending is not None
    assert successor_spec_hash(p.state, None) == v2.spec_hash
    done = _tick(v1, p.state, results=(ok(f"{RUN}:a:1", "a"),), successor_spec=v2)
    assert done.successor is not None and done.successor.version == 2
    assert done.successor.state.nodes["a"].status == NodeStatus.SUCCEEDED
