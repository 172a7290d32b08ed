"""Golden cases for compute_tick: given a state and inputs, exactly this payload comes out."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from datetime import datetime
from typing import Any

import pytest
from support import CFG, NOW, RUN, RUN_STARTED, at, err, iso, ok, pure_tick, summary, token_of

from ductor_celery.definition import RetryPolicy, Workflow, WorkflowSpec
from ductor_celery.engine import (
    AttemptCheck,
    AttemptResult,
    ClosedAttempt,
    Dispatch,
    EngineConfig,
    NewAttempt,
    NodeState,
    NodeStatus,
    RunState,
    RunStatus,
    TickInputs,
    TickPayload,
    needed_outputs,
)
from ductor_celery.engine.outputs import AttemptOutput
from ductor_celery.engine.state import StepWork
from ductor_celery.engine.tick import describe


def tick(
    spec: WorkflowSpec,
    state: RunState,
    *,
    now: datetime = NOW,
    input: Any = None,
    results: Iterable[AttemptResult] = (),
    checks: Iterable[AttemptCheck] = (),
    outputs: dict[str, Any] | None = None,
    config: EngineConfig = CFG,
) -> TickPayload:
    """compute_tick, asserting on every call that the input state is left untouched."""
    inputs = TickInputs(
        run_id=RUN,
        input=input,
        results=tuple(results),
        checks={c.token: c for c in checks},
        outputs=dict(outputs or {}),
        config=config,
    )
    return pure_tick(spec, state, inputs, now)


def started(node: str, attempt: int = 1) -> tuple[str, str, str, str]:
    return (node, "pending", "running", f"attempt {attempt} dispatched")


def nodes_of(payload: TickPayload) -> dict[str, dict[str, Any]]:
    return {k: v.to_json() for k, v in payload.state.nodes.items()}


# --- starting --------------------------------------------------------------------------------


def fan_in() -> WorkflowSpec:
    return (
        Workflow("fan_in")
        .step("a", "step_a", args={"x": "$.input.x", "lit": [1, {"k": "$.input.k"}]})
        .step("b", "step_b", timeout=20)
        .step(
            "c",
            "step_c",
            after=["a", "b"],
            args={"from_a": "$.nodes.a.output.id", "from_b": "$.nodes.b.output"},
        )
        .output({"a": "$.nodes.a.output", "c": "$.nodes.c.output", "x": "$.input.x"})
        .build()
    )


def test_first_tick_starts_roots_and_the_run() -> None:
    spec = fan_in()
    p = tick(spec, RunState(), input={"x": 1, "k": "kv"})
    assert describe(p) == summary(
        nodes={"a": "running", "b": "running", "c": "pending"},
        new_attempts=["r1:a:1", "r1:b:1"],
        dispatches=["r1:a:1", "r1:b:1"],
        transitions=[RUN_STARTED, started("a"), started("b")],
        next_wake_at=iso(20),
    )
    assert p.changed is True
    assert p.new_attempts == [
        NewAttempt(
            token="r1:a:1",
            node="a",
            step="step_a",
            queue=None,
            generation=1,
            attempt=1,
            args={"x": 1, "lit": [1, {"k": "kv"}]},
            args_from=None,
            timeout=300.0,
        ),
        NewAttempt(
            token="r1:b:1",
            node="b",
            step="step_b",
            queue=None,
            generation=1,
            attempt=1,
            args={},
            args_from=None,
            timeout=20.0,
        ),
    ]
    assert p.dispatches == [
        Dispatch("step", RUN, "a", "r1:a:1", "step_a", None),
        Dispatch("step", RUN, "b", "r1:b:1", "step_b", None),
    ]
    assert nodes_of(p)["a"] == {
        "status": "running",
        "generation": 1,
        "attempt": 1,
        "token": "r1:a:1",
        "check_at": iso(30),
        "resend_at": iso(30),
        "started_at": iso(0),
    }
    assert p.state.transitions == 3


def test_first_tick_fills_in_nodes_missing_from_the_state() -> None:
    spec = fan_in()
    state = RunState.initial(["a", "b", "c"])
    assert describe(tick(spec, state, input={"x": 1})) == describe(
        tick(spec, RunState(), input={"x": 1})
    )


def test_wakeup_with_nothing_new_changes_nothing() -> None:
    spec = fan_in()
    first = tick(spec, RunState(), input={"x": 1})
    again = tick(spec, first.state, input={"x": 1}, now=at(29))
    assert again.changed is False
    assert describe(again) == summary(
        nodes={"a": "running", "b": "running", "c": "pending"}, next_wake_at=iso(20)
    )
    assert again.state == first.state


# --- success, outputs and context ----------------------------------------------------------------


def test_success_folds_output_and_starts_dependants_with_resolved_args() -> None:
    spec = fan_in()
    s1 = tick(spec, RunState(), input={"x": 1}).state
    # b succeeds first: c still waits for a.
    p2 = tick(spec, s1, input={"x": 1}, now=at(5), results=[ok("r1:b:1", "B")])
    assert describe(p2) == summary(
        nodes={"a": "running", "b": "succeeded", "c": "pending"},
        folded=["r1:b:1"],
        transitions=[("b", "running", "succeeded", "attempt 1 succeeded")],
        next_wake_at=iso(30),
    )
    assert nodes_of(p2)["b"] == {
        "status": "succeeded",
        "generation": 1,
        "attempt": 1,
        "output_token": "r1:b:1",
        "started_at": iso(0),
        "finished_at": iso(5),
    }
    # The loader reads b's output (c is pending and reads it), a's is folded in the same tick.
    assert needed_outputs(spec, p2.state) == {"b": "r1:b:1"}
    p3 = tick(
        spec,
        p2.state,
        input={"x": 1},
        now=at(7),
        results=[ok("r1:a:1", {"id": 7})],
        outputs={"b": "B"},
    )
    assert describe(p3) == summary(
        nodes={"a": "succeeded", "b": "succeeded", "c": "running"},
        folded=["r1:a:1"],
        new_attempts=["r1:c:1"],
        dispatches=["r1:c:1"],
        transitions=[("a", "running", "succeeded", "attempt 1 succeeded"), started("c")],
        next_wake_at=iso(37),
    )
    assert p3.new_attempts[0].args == {"from_a": 7, "from_b": "B"}
    # c running: nothing pending reads a or b any more, but the run output reads a.
    assert needed_outputs(spec, p3.state) == {"a": "r1:a:1"}
    p4 = tick(
        spec,
        p3.state,
        input={"x": 1},
        now=at(9),
        results=[ok("r1:c:1", ["C"])],
        outputs={"a": {"id": 7}},
    )
    assert describe(p4) == summary(
        status="succeeded",
        nodes={"a": "succeeded", "b": "succeeded", "c": "succeeded"},
        folded=["r1:c:1"],
        transitions=[
            ("c", "running", "succeeded", "attempt 1 succeeded"),
            (None, "running", "succeeded", "every node finished"),
        ],
        output={"a": {"id": 7}, "c": ["C"], "x": 1},
    )
    assert p4.state.transitions == 3 + 1 + 2 + 2


def test_two_results_in_one_tick_both_fold_and_the_join_starts() -> None:
    spec = fan_in()
    s1 = tick(spec, RunState(), input={"x": 1}).state
    p = tick(spec, s1, now=at(3), results=[ok("r1:b:1", 2), ok("r1:a:1", {"id": "A"})])
    assert describe(p)["nodes"] == {"a": "succeeded", "b": "succeeded", "c": "running"}
    assert p.folded == ["r1:b:1", "r1:a:1"]
    assert p.new_attempts[0].args == {"from_a": "A", "from_b": 2}


def test_context_patch_merges_into_state_context_and_is_readable_at_once() -> None:
    spec = (
        Workflow("ctx")
        .step("a", "s")
        .step("b", "s", after=["a"], args={"k": "$.context.k", "new": "$.context.new"})
        .build()
    )
    state = tick(spec, RunState()).state
    state.context.update({"k": 1, "keep": True})
    p = tick(spec, state, results=[ok("r1:a:1", None, patch={"k": 2, "new": [1]})])
    assert p.state.context == {"k": 2, "keep": True, "new": [1]}
    assert p.new_attempts[0].args == {"k": 2, "new": [1]}
    assert state.context == {"k": 1, "keep": True}  # the input state is untouched


def test_empty_patch_and_none_patch_leave_context_alone() -> None:
    spec = Workflow("ctx").step("a", "s").step("b", "s").build()
    state = tick(spec, RunState()).state
    state.context["k"] = 1
    p = tick(spec, state, results=[ok("r1:a:1", patch={}), ok("r1:b:1", patch=None)])
    assert p.state.context == {"k": 1}
    assert p.status == RunStatus.SUCCEEDED


# --- when and skipping ---------------------------------------------------------------------------


def skip_graph() -> WorkflowSpec:
    return (
        Workflow("skips")
        .step("a", "s", when="$.input.go")
        .step("b", "s", after=["a"])  # every dependency skipped -> skipped
        .step("c", "s")
        .step("j", "s", after=["b", "c"])  # one skipped, one succeeded -> runs
        .step("n", "s", when="!$.input.go")  # negation: runs
        .step("off", "s", when=False)  # literal falsy
        .output({"j": "$.nodes.j.output", "b": "$.nodes.b.output"})
        .build()
    )


def test_when_falsy_skips_and_all_skipped_dependencies_skip() -> None:
    spec = skip_graph()
    p1 = tick(spec, RunState(), input={"go": False})
    assert describe(p1) == summary(
        nodes={
            "a": "skipped",
            "b": "skipped",
            "c": "running",
            "j": "pending",
            "n": "running",
            "off": "skipped",
        },
        new_attempts=["r1:c:1", "r1:n:1"],
        dispatches=["r1:c:1", "r1:n:1"],
        transitions=[
            RUN_STARTED,
            ("a", "pending", "skipped", "when '$.input.go' is falsy"),
            started("c"),
            ("n", "pending", "running", "attempt 1 dispatched"),
            ("off", "pending", "skipped", "when False is falsy"),
            ("b", "pending", "skipped", "every dependency was skipped"),
        ],
        next_wake_at=iso(30),
    )
    assert nodes_of(p1)["a"] == {"status": "skipped", "finished_at": iso(0)}
    p2 = tick(
        spec, p1.state, input={"go": False}, now=at(4), results=[ok("r1:c:1", "C"), ok("r1:n:1")]
    )
    assert describe(p2)["nodes"]["j"] == "running"
    assert p2.new_attempts[0].token == "r1:j:1"
    p3 = tick(spec, p2.state, input={"go": False}, now=at(6), results=[ok("r1:j:1", "J")])
    assert p3.status == RunStatus.SUCCEEDED
    assert p3.output == {"j": "J", "b": None}


def test_when_truthy_runs_and_missing_input_is_falsy() -> None:
    spec = skip_graph()
    p = tick(spec, RunState(), input={"go": {"nonempty": 1}})
    assert describe(p)["nodes"] == {
        "a": "running",
        "b": "pending",
        "c": "running",
        "j": "pending",
        "n": "skipped",
        "off": "skipped",
    }
    p = tick(spec, RunState(), input=None)
    assert describe(p)["nodes"]["a"] == "skipped" and describe(p)["nodes"]["n"] == "running"


def test_when_reading_a_node_output_folded_in_the_same_tick() -> None:
    spec = (
        Workflow("w")
        .step("a", "s")
        .step("yes", "s", after=["a"], when="$.nodes.a.output.go")
        .step("no", "s", after=["a"], when="!$.nodes.a.output.go")
        .build()
    )
    state = tick(spec, RunState()).state
    p = tick(spec, state, results=[ok("r1:a:1", {"go": True})])
    assert describe(p)["nodes"] == {"a": "succeeded", "yes": "running", "no": "skipped"}


def test_a_run_of_only_skipped_nodes_succeeds_in_its_first_tick() -> None:
    spec = Workflow("w").step("a", "s", when="$.input.go").output("$.nodes.a.output").build()
    p = tick(spec, RunState(), input={})
    assert describe(p) == summary(
        status="succeeded",
        nodes={"a": "skipped"},
        transitions=[
            RUN_STARTED,
            ("a", "pending", "skipped", "when '$.input.go' is falsy"),
            (None, "running", "succeeded", "every node finished"),
        ],
    )


# --- retries -------------------------------------------------------------------------------------


def retry_graph(**policy: Any) -> WorkflowSpec:
    retry = RetryPolicy(**({"max_attempts": 3, "initial_interval": 2.0, "backoff": 3.0} | policy))
    return (
        Workflow("retry")
        .step("a", "s", args={"v": "$.input.v"}, retry=retry)
        .step("b", "s", after=["a"])
        .build()
    )


def test_retryable_failure_schedules_a_retry_that_fires_with_a_new_token() -> None:
    spec = retry_graph()
    s1 = tick(spec, RunState(), input={"v": 1}).state
    p2 = tick(spec, s1, input={"v": 1}, now=at(5), results=[err("r1:a:1")])
    assert describe(p2) == summary(
        nodes={"a": "running", "b": "pending"},
        folded=["r1:a:1"],
        transitions=[("a", "running", "running", "attempt 1 failed: boom; retry in 2s")],
        next_wake_at=iso(7),
    )
    assert nodes_of(p2)["a"] == {
        "status": "running",
        "generation": 1,
        "attempt": 1,
        "retry_at": iso(7),
        "error": {"type": "RuntimeError", "message": "boom"},
        "started_at": iso(0),
    }
    # Before the timer: a no-op.
    early = tick(spec, p2.state, input={"v": 1}, now=at(6.999))
    assert early.changed is False and early.state == p2.state
    # At the timer: attempt 2, generation 2, a new token, args copied from attempt 1.
    p3 = tick(spec, p2.state, input={"v": 999}, now=at(7))
    assert describe(p3) == summary(
        nodes={"a": "running", "b": "pending"},
        new_attempts=["r1:a:2"],
        dispatches=["r1:a:2"],
        transitions=[("a", "running", "running", "attempt 2 dispatched (retry)")],
        next_wake_at=iso(37),
    )
    assert p3.new_attempts == [
        NewAttempt(
            token="r1:a:2",
            node="a",
            step="s",
            queue=None,
            generation=2,
            attempt=2,
            args={},
            args_from="r1:a:1",
            timeout=300.0,
        )
    ]
    assert p3.state.nodes["a"].step.retry_at is None
    assert p3.state.nodes["a"].step.token == "r1:a:2"
    # Attempt 2 fails: backoff 2 * 3 = 6 s. Attempt 3 fails: budget spent, node and run fail.
    p4 = tick(spec, p3.state, now=at(10), results=[err("r1:a:2", "again")])
    assert p4.state.nodes["a"].step.retry_at == at(16)
    assert p4.transitions[0].reason == "attempt 2 failed: again; retry in 6s"
    p5 = tick(spec, p4.state, now=at(20))
    assert p5.new_attempts[0].token == "r1:a:3" and p5.new_attempts[0].args_from == "r1:a:2"
    p6 = tick(spec, p5.state, now=at(21), results=[err("r1:a:3", "third")])
    assert describe(p6) == summary(
        status="failed",
        nodes={"a": "failed", "b": "pending"},
        folded=["r1:a:3"],
        transitions=[
            ("a", "running", "failed", "attempt 3 failed (3 attempts used): third"),
            (None, "running", "failed", "node 'a' failed: third"),
        ],
        error={"type": "RuntimeError", "message": "third", "node": "a"},
    )


def test_retry_after_a_late_tick_fires_once() -> None:
    spec = retry_graph()
    s = tick(spec, RunState()).state
    s = tick(spec, s, results=[err("r1:a:1")]).state
    late = tick(spec, s, now=at(3600))
    assert [a.token for a in late.new_attempts] == ["r1:a:2"]
    again = tick(spec, late.state, now=at(3600))
    assert again.changed is False and again.new_attempts == []


def test_zero_backoff_retries_in_the_same_tick() -> None:
    spec = retry_graph(initial_interval=0.0)
    s = tick(spec, RunState()).state
    p = tick(spec, s, now=at(1), results=[err("r1:a:1")])
    assert describe(p)["new_attempts"] == ["r1:a:2"]
    assert p.new_attempts[0].args_from == "r1:a:1"


def test_non_retryable_failure_fails_node_and_run_and_cancels_in_flight() -> None:
    spec = fan_in()
    s1 = tick(spec, RunState(), input={"x": 1}).state
    p = tick(spec, s1, now=at(5), results=[err("r1:a:1", "bad", retryable=False)])
    assert describe(p) == summary(
        status="failed",
        nodes={"a": "failed", "b": "cancelled", "c": "pending"},
        folded=["r1:a:1"],
        closed=[("r1:b:1", "cancelled")],
        transitions=[
            ("a", "running", "failed", "attempt 1 failed (not retryable): bad"),
            ("b", "running", "cancelled", "run failed: node 'a' failed"),
            (None, "running", "failed", "node 'a' failed: bad"),
        ],
        error={"type": "RuntimeError", "message": "bad", "node": "a"},
    )
    assert p.closed == [
        ClosedAttempt(
            "r1:b:1", "cancelled", {"type": "Cancelled", "message": "run failed: node 'a' failed"}
        )
    ]
    assert nodes_of(p)["c"] == {"status": "pending"}  # never started: stays pending


def test_failure_without_error_details_gets_a_generic_error() -> None:
    spec = Workflow("w").step("a", "s", retry=RetryPolicy(max_attempts=1)).build()
    s = tick(spec, RunState()).state
    bare = AttemptResult(token="r1:a:1", node="a", outcome="failed", error=None)
    p = tick(spec, s, results=[bare])
    assert p.error == {"type": "Error", "message": "attempt failed", "node": "a"}


def test_a_retry_due_in_the_tick_where_the_run_fails_is_not_started() -> None:
    spec = (
        Workflow("w")
        .step("a", "s", retry=RetryPolicy(max_attempts=3, initial_interval=1.0))
        .step("b", "s")
        .build()
    )
    s = tick(spec, RunState()).state
    s = tick(spec, s, now=at(1), results=[err("r1:a:1")]).state  # retry at 2 s
    p = tick(spec, s, now=at(5), results=[err("r1:b:1", retryable=False)])
    assert describe(p) == summary(
        status="failed",
        nodes={"a": "cancelled", "b": "failed"},
        folded=["r1:b:1"],
        transitions=[
            ("b", "running", "failed", "attempt 1 failed (not retryable): boom"),
            ("a", "running", "cancelled", "run failed: node 'b' failed"),
            (None, "running", "failed", "node 'b' failed: boom"),
        ],
        error={"type": "RuntimeError", "message": "boom", "node": "b"},
    )


# --- continue_on_failure -------------------------------------------------------------------------


def test_continue_on_failure_lets_dependants_run_with_none_and_the_run_succeed() -> None:
    spec = (
        Workflow("w")
        .step("a", "s", continue_on_failure=True, retry=RetryPolicy(max_attempts=1))
        .step("b", "s", after=["a"], args={"x": "$.nodes.a.output", "y": "$.nodes.a.output.k"})
        .output({"a": "$.nodes.a.output", "b": "$.nodes.b.output"})
        .build()
    )
    s = tick(spec, RunState()).state
    p = tick(spec, s, now=at(1), results=[err("r1:a:1", "nope")])
    assert describe(p) == summary(
        nodes={"a": "failed", "b": "running"},
        folded=["r1:a:1"],
        new_attempts=["r1:b:1"],
        dispatches=["r1:b:1"],
        transitions=[
            ("a", "running", "failed", "attempt 1 failed (1 attempts used): nope"),
            started("b"),
        ],
        next_wake_at=iso(31),
    )
    assert p.new_attempts[0].args == {"x": None, "y": None}
    assert needed_outputs(spec, p.state) == {}  # a failed: no output row to load
    done = tick(spec, p.state, now=at(2), results=[ok("r1:b:1", "B")])
    assert done.status == RunStatus.SUCCEEDED
    assert done.output == {"a": None, "b": "B"}
    assert done.error is None


# --- stale and duplicate results -----------------------------------------------------------------


def test_stale_result_is_folded_and_ignored() -> None:
    spec = retry_graph()
    s = tick(spec, RunState()).state
    s = tick(spec, s, now=at(1), results=[err("r1:a:1")]).state
    s = tick(spec, s, now=at(3)).state  # attempt 2 (r1:a:2) in flight
    # Attempt 1's result arrives again (generation 1), and a generation that never existed.
    p = tick(spec, s, now=at(4), results=[ok("r1:a:1", "late"), ok("r1:a:0", "zero")])
    assert describe(p) == summary(
        nodes={"a": "running", "b": "pending"},
        folded=["r1:a:1", "r1:a:0"],
        transitions=[
            ("a", "running", "running", "stale result ignored (token r1:a:1)"),
            ("a", "running", "running", "stale result ignored (token r1:a:0)"),
        ],
        next_wake_at=iso(33),
    )
    assert p.changed is True  # folding must be written
    assert p.state.nodes == s.nodes and p.state.context == s.context


def test_result_for_a_node_waiting_on_its_retry_timer_is_stale() -> None:
    spec = retry_graph()
    s = tick(spec, RunState()).state
    s = tick(spec, s, now=at(1), results=[err("r1:a:1")]).state  # token None, retry at 3 s
    p = tick(spec, s, now=at(2), results=[ok("r1:a:1", "late")])
    assert p.state.nodes == s.nodes
    assert p.folded == ["r1:a:1"] and p.new_attempts == []


def test_result_for_an_unknown_node_is_stale() -> None:
    spec = retry_graph()
    s = tick(spec, RunState()).state
    ghost = AttemptResult(token="r1:ghost:1", node="ghost", outcome="succeeded")
    p = tick(spec, s, results=[ghost])
    assert p.folded == ["r1:ghost:1"]
    assert p.transitions[0].reason == "stale result ignored (token r1:ghost:1)"
    assert p.state.nodes == s.nodes


def test_duplicate_of_an_applied_result_changes_nothing_but_is_folded() -> None:
    spec = fan_in()
    s = tick(spec, RunState(), input={"x": 1}).state
    applied = tick(spec, s, now=at(1), results=[ok("r1:a:1", {"id": 1}, patch={"p": 1})])
    dup = tick(spec, applied.state, now=at(2), results=[ok("r1:a:1", {"id": 2}, patch={"p": 2})])
    assert describe(dup) == summary(
        nodes={"a": "succeeded", "b": "running", "c": "pending"},
        folded=["r1:a:1"],
        transitions=[("a", "succeeded", "succeeded", "stale result ignored (token r1:a:1)")],
        next_wake_at=iso(20),  # b's first look: its 20 s timeout comes before the re-send
    )
    assert dup.state.nodes == applied.state.nodes
    assert dup.state.context == {"p": 1}


def test_same_result_twice_in_one_tick_is_applied_once() -> None:
    spec = fan_in()
    s = tick(spec, RunState(), input={"x": 1}).state
    p = tick(spec, s, results=[ok("r1:b:1", "first", {"n": 1}), ok("r1:b:1", "second", {"n": 2})])
    assert p.folded == ["r1:b:1", "r1:b:1"]
    assert [tr.to_status for tr in p.transitions] == ["succeeded", "succeeded"]
    assert p.transitions[1].reason == "stale result ignored (token r1:b:1)"
    assert p.state.context == {"n": 1}
    assert token_of(p.state.nodes["b"]) == "r1:b:1"


# --- checks: unclaimed resend and timeouts -------------------------------------------------------


def one_node(timeout: float | None = None, attempts: int = 2) -> WorkflowSpec:
    return (
        Workflow("one")
        .step("a", "s", timeout=timeout, retry=RetryPolicy(max_attempts=attempts))
        .build()
    )


def test_unclaimed_attempt_is_resent_with_the_same_token_and_doubling_checks() -> None:
    spec = one_node()
    s = tick(spec, RunState()).state
    unclaimed = AttemptCheck("r1:a:1", claimed_at=None, finished=False)
    p = tick(spec, s, now=at(30), checks=[unclaimed])
    assert describe(p) == summary(
        nodes={"a": "running"},
        dispatches=["r1:a:1"],
        transitions=[("a", "running", "running", "attempt 1 unclaimed: re-sent")],
        next_wake_at=iso(30 + 60),
    )
    assert p.dispatches == [Dispatch("step", RUN, "a", "r1:a:1", "s", None)]
    assert p.state.nodes["a"].step.resends == 1
    assert p.state.nodes["a"].generation == 1
    # Not due yet: nothing. Due again: re-sent, next check 120 s later.
    assert tick(spec, p.state, now=at(89), checks=[unclaimed]).changed is False
    p2 = tick(spec, p.state, now=at(90), checks=[unclaimed])
    assert describe(p2)["dispatches"] == ["r1:a:1"]
    assert describe(p2)["new_attempts"] == []
    assert p2.next_wake_at == at(90 + 120)
    assert p2.state.nodes["a"].step.resends == 2
    # Claimed at last, then lost: the retry is a new attempt whose resend count starts over.
    p3 = tick(spec, p2.state, now=at(400), checks=[AttemptCheck("r1:a:1", at(100), False)])
    assert describe(p3)["closed"] == [("r1:a:1", "timed_out")]
    p4 = tick(spec, p3.state, now=at(401))
    assert describe(p4)["new_attempts"] == ["r1:a:2"]
    a = p4.state.nodes["a"]
    assert (a.step.resends, a.step.claimed_at, a.step.check_at) == (0, None, at(401 + 30))
    p5 = tick(spec, p4.state, now=at(431), checks=[AttemptCheck("r1:a:2", None, False)])
    assert p5.next_wake_at == at(431 + 60)


def test_a_resend_is_not_sent_when_the_run_fails_in_the_same_tick() -> None:
    spec = (
        Workflow("w")
        .step("lost", "s")
        .step("slow", "s", timeout=10.0, retry=RetryPolicy(max_attempts=1))
        .build()
    )
    s = tick(spec, RunState()).state
    p = tick(
        spec,
        s,
        now=at(30),
        checks=[
            AttemptCheck("r1:lost:1", claimed_at=None, finished=False),  # would be re-sent
            AttemptCheck("r1:slow:1", claimed_at=at(1), finished=False),  # timed out, budget spent
        ],
    )
    assert describe(p) == summary(
        status="failed",
        nodes={"lost": "cancelled", "slow": "failed"},
        closed=[("r1:slow:1", "timed_out"), ("r1:lost:1", "cancelled")],
        transitions=[
            ("lost", "running", "running", "attempt 1 unclaimed: re-sent"),
            (
                "slow",
                "running",
                "failed",
                "attempt 1 failed (1 attempts used): attempt 1 did not finish within 10s of its "
                "start (worker lost or step too slow)",
            ),
            ("lost", "running", "cancelled", "run failed: node 'slow' failed"),
            (
                None,
                "running",
                "failed",
                "node 'slow' failed: attempt 1 did not finish within 10s of its start "
                "(worker lost or step too slow)",
            ),
        ],
        error={
            "type": "StepTimeout",
            "node": "slow",
            "message": "attempt 1 did not finish within 10s of its start "
            "(worker lost or step too slow)",
        },
    )


def test_due_check_without_loaded_claim_status_or_already_finished_does_nothing() -> None:
    spec = one_node()
    s = tick(spec, RunState()).state
    assert tick(spec, s, now=at(45)).changed is False
    finished = AttemptCheck("r1:a:1", claimed_at=at(1), finished=True)
    p = tick(spec, s, now=at(1000), checks=[finished])
    assert p.changed is False and p.closed == [] and p.dispatches == []


def test_claimed_attempt_moves_its_check_to_the_deadline_then_times_out_and_retries() -> None:
    spec = one_node(timeout=100.0)
    s = tick(spec, RunState()).state
    claimed = AttemptCheck("r1:a:1", claimed_at=at(10), finished=False)
    p = tick(spec, s, now=at(30), checks=[claimed])
    assert describe(p) == summary(nodes={"a": "running"}, next_wake_at=iso(110))
    assert p.changed is True  # claimed_at and check_at are written
    assert p.state.nodes["a"].step.claimed_at == at(10)
    assert tick(spec, p.state, now=at(30), checks=[claimed]).changed is False
    assert tick(spec, p.state, now=at(109), checks=[claimed]).changed is False
    p2 = tick(spec, p.state, now=at(110), checks=[claimed])
    assert describe(p2) == summary(
        nodes={"a": "running"},
        closed=[("r1:a:1", "timed_out")],
        transitions=[
            (
                "a",
                "running",
                "running",
                "attempt 1 failed: attempt 1 did not finish within 100s of its start "
                "(worker lost or step too slow); retry in 1s",
            )
        ],
        next_wake_at=iso(111),
    )
    assert p2.closed[0].error["type"] == "StepTimeout"
    assert p2.state.nodes["a"].step.token is None
    p3 = tick(spec, p2.state, now=at(111))
    assert describe(p3)["new_attempts"] == ["r1:a:2"]
    assert p3.new_attempts[0].args_from == "r1:a:1"
    # The timed-out worker finishing late is a stale result.
    p4 = tick(spec, p3.state, now=at(112), results=[ok("r1:a:1", "late")])
    assert p4.state.nodes == p3.state.nodes


def test_claimed_attempt_uses_the_default_timeout_and_fails_when_budget_spent() -> None:
    spec = one_node(timeout=None, attempts=1)
    s = tick(spec, RunState()).state
    claimed = AttemptCheck("r1:a:1", claimed_at=at(0), finished=False)
    p = tick(spec, s, now=at(30), checks=[claimed])
    assert p.next_wake_at == at(300)
    p2 = tick(spec, p.state, now=at(300), checks=[claimed])
    assert describe(p2)["status"] == "failed"
    assert describe(p2)["closed"] == [("r1:a:1", "timed_out")]
    assert p2.error is not None and p2.error["type"] == "StepTimeout" and p2.error["node"] == "a"


def test_claimed_long_ago_times_out_at_the_first_check() -> None:
    spec = one_node(timeout=10.0)
    s = tick(spec, RunState()).state
    p = tick(spec, s, now=at(30), checks=[AttemptCheck("r1:a:1", at(1), False)])
    assert describe(p)["closed"] == [("r1:a:1", "timed_out")]
    assert p.state.nodes["a"].step.retry_at == at(31)


# --- purity --------------------------------------------------------------------------------------


def test_input_state_is_never_mutated_even_by_a_busy_tick() -> None:
    spec = (
        Workflow("w")
        .step("a", "s", retry=RetryPolicy(max_attempts=2, initial_interval=0.0))
        .step("b", "s")
        .step("c", "s", after=["a"], args={"ctx": "$.context.deep"})
        .build()
    )
    s = tick(spec, RunState()).state
    s.context["deep"] = {"list": [1, 2], "d": {"x": 1}}
    s.nodes["b"].error = {"type": "Old", "message": "old"}
    frozen = copy.deepcopy(s)
    p = tick(
        spec,
        s,
        now=at(40),
        results=[ok("r1:a:1", "A", patch={"deep": {"list": [3]}, "other": 1})],
        checks=[AttemptCheck("r1:b:1", claimed_at=None, finished=False)],
    )
    assert s == frozen
    assert p.state.context["deep"] == {"list": [3]}
    p.state.context["deep"]["list"].append(4)
    p.state.nodes["b"].step.resends = 99
    assert s == frozen


# --- terminal runs -------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED])
def test_terminal_run_folds_late_results_and_changes_nothing_else(status: RunStatus) -> None:
    spec = fan_in()
    s = tick(spec, RunState(), input={"x": 1}).state
    s.status = status
    p = tick(
        spec,
        s,
        now=at(500),
        results=[ok("r1:a:1", "late"), err("r1:b:1")],
        checks=[AttemptCheck("r1:a:1", None, False)],
    )
    assert describe(p) == summary(
        status=status.value,
        nodes={"a": "running", "b": "running", "c": "pending"},
        folded=["r1:a:1", "r1:b:1"],
    )
    assert p.state == s
    quiet = tick(spec, s, now=at(500))
    assert quiet.changed is False and quiet.state == s


# --- malformed results and arguments -------------------------------------------------------------


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (
            ok("r1:a:1", "out", patch=["not", "a", "dict"]),  # type: ignore[arg-type]
            "context patch must be a mapping, got list",
        ),
        (ok("r1:a:1", "x" * 200), "over ductor_max_payload_bytes=100"),
        (ok("r1:a:1", None, patch={"k": "y" * 200}), "over ductor_max_payload_bytes=100"),
        (ok("r1:a:1", {1, 2}), "not JSON-serializable"),
    ],
)
def test_bad_success_result_fails_the_attempt_without_retry(
    result: AttemptResult, message: str
) -> None:
    spec = one_node(attempts=5)
    config = EngineConfig(max_payload_bytes=100)
    s = tick(spec, RunState(), config=config).state
    p = tick(spec, s, now=at(1), results=[result], config=config)
    d = describe(p)
    assert d["status"] == "failed" and d["nodes"] == {"a": "failed"}
    assert d["new_attempts"] == [] and d["folded"] == ["r1:a:1"]
    assert p.error is not None and p.error["type"] == "InvalidResult" and p.error["node"] == "a"
    assert message in p.error["message"]
    assert p.transitions[0].reason.startswith("attempt 1 failed (not retryable): ")
    assert p.state.context == {}
    assert token_of(p.state.nodes["a"]) is None


def test_a_result_checked_where_it_was_produced_is_not_checked_again() -> None:
    """``AttemptResult.checked`` (an outcome its step worker checked and carries into its
    eager tick): the guard against bad rows trusts it; an unmarked one is checked."""
    spec = one_node(attempts=5)
    config = EngineConfig(max_payload_bytes=100)
    s = tick(spec, RunState(), config=config).state
    big = "x" * 200  # over this config's limit: what the guard would refuse in a row
    trusted = dataclasses.replace(ok("r1:a:1", big), checked=True)
    p = tick(spec, s, now=at(1), results=[trusted], config=config)
    assert describe(p)["status"] == "succeeded" and p.error is None
    unmarked = tick(spec, s, now=at(1), results=[ok("r1:a:1", big)], config=config)
    assert describe(unmarked)["status"] == "failed"


def test_a_tick_leaves_a_carried_result_s_values_as_they_were() -> None:
    """A carried result's output and patch are the step worker's own objects (the ones its
    fallback write and lost-outcome keeper would write if the tick does not commit): the
    tick reads them and never changes them, nested values included."""
    spec = one_node(attempts=5)
    s = tick(spec, RunState()).state
    output = {"n": [1, {"x": 2}]}
    patch = {"p": {"q": [1]}, "r": [{"s": 1}]}
    result = dataclasses.replace(ok("r1:a:1", output, patch=patch), checked=True)
    before = copy.deepcopy((output, patch))
    p = tick(spec, s, now=at(1), results=[result])
    assert describe(p)["status"] == "succeeded"
    p.state.to_json()
    assert (result.output, result.patch) == before


def test_arguments_over_the_payload_limit_fail_the_node_and_the_run_at_once() -> None:
    spec = (
        Workflow("w")
        .step("small", "s", args={"v": "$.input.small"})
        .step("big", "s", args={"v": "$.input.big"})
        .step("next", "s", after=["big"])
        .build()
    )
    config = EngineConfig(max_payload_bytes=100)
    p = tick(spec, RunState(), input={"small": 1, "big": "x" * 200}, config=config)
    d = describe(p)
    assert d["status"] == "failed"
    assert d["nodes"] == {"small": "cancelled", "big": "failed", "next": "pending"}
    # small's attempt was created in this tick: it is never inserted nor sent, and there is
    # no row to close.
    assert d["new_attempts"] == [] and d["dispatches"] == [] and d["closed"] == []
    assert p.error is not None and p.error["type"] == "PayloadTooLarge" and p.error["node"] == "big"
    assert ("big", "pending", "failed") in [t[:3] for t in d["transitions"]]
    assert not any("refused" in tr.reason for tr in p.transitions)
    again = tick(spec, p.state, input={"small": 1, "big": "x" * 200}, config=config)
    assert again.changed is False


def test_arguments_over_the_limit_with_continue_on_failure_let_the_run_go_on() -> None:
    spec = (
        Workflow("w")
        .step("big", "s", args={"v": "$.input.big"}, continue_on_failure=True)
        .step("after", "s", after=["big"])
        .build()
    )
    config = EngineConfig(max_payload_bytes=100)
    p = tick(spec, RunState(), input={"big": "x" * 200}, config=config)
    assert describe(p)["nodes"] == {"big": "failed", "after": "running"}
    assert describe(p)["new_attempts"] == ["r1:after:1"]


# --- output and needed_outputs -------------------------------------------------------------------


def test_run_output_resolves_literals_inputs_context_and_node_outputs() -> None:
    spec = (
        Workflow("w")
        .step("a", "s")
        .step("b", "s", after=["a"])
        .output(
            {
                "a": "$.nodes.a.output.v",
                "b": "$.nodes.b.output",
                "ctx": "$.context.c",
                "in": ["$.input.id", "lit"],
                "neg": "!$.nodes.b.output",
            }
        )
        .build()
    )
    s = tick(spec, RunState(), input={"id": 9}).state
    s = tick(spec, s, input={"id": 9}, results=[ok("r1:a:1", {"v": "A"})]).state
    assert needed_outputs(spec, s) == {"a": "r1:a:1"}
    p = tick(
        spec,
        s,
        input={"id": 9},
        results=[ok("r1:b:1", 0, patch={"c": "C"})],
        outputs={"a": {"v": "A"}},
    )
    assert p.status == RunStatus.SUCCEEDED
    assert p.output == {"a": "A", "b": 0, "ctx": "C", "in": [9, "lit"], "neg": True}
    assert p.next_wake_at is None


def test_needed_outputs_lists_succeeded_nodes_that_pending_nodes_read() -> None:
    spec = (
        Workflow("w")
        .step("a", "s")
        .step("f", "s")
        .step("k", "s")
        .step(
            "b",
            "s",
            after=["a", "f", "k"],
            when="$.nodes.k.output",
            args={"a": "$.nodes.a.output", "f": "$.nodes.f.output"},
        )
        .step("c", "s", after=["b"])
        .output("$.nodes.c.output")
        .build()
    )
    state = RunState(
        status=RunStatus.RUNNING,
        nodes={
            "a": NodeState(
                status=NodeStatus.SUCCEEDED, generation=2, output=AttemptOutput("r1:a:2")
            ),
            "f": NodeState(status=NodeStatus.FAILED, generation=1),
            "k": NodeState(
                status=NodeStatus.SUCCEEDED, generation=1, output=AttemptOutput("r1:k:1")
            ),
            "b": NodeState(),
            "c": NodeState(),
        },
    )
    assert needed_outputs(spec, state) == {"a": "r1:a:2", "k": "r1:k:1"}
    state.nodes["b"] = NodeState(
        status=NodeStatus.RUNNING, generation=1, work=StepWork(token="r1:b:1")
    )
    assert needed_outputs(spec, state) == {}
    state.nodes["c"] = NodeState(
        status=NodeStatus.SUCCEEDED, generation=1, output=AttemptOutput("r1:c:1")
    )
    assert needed_outputs(spec, state) == {"c": "r1:c:1"}


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def test_arguments_nested_past_the_limit_fail_the_node_as_not_serializable() -> None:
    """An input at the depth limit is accepted; wrapped in an argument dict it is one level
    deeper, and the node fails for its content, not its size."""
    spec = Workflow("w").step("deep", "s", args={"v": "$.input"}).build()
    p = tick(spec, RunState(), input=_nested(100))
    assert p.state.status == RunStatus.FAILED
    assert p.error is not None and p.error["type"] == "PayloadNotSerializable"
    assert "nested deeper than 100 levels" in p.error["message"]


def test_a_run_output_nested_past_the_limit_fails_the_run_and_stores_no_output() -> None:
    spec = Workflow("w").step("a", "s").output({"wrapped": "$.nodes.a.output"}).build()
    started = tick(spec, RunState())
    p = tick(spec, started.state, results=[ok("r1:a:1", output=_nested(100))])
    assert p.state.status == RunStatus.FAILED
    assert p.output is None
    assert p.error is not None and p.error["type"] == "PayloadNotSerializable"
    assert p.error["message"].startswith("run output is not JSON-serializable")


def test_a_run_output_over_the_payload_limit_fails_the_run_as_too_large() -> None:
    spec = (
        Workflow("w")
        .step("a", "s")
        .step("b", "s")
        .output(["$.nodes.a.output", "$.nodes.b.output"])
        .build()
    )
    config = EngineConfig(max_payload_bytes=100)
    first = tick(spec, RunState(), config=config)
    halves = [ok("r1:a:1", output="x" * 60), ok("r1:b:1", output="y" * 60)]
    p = tick(spec, first.state, results=halves, config=config)
    assert p.state.status == RunStatus.FAILED
    assert p.error is not None and p.error["type"] == "PayloadTooLarge"
    assert "run output is" in p.error["message"]


def test_a_result_nested_exactly_to_the_limit_is_accepted_by_the_tick() -> None:
    """The worker accepts a result 100 levels deep; the tick's own guard must too (it once
    checked the output and patch wrapped in a list, one level deeper)."""
    spec = Workflow("w").step("a", "s").output("$.nodes.a.output").build()
    started = tick(spec, RunState())
    p = tick(spec, started.state, results=[ok("r1:a:1", output=_nested(100))])
    assert p.state.status == RunStatus.SUCCEEDED
    assert p.output == _nested(100)
