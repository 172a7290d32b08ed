"""Compensation (sagas) in the pure tick: docs/compensation.md.

A run that fails (or is cancelled with ``compensate_on_cancel``) undoes its succeeded step
nodes that have ``compensate=``, one at a time, the last completed first, as
``"<node>~compensate"`` attempts; then it ends as it would have.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import CFG, RUN, at, err, ok, pure_tick

from ductor_celery.definition import RetryPolicy, Workflow, WorkflowSpec
from ductor_celery.definition.builder import StepLike
from ductor_celery.engine import NodeStatus, RunState, RunStatus, TickInputs, TickPayload
from ductor_celery.engine.inputs import AttemptCheck, ControlIn
from ductor_celery.engine.kinds import DispatchKind
from ductor_celery.engine.state import AttemptOutput
from ductor_celery.engine.tick import needed_outputs
from ductor_celery.errors import DefinitionError

INPUT = {"order": 7}


def _tick(spec: WorkflowSpec, state: RunState, seconds: float = 0, **kw: Any) -> TickPayload:
    kw.setdefault("outputs", {})
    payload = pure_tick(
        spec, state, TickInputs(run_id=RUN, input=INPUT, config=CFG, **kw), at(seconds)
    )
    # Every state the tick leaves is stored and read back as it is.
    assert RunState.from_json(payload.state.to_json()) == payload.state
    return payload


def _outputs(spec: WorkflowSpec, state: RunState) -> dict[str, Any]:
    """What the loader reads before a tick: here each node's output is ``"out-<node>"``."""
    return {node: f"out-{node}" for node in needed_outputs(spec, state)}


def _parallel(count: int, **wf: Any) -> WorkflowSpec:
    """``count`` independent nodes with a compensation, and ``boom`` after all of them."""
    w = Workflow("saga", **wf)
    for i in range(count):
        w.step(f"p{i}", "s.do", compensate="s.undo")
    w.step("boom", "s.boom", after=[f"p{i}" for i in range(count)])
    return w.build()


def _chain(**wf: Any) -> WorkflowSpec:
    return (
        Workflow("saga", **wf)
        .step("a", "s.do", compensate="s.undo")
        .step("plain", "s.do", after=["a"])
        .step("b", "s.do", after=["plain"], compensate="s.undo")
        .step("c", "s.boom", after=["b"])
        .build()
    )


def _to_failure(spec: WorkflowSpec, order: list[str], final: str = "c") -> RunState:
    """Start the run, complete ``order`` one by one (one second apart), then fail ``final``."""
    state = _tick(spec, RunState.initial(spec.graph.order)).state
    second = 1
    for node in order:
        state = _tick(spec, state, second, results=(ok(f"{RUN}:{node}:1", f"out-{node}"),)).state
        second += 1
    failed = _tick(
        spec,
        state,
        second,
        results=(err(f"{RUN}:{final}:1", "card declined", retryable=False),),
        outputs=_outputs(spec, state),
    )
    if failed.state.compensation is None or failed.new_attempts:
        return failed.state
    # The failing tick had not read the output the first compensation needs: it woke the run,
    # and the next load reads it.
    assert [d.kind for d in failed.dispatches] == [DispatchKind.WAKEUP]
    return _tick(spec, failed.state, second, outputs=_outputs(spec, failed.state)).state


def _finish_saga(spec: WorkflowSpec, state: RunState, start: float) -> tuple[RunState, list[str]]:
    """Succeed each compensation as it starts; return the final state and the order."""
    undone: list[str] = []
    second = start
    for _ in range(20):
        if state.status != RunStatus.RUNNING:
            break
        running = [
            n for n, ns in state.nodes.items() if n.endswith("~compensate") and ns.step.token
        ]
        if not running:
            state = _tick(spec, state, second, outputs=_outputs(spec, state)).state
        else:
            (cid,) = running
            token = state.nodes[cid].step.token
            assert token is not None
            undone.append(cid.removesuffix("~compensate"))
            result = ok(token, {"undone": cid})
            state = _tick(
                spec, state, second, results=(result,), outputs=_outputs(spec, state)
            ).state
        second += 1
    return state, undone


@settings(max_examples=60, deadline=None)
@given(st.permutations([f"p{i}" for i in range(5)]))
def test_compensations_run_in_reverse_order_of_completion_one_at_a_time(
    completion: list[str],
) -> None:
    spec = _parallel(5)
    state = _to_failure(spec, completion, final="boom")
    assert state.status == RunStatus.RUNNING  # compensating: no new public status
    assert state.compensation is not None and state.compensation["active"]
    assert state.compensation["order"] == list(reversed(completion))
    # One at a time: only the first compensation is in flight.
    in_flight = [n for n, ns in state.nodes.items() if ns.status == NodeStatus.RUNNING]
    assert in_flight == [f"{completion[-1]}~compensate"]
    state, undone = _finish_saga(spec, state, start=100)
    assert undone == list(reversed(completion))
    assert state.status == RunStatus.FAILED
    assert state.compensation is not None and not state.compensation["active"]


def test_nodes_finished_in_the_same_tick_are_undone_later_in_the_graph_first() -> None:
    spec = _parallel(3)
    state = _tick(spec, RunState.initial(spec.graph.order)).state
    results = tuple(ok(f"{RUN}:p{i}:1", i) for i in range(3))
    state = _tick(spec, state, 1, results=results).state
    p = _tick(spec, state, 2, results=(err(f"{RUN}:boom:1", "no", retryable=False),))
    assert p.state.compensation is not None
    assert p.state.compensation["order"] == ["p2", "p1", "p0"]


def test_the_compensation_is_called_with_the_nodes_output_and_the_runs_input() -> None:
    spec = _chain()
    before = _to_failure(spec, ["a", "plain"], final="b")  # b failed: only a is undone
    # _to_failure loaded what the tick needed: a's output was read for its compensation.
    compensation = before.nodes["a~compensate"]
    assert compensation.status == NodeStatus.RUNNING
    state = _tick(spec, RunState.initial(spec.graph.order)).state
    state = _tick(spec, state, 1, results=(ok(f"{RUN}:a:1", {"charge": "ch_1"}),)).state
    state = _tick(spec, state, 2, results=(ok(f"{RUN}:plain:1"),)).state
    p = _tick(
        spec,
        state,
        3,
        results=(err(f"{RUN}:b:1", "declined", retryable=False),),
        outputs={"a": {"charge": "ch_1"}},
    )
    (attempt,) = p.new_attempts
    assert attempt.node == "a~compensate" and attempt.step == "s.undo"
    assert attempt.token == f"{RUN}:a~compensate:1"
    assert attempt.args == {"output": {"charge": "ch_1"}, "input": INPUT}
    assert [d.kind for d in p.dispatches] == [DispatchKind.STEP]


def test_without_the_output_loaded_the_run_wakes_itself_to_read_it() -> None:
    spec = _chain()
    state = _tick(spec, RunState.initial(spec.graph.order)).state
    state = _tick(spec, state, 1, results=(ok(f"{RUN}:a:1", 1),)).state
    state = _tick(spec, state, 2, results=(ok(f"{RUN}:plain:1"),)).state
    p = _tick(spec, state, 3, results=(err(f"{RUN}:b:1", "declined", retryable=False),))
    assert not p.new_attempts
    assert [(d.kind, d.run_id) for d in p.dispatches] == [(DispatchKind.WAKEUP, RUN)]
    assert needed_outputs(spec, p.state) == {"a": f"{RUN}:a:1"}
    # The wake-up message is backed by a timer due at once: were it lost (a broker restart,
    # a tick that raised), the sweeper wakes the run from its timer row.
    assert p.next_wake_at == at(3)
    again = _tick(spec, p.state, 4, outputs={"a": 1})
    assert [a.node for a in again.new_attempts] == ["a~compensate"]


def test_a_compensation_is_retried_with_its_own_policy_then_the_saga_goes_on() -> None:
    spec = _chain()
    state = _to_failure(spec, ["a", "plain", "b"])
    assert state.compensation is not None and state.compensation["order"] == ["b", "a"]
    p = _tick(spec, state, 10, results=(err(f"{RUN}:b~compensate:1", "gateway down"),))
    b_undo = p.state.nodes["b~compensate"]
    assert b_undo.status == NodeStatus.RUNNING and b_undo.step.retry_at is not None
    assert p.state.nodes["a~compensate"].status == NodeStatus.PENDING
    fired = _tick(spec, p.state, 100, outputs=_outputs(spec, p.state))
    assert [(a.token, a.attempt) for a in fired.new_attempts] == [(f"{RUN}:b~compensate:2", 2)]
    state, undone = _finish_saga(spec, fired.state, start=200)
    assert undone == ["b", "a"]
    assert state.status == RunStatus.FAILED
    assert state.nodes["b~compensate"].generation == 2


def test_a_compensation_that_fails_for_good_fails_the_run_with_both_errors() -> None:
    spec = _chain()
    state = _to_failure(spec, ["a", "plain", "b"])
    p = _tick(
        spec,
        state,
        10,
        results=(err(f"{RUN}:b~compensate:1", "refund refused", retryable=False),),
        outputs=_outputs(spec, state),
    )
    assert p.state.status == RunStatus.FAILED and p.finished
    assert p.state.nodes["b~compensate"].status == NodeStatus.FAILED
    # The saga stops there: a's compensation is not run.
    assert p.state.nodes["a~compensate"].status == NodeStatus.PENDING and not p.new_attempts
    assert p.error is not None
    assert p.error["type"] == "CompensationFailed"
    assert p.error["node"] == "c"
    assert p.error["error"]["message"] == "card declined"
    assert p.error["compensation"] == {
        "node": "b",
        "error": {"type": "RuntimeError", "message": "refund refused"},
    }
    assert "card declined" in p.error["message"] and "refund refused" in p.error["message"]


def test_a_run_without_succeeded_compensable_nodes_fails_as_before() -> None:
    spec = _chain()
    state = _tick(spec, RunState.initial(spec.graph.order)).state
    p = _tick(spec, state, 1, results=(err(f"{RUN}:a:1", "no", retryable=False),))
    assert p.state.status == RunStatus.FAILED and p.state.compensation is None


@pytest.mark.parametrize("compensate_on_cancel", [False, True])
def test_cancel_compensates_only_when_the_workflow_asks(compensate_on_cancel: bool) -> None:
    spec = _chain(compensate_on_cancel=compensate_on_cancel)
    state = _tick(spec, RunState.initial(spec.graph.order)).state
    state = _tick(spec, state, 1, results=(ok(f"{RUN}:a:1", 1),)).state
    p = _tick(spec, state, 2, control=ControlIn(id=1, kind="cancel"), outputs=_outputs(spec, state))
    assert p.state.nodes["plain"].status == NodeStatus.CANCELLED
    if not compensate_on_cancel:
        assert p.state.status == RunStatus.CANCELLED and p.state.compensation is None
        return
    assert p.state.status == RunStatus.RUNNING
    assert DispatchKind.WAKEUP in [d.kind for d in p.dispatches]  # to read a's output
    p = _tick(spec, p.state, 3, outputs=_outputs(spec, p.state))
    assert [a.node for a in p.new_attempts] == ["a~compensate"]
    state, undone = _finish_saga(spec, p.state, start=10)
    assert undone == ["a"] and state.status == RunStatus.CANCELLED


def test_a_cancel_or_continue_as_new_while_compensating_is_refused() -> None:
    spec = _chain()
    state = _to_failure(spec, ["a", "plain", "b"])
    for kind in ("cancel", "continue_as_new"):
        p = _tick(spec, state, 10, control=ControlIn(id=1, kind=kind))
        assert p.handled_control is not None
        assert "compensating" in str(p.handled_control.result)
        assert p.state.status == RunStatus.RUNNING and p.state.compensation == state.compensation


def test_terminate_while_compensating_ends_the_run_at_once() -> None:
    spec = _chain()
    state = _to_failure(spec, ["a", "plain", "b"])
    p = _tick(spec, state, 10, control=ControlIn(id=1, kind="terminate"))
    assert p.state.status == RunStatus.TERMINATED
    assert p.state.nodes["b~compensate"].status == NodeStatus.CANCELLED
    assert p.state.nodes["a~compensate"].status == NodeStatus.PENDING
    assert p.state.compensation is not None and not p.state.compensation["active"]
    revokes = [d for d in p.dispatches if d.kind == DispatchKind.REVOKE]
    assert [(d.token, d.terminate) for d in revokes] == [(f"{RUN}:b~compensate:1", True)]


def test_a_deadline_while_compensating_times_the_run_out() -> None:
    spec = _chain()
    state = _to_failure(spec, ["a", "plain", "b"])
    state.deadline_at = at(50)
    p = _tick(spec, state, 60)
    assert p.state.status == RunStatus.TIMED_OUT
    assert p.state.nodes["b~compensate"].status == NodeStatus.CANCELLED


def test_pause_holds_the_saga_and_resume_goes_on() -> None:
    spec = _chain()
    state = _to_failure(spec, ["a", "plain", "b"])
    paused = _tick(spec, state, 10, control=ControlIn(id=1, kind="pause")).state
    assert paused.status == RunStatus.PAUSED
    # The compensation in flight finishes and is folded; the next one does not start.
    p = _tick(
        spec, paused, 11, results=(ok(f"{RUN}:b~compensate:1"),), outputs=_outputs(spec, paused)
    )
    assert p.state.nodes["b~compensate"].status == NodeStatus.SUCCEEDED and not p.new_attempts
    resumed = _tick(
        spec, p.state, 12, control=ControlIn(id=2, kind="resume"), outputs=_outputs(spec, p.state)
    )
    assert [a.node for a in resumed.new_attempts] == ["a~compensate"]


def test_redrive_after_compensation_reruns_the_undone_nodes_and_what_follows() -> None:
    spec = _chain()
    state = _to_failure(spec, ["a", "plain", "b"])
    state, _ = _finish_saga(spec, state, start=10)
    assert state.status == RunStatus.FAILED
    p = _tick(spec, state, 100, control=ControlIn(id=1, kind="redrive"), outputs={})
    assert p.state.compensation is None
    # a was undone: it runs again, and everything after it (plain, b, c) with it.
    assert p.state.status == RunStatus.RUNNING
    assert p.state.nodes["a"].status == NodeStatus.RUNNING
    assert {n: p.state.nodes[n].status for n in ("plain", "b", "c")} == {
        "plain": NodeStatus.PENDING,
        "b": NodeStatus.PENDING,
        "c": NodeStatus.PENDING,
    }
    assert [a.token for a in p.new_attempts] == [f"{RUN}:a:2"]
    # Failing again starts a new saga; a new compensation attempt never reuses a token.
    state = _tick(spec, p.state, 101, results=(ok(f"{RUN}:a:2", 1),)).state
    again = _tick(
        spec,
        state,
        102,
        results=(err(f"{RUN}:plain:2", "x", retryable=False),),
        outputs={"a": 1},
    )
    assert [a.token for a in again.new_attempts] == [f"{RUN}:a~compensate:2"]


def test_redrive_keeps_nodes_whose_compensation_did_not_succeed() -> None:
    spec = _chain()
    state = _to_failure(spec, ["a", "plain", "b"])
    state = _tick(spec, state, 10, control=ControlIn(id=1, kind="terminate")).state
    p = _tick(spec, state, 20, control=ControlIn(id=2, kind="redrive"))
    # Neither b's compensation (cancelled) nor a's (never started) succeeded: both effects
    # stand, so a and b keep their outputs; only the failed c runs again.
    assert p.state.nodes["a"].status == NodeStatus.SUCCEEDED
    assert p.state.nodes["b"].status == NodeStatus.SUCCEEDED
    assert [a.node for a in p.new_attempts] == ["c"]


def test_a_run_that_redrives_to_success_ignores_its_old_saga_nodes() -> None:
    spec = _chain()
    state = _to_failure(spec, ["a", "plain", "b"])
    state = _tick(spec, state, 10, control=ControlIn(id=1, kind="terminate")).state
    state = _tick(spec, state, 20, control=ControlIn(id=2, kind="redrive")).state
    p = _tick(spec, state, 21, results=(ok(f"{RUN}:c:2", 3),))
    assert p.state.status == RunStatus.SUCCEEDED


def test_definition_keeps_its_hash_without_compensations() -> None:
    plain = Workflow("w").step("a", "s.do").build()
    assert "compensat" not in plain.canonical_json()
    with_one = Workflow("w").step("a", "s.do", compensate="s.undo").build()
    assert with_one.spec_hash != plain.spec_hash
    assert with_one.graph.compensations["a~compensate"].step == "s.undo"


class _Step:
    def __init__(self, name: str, retry: RetryPolicy | None = None) -> None:
        self.name = name
        self.retry = retry or RetryPolicy()
        self.timeout: float | None = None
        self.queue: str | None = None


def test_an_unregistered_compensation_step_is_refused_naming_the_node() -> None:
    known: dict[str, StepLike] = {"s.do": _Step("s.do")}
    wf = Workflow("w").step("charge", "s.do", compensate="s.refund")
    with pytest.raises(
        DefinitionError, match=r"node 'charge', compensate=: unknown step 's.refund'"
    ):
        wf.build(known.get)
    unknown_obj = Workflow("w").step("charge", "s.do", compensate=_Step("s.refund"))
    with pytest.raises(DefinitionError, match="'s.refund' is not registered"):
        unknown_obj.build(known.get)


def test_the_compensation_takes_its_own_steps_retry_policy() -> None:
    policy = RetryPolicy(max_attempts=9, initial_interval=0.5)
    known: dict[str, StepLike] = {"s.do": _Step("s.do"), "s.refund": _Step("s.refund", policy)}
    spec = Workflow("w").step("charge", "s.do", compensate="s.refund").build(known.get)
    assert spec.graph.compensations["charge~compensate"].retry.max_attempts == 9


def test_a_node_id_too_long_for_its_compensation_id_is_refused() -> None:
    wf = Workflow("w").step("n" * 190, "s.do", compensate="s.undo")
    with pytest.raises(DefinitionError, match="at most 189 characters"):
        wf.build()
    Workflow("w").step("n" * 189, "s.do", compensate="s.undo").build()


def test_compensate_on_cancel_must_be_a_bool() -> None:
    with pytest.raises(DefinitionError, match="compensate_on_cancel must be True or False"):
        Workflow("w", compensate_on_cancel="yes")  # type: ignore[arg-type]


def test_a_run_whose_output_cannot_be_stored_compensates_too() -> None:
    spec = (
        Workflow("big")
        .step("a", "s.do", compensate="s.undo")
        .output({"one": "$.nodes.a.output", "two": "$.nodes.a.output"})
        .build()
    )
    small = dataclasses.replace(CFG, max_payload_bytes=100)
    state = pure_tick(
        spec, RunState.initial(spec.graph.order), TickInputs(run_id=RUN, config=small), at(0)
    ).state
    p = pure_tick(
        spec,
        state,
        TickInputs(run_id=RUN, config=small, results=(ok(f"{RUN}:a:1", "x" * 60),)),
        at(1),
    )
    assert p.state.status == RunStatus.RUNNING
    assert p.state.compensation is not None and p.state.compensation["order"] == ["a"]
    assert [a.node for a in p.new_attempts] == ["a~compensate"]  # a's output folded here
    done = pure_tick(
        spec,
        p.state,
        TickInputs(run_id=RUN, config=small, results=(ok(f"{RUN}:a~compensate:1"),)),
        at(2),
    )
    assert done.state.status == RunStatus.FAILED
    assert done.error is not None and "run output" in done.error["message"]


def test_a_compensation_out_of_attempts_under_on_exhausted_pause_waits_for_resume() -> None:
    policy = RetryPolicy(max_attempts=1, on_exhausted="pause")
    known: dict[str, StepLike] = {"s.do": _Step("s.do"), "s.undo": _Step("s.undo", policy)}
    spec = (
        Workflow("w")
        .step("a", "s.do", compensate="s.undo")
        .step("b", "s.do", after=["a"], retry=RetryPolicy(max_attempts=1))
        .build(known.get)
    )
    state = _tick(spec, RunState.initial(spec.graph.order)).state
    state = _tick(spec, state, 1, results=(ok(f"{RUN}:a:1", 1),)).state
    state = _tick(spec, state, 2, results=(err(f"{RUN}:b:1", "no", retryable=False),)).state
    state = _tick(spec, state, 3, outputs={"a": 1}).state
    p = _tick(spec, state, 4, results=(err(f"{RUN}:a~compensate:1", "bank down"),))
    assert p.state.status == RunStatus.PAUSED
    assert p.state.nodes["a~compensate"].status == NodeStatus.FAILED
    # What the real loader reads for the resume: the output the compensation is called with.
    assert needed_outputs(spec, p.state) == {"a": f"{RUN}:a:1"}
    resumed = _tick(
        spec, p.state, 5, control=ControlIn(id=1, kind="resume"), outputs=_outputs(spec, p.state)
    )
    assert resumed.state.status == RunStatus.RUNNING
    assert [a.token for a in resumed.new_attempts] == [f"{RUN}:a~compensate:2"]
    done = _tick(spec, resumed.state, 6, results=(ok(f"{RUN}:a~compensate:2"),))
    assert done.state.status == RunStatus.FAILED and done.error is not None
    assert done.error["node"] == "b"


# -- review fixes (docs/compensation.md: "Attempts in flight when the saga starts", ...) ------


def _side_by_side(**wf: Any) -> WorkflowSpec:
    """``charge`` (compensated) and ``ship`` run in parallel; ``ship`` fails."""
    return (
        Workflow("saga", **wf)
        .step("charge", "s.do", compensate="s.undo")
        .step("ship", "s.boom", retry=RetryPolicy(max_attempts=1))
        .build()
    )


def _ship_fails_while_charge_runs(spec: WorkflowSpec) -> TickPayload:
    state = _tick(spec, RunState.initial(spec.graph.order)).state
    return _tick(spec, state, 1, results=(err(f"{RUN}:ship:1", "no truck", retryable=False),))


def test_a_compensable_attempt_in_flight_is_drained_then_undone_if_it_succeeds() -> None:
    spec = _side_by_side()
    p = _ship_fails_while_charge_runs(spec)
    # The charge may already have happened: it is asked to stop, not closed, and the saga
    # waits for its outcome before fixing its order.
    assert p.state.status == RunStatus.RUNNING
    assert p.state.nodes["charge"].status == NodeStatus.RUNNING
    assert p.closed == [] and p.new_attempts == []
    assert p.cancel_requested == [f"{RUN}:charge:1"]
    assert p.next_wake_at is not None  # the attempt's own check (its timeouts bound the wait)
    done = _tick(spec, p.state, 2, results=(ok(f"{RUN}:charge:1", "ch_1"),))
    assert [(a.node, a.args["output"]) for a in done.new_attempts] == [
        ("charge~compensate", "ch_1")
    ]
    end = _tick(spec, done.state, 3, results=(ok(f"{RUN}:charge~compensate:1"),))
    assert end.state.status == RunStatus.FAILED and end.error is not None
    assert end.error["node"] == "ship"


def test_a_drained_attempt_that_fails_leaves_nothing_to_undo() -> None:
    spec = _side_by_side()
    p = _ship_fails_while_charge_runs(spec)
    # Retryable, but no retry fires while the saga drains: the node is closed instead.
    end = _tick(spec, p.state, 2, results=(err(f"{RUN}:charge:1", "declined"),))
    assert end.new_attempts == []
    assert end.state.status == RunStatus.FAILED and end.state.compensation is None
    assert end.state.nodes["charge"].status == NodeStatus.CANCELLED
    assert end.error is not None and end.error["node"] == "ship"


def test_a_drained_attempt_that_times_out_is_not_retried() -> None:
    spec = _side_by_side()
    p = _ship_fails_while_charge_runs(spec)
    state = p.state
    assert state.nodes["charge"].status == NodeStatus.RUNNING  # drained, not closed
    checks = {f"{RUN}:charge:1": AttemptCheck(f"{RUN}:charge:1", claimed_at=at(1), finished=False)}
    end = _tick(spec, state, 400, checks=checks)  # past its 300 s start-to-close timeout
    assert [(c.token, c.outcome) for c in end.closed] == [(f"{RUN}:charge:1", "timed_out")]
    assert end.new_attempts == []
    assert end.state.nodes["charge"].status == NodeStatus.CANCELLED
    assert end.state.status == RunStatus.FAILED and end.state.compensation is None


@settings(max_examples=60, deadline=None)
@given(
    outcomes=st.lists(st.sampled_from(["ok", "fail", "stopped"]), min_size=3, max_size=3),
    failing=st.integers(min_value=0, max_value=2),
)
def test_every_compensated_node_whose_attempt_succeeds_is_undone(
    outcomes: list[str], failing: int
) -> None:
    """Three compensated nodes and ``boom`` in parallel: ``boom`` fails while they are in
    flight; then each finishes as drawn (one tick each). Exactly those that succeeded are
    undone, newest first, whatever came first."""
    w = Workflow("saga")
    for i in range(3):
        w.step(f"p{i}", "s.do", compensate="s.undo")
    w.step("boom", "s.boom", retry=RetryPolicy(max_attempts=1))
    spec = w.build()
    state = _tick(spec, RunState.initial(spec.graph.order)).state
    # Node ``failing`` gets its result in the same tick as boom's failure (folded first).
    first = outcomes[failing]
    results: list[Any] = [err(f"{RUN}:boom:1", "boom", retryable=False)]
    second = 1
    pending = [i for i in range(3) if i != failing]

    def result(i: int, outcome: str) -> Any:
        token = f"{RUN}:p{i}:1"
        if outcome == "ok":
            return ok(token, f"out-p{i}")
        if outcome == "fail":
            return err(token, "no", retryable=False)
        return dataclasses.replace(err(token, "stop"), outcome="cancelled")

    results.insert(0, result(failing, first))
    p = _tick(spec, state, second, results=tuple(results))
    for i in pending:
        assert p.state.status == RunStatus.RUNNING
        second += 1
        p = _tick(spec, p.state, second, results=(result(i, outcomes[i]),), outputs={})
    succeeded = [f"p{i}" for i in range(3) if outcomes[i] == "ok"]
    if not succeeded:
        assert p.state.status == RunStatus.FAILED and p.state.compensation is None
        return
    state, undone = _finish_saga(spec, p.state, second + 1)
    assert sorted(undone) == sorted(succeeded)
    finished = {n: state.nodes[n].finished_at for n in succeeded}
    assert [finished[n] for n in undone] == sorted(finished.values(), reverse=True)
    assert state.status == RunStatus.FAILED


def test_a_cancel_folds_an_outcome_already_written_before_closing() -> None:
    spec = _chain(compensate_on_cancel=True)
    state = _tick(spec, RunState.initial(spec.graph.order)).state
    # a's attempt succeeded (its row says so); the tick that applies the cancel loads it.
    p = _tick(
        spec, state, 1, results=(ok(f"{RUN}:a:1", "out-a"),), control=ControlIn(id=1, kind="cancel")
    )
    assert p.state.nodes["a"].status == NodeStatus.SUCCEEDED
    assert [a.node for a in p.new_attempts] == ["a~compensate"]
    assert p.state.status == RunStatus.RUNNING


def test_terminate_folds_a_compensation_that_already_succeeded() -> None:
    spec = _chain()
    state = _to_failure(spec, ["a", "plain", "b"])
    running = [n for n in ("b~compensate",) if state.nodes[n].status == NodeStatus.RUNNING]
    assert running == ["b~compensate"]
    p = _tick(
        spec,
        state,
        20,
        results=(ok(f"{RUN}:b~compensate:1", "refunded"),),
        control=ControlIn(id=1, kind="terminate"),
    )
    assert p.state.status == RunStatus.TERMINATED
    assert p.state.nodes["b~compensate"].status == NodeStatus.SUCCEEDED
    assert p.closed == []  # nothing left in flight: the refund's row stays succeeded
    # A redrive reruns b (its charge was undone) and what follows, not a: a's effect stands.
    again = _tick(spec, p.state, 21, control=ControlIn(id=2, kind="redrive"), outputs={"a": 1})
    assert [a.node for a in again.new_attempts] == ["b"]
    assert again.state.nodes["a"].status == NodeStatus.SUCCEEDED


def test_a_deadline_folds_a_compensation_that_already_succeeded() -> None:
    spec = _chain()
    state = _to_failure(spec, ["a", "plain", "b"])
    state.deadline_at = at(20)
    p = _tick(spec, state, 20, results=(ok(f"{RUN}:b~compensate:1", "refunded"),))
    assert p.state.status == RunStatus.TIMED_OUT
    assert p.state.nodes["b~compensate"].status == NodeStatus.SUCCEEDED


def _held(**wf: Any) -> WorkflowSpec:
    return (
        Workflow("saga", **wf)
        .step("charge", "s.do", compensate="s.undo")
        .wait_signal("paid", signal="paid", after=["charge"])
        .build()
    )


def test_a_cancel_of_a_paused_run_runs_the_saga() -> None:
    spec = _held(compensate_on_cancel=True)
    state = _tick(spec, RunState.initial(spec.graph.order)).state
    state = _tick(spec, state, 1, results=(ok(f"{RUN}:charge:1", "ch_1"),)).state
    state = _tick(spec, state, 2, control=ControlIn(id=1, kind="pause")).state
    assert state.status == RunStatus.PAUSED
    p = _tick(spec, state, 3, control=ControlIn(id=2, kind="cancel"), outputs=_outputs(spec, state))
    assert p.state.status == RunStatus.RUNNING
    assert p.next_wake_at == at(3)  # it wakes itself to read charge's output
    started = _tick(spec, p.state, 4, outputs=_outputs(spec, p.state))
    assert [a.node for a in started.new_attempts] == ["charge~compensate"]
    end = _tick(spec, started.state, 5, results=(ok(f"{RUN}:charge~compensate:1"),))
    assert end.state.status == RunStatus.CANCELLED


def test_a_node_failing_while_paused_runs_the_saga() -> None:
    spec = _side_by_side()
    state = _tick(spec, RunState.initial(spec.graph.order)).state
    state = _tick(spec, state, 1, results=(ok(f"{RUN}:charge:1", "ch_1"),)).state
    state = _tick(spec, state, 2, control=ControlIn(id=1, kind="pause")).state
    p = _tick(spec, state, 3, results=(err(f"{RUN}:ship:1", "no", retryable=False),))
    assert p.state.status == RunStatus.RUNNING
    assert p.next_wake_at == at(3)  # the output is read by the next tick, at once
    started = _tick(spec, p.state, 4, outputs=_outputs(spec, p.state))
    assert [a.node for a in started.new_attempts] == ["charge~compensate"]


def test_a_cancelled_successor_waiting_for_a_slot_compensates_only_once_admitted() -> None:
    spec = _chain(compensate_on_cancel=True)
    state = RunState.initial(spec.graph.order)
    # A continue-as-new successor carried a as succeeded and waits for a run slot.
    state.nodes["a"].status = NodeStatus.SUCCEEDED
    state.nodes["a"].output = AttemptOutput("prev:a:1")
    state.nodes["a"].finished_at = at(0)
    cancel = ControlIn(id=1, kind="cancel")
    p = _tick(spec, state, 5, admitted=False, outputs={"a": 1}, control=cancel)
    assert p.state.status == RunStatus.PENDING and p.new_attempts == []
    assert p.next_wake_at is None  # the commit that frees a slot wakes it
    admitted = _tick(spec, p.state, 6, admitted=True, outputs=_outputs(spec, p.state))
    assert admitted.transitions[0].to_status == RunStatus.RUNNING
    assert [a.node for a in admitted.new_attempts] == ["a~compensate"]


def test_resume_during_a_saga_reruns_only_its_compensations() -> None:
    policy = RetryPolicy(max_attempts=1, on_exhausted="pause")
    known: dict[str, StepLike] = {
        "s.do": _Step("s.do"),
        "s.undo": _Step("s.undo"),
        "s.tired": _Step("s.tired", policy),
    }
    spec = (
        Workflow("w")
        .step("charge", "s.do", compensate="s.undo")
        .step("tired", "s.tired")
        .step("ship", "s.do", retry=RetryPolicy(max_attempts=1))
        .build(known.get)
    )
    state = _tick(spec, RunState.initial(spec.graph.order)).state
    state = _tick(spec, state, 1, results=(ok(f"{RUN}:charge:1", 1),)).state
    state = _tick(spec, state, 2, results=(err(f"{RUN}:tired:1", "tired"),)).state
    assert state.status == RunStatus.PAUSED
    p = _tick(spec, state, 3, results=(err(f"{RUN}:ship:1", "no", retryable=False),))
    p = _tick(spec, p.state, 4, control=ControlIn(id=1, kind="pause"), outputs={"charge": 1})
    resumed = _tick(spec, p.state, 5, control=ControlIn(id=2, kind="resume"))
    assert resumed.state.nodes["tired"].status == NodeStatus.FAILED
    assert not any(tr.node == "tired" for tr in resumed.transitions)
