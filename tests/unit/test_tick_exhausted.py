"""RetryPolicy(on_exhausted="pause"): the pure tick pauses the run on a node out of attempts."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import CFG, NOW, RUN, at, err, ok, pure_tick

from ductor_celery.definition import RetryPolicy, Workflow, WorkflowSpec
from ductor_celery.engine import AttemptCheck, NodeStatus, RunState, RunStatus, TickInputs
from ductor_celery.engine.inputs import ControlIn
from ductor_celery.errors import DefinitionError


def _spec(attempts: int = 2, on_exhausted: Any = "pause") -> WorkflowSpec:
    policy = RetryPolicy(max_attempts=attempts, initial_interval=1.0, on_exhausted=on_exhausted)
    return (
        Workflow("w")
        .step("a", "s.a")
        .step("b", "s.b", after=["a"], retry=policy)
        .step("c", "s.c", after=["b"])
        .build()
    )


def _tick(spec: WorkflowSpec, state: RunState, seconds: float = 0, **kw: Any) -> Any:
    return pure_tick(spec, state, TickInputs(run_id=RUN, config=CFG, **kw), at(seconds))


def _run_until_b_exhausted(spec: WorkflowSpec, attempts: int) -> RunState:
    state = _tick(spec, RunState.initial(spec.graph.order)).state
    state = _tick(spec, state, results=(ok(f"{RUN}:a:1", {"x": 1}),)).state
    for n in range(1, attempts + 1):
        p = _tick(spec, state, seconds=60 * n, results=(err(f"{RUN}:b:{n}", "bug"),))
        state = p.state
        if n < attempts:  # the retry timer fires
            state = _tick(spec, state, seconds=60 * n + 30).state
    return state


def test_a_node_out_of_attempts_pauses_the_run_with_the_node_failed_and_its_error_kept() -> None:
    spec = _spec(attempts=2)
    state = _run_until_b_exhausted(spec, 2)
    assert state.status == RunStatus.PAUSED
    b = state.nodes["b"]
    assert b.status == NodeStatus.FAILED and b.step.awaiting_resume
    assert b.error == {"type": "RuntimeError", "message": "bug"}
    assert state.nodes["c"].status == NodeStatus.PENDING
    # Ticks of the paused run change nothing and fail nothing.
    again = _tick(spec, state, seconds=10_000)
    assert again.state.status == RunStatus.PAUSED and not again.changed


def test_resume_reruns_the_node_with_a_fresh_budget_and_the_run_goes_on() -> None:
    spec = _spec(attempts=2)
    state = _run_until_b_exhausted(spec, 2)
    p = _tick(spec, state, seconds=500, control=ControlIn(id=1, kind="resume"))
    assert p.state.status == RunStatus.RUNNING
    b = p.state.nodes["b"]
    assert b.status == NodeStatus.RUNNING and b.step.attempt == 1 and not b.step.awaiting_resume
    assert b.generation == 3  # a new token: a stale worker of attempt 2 cannot land on it
    assert [a.token for a in p.new_attempts] == [f"{RUN}:b:3"]
    assert ("b", "failed", "pending", "resume: fresh retry budget") in [
        (t.node, t.from_status, t.to_status, t.reason) for t in p.transitions
    ]
    done = _tick(spec, p.state, seconds=501, results=(ok(f"{RUN}:b:3", 2),))
    done = _tick(spec, done.state, seconds=502, results=(ok(f"{RUN}:c:1", 3),))
    assert done.state.status == RunStatus.SUCCEEDED


def test_the_default_still_fails_the_run() -> None:
    spec = _spec(attempts=1, on_exhausted="fail")
    state = _run_until_b_exhausted(spec, 1)
    assert state.status == RunStatus.FAILED and not state.nodes["b"].step.awaiting_resume


def test_a_non_retryable_error_fails_the_run_even_under_pause() -> None:
    spec = _spec(attempts=3)
    state = _tick(spec, RunState.initial(spec.graph.order)).state
    state = _tick(spec, state, results=(ok(f"{RUN}:a:1"),)).state
    p = _tick(spec, state, results=(err(f"{RUN}:b:1", "bad", retryable=False),))
    assert p.state.status == RunStatus.FAILED


def test_a_timed_out_last_attempt_pauses_too() -> None:
    spec = _spec(attempts=1)
    state = _tick(spec, RunState.initial(spec.graph.order)).state
    state = _tick(spec, state, results=(ok(f"{RUN}:a:1"),)).state
    token = f"{RUN}:b:1"
    check = AttemptCheck(token=token, claimed_at=NOW, finished=False)
    p = _tick(spec, state, seconds=10_000, checks={token: check})
    assert [c.outcome for c in p.closed] == ["timed_out"]
    assert p.state.status == RunStatus.PAUSED and p.state.nodes["b"].step.awaiting_resume


def test_the_flag_survives_the_stored_state() -> None:
    spec = _spec(attempts=1)
    state = _run_until_b_exhausted(spec, 1)
    assert RunState.from_json(state.to_json()) == state


@given(st.one_of(st.text(max_size=8), st.integers(), st.none(), st.booleans()))
def test_anything_but_fail_or_pause_is_refused_at_decoration(value: Any) -> None:
    if value in ("fail", "pause"):
        assert RetryPolicy(on_exhausted=value).to_spec().on_exhausted == value
        return
    with pytest.raises(DefinitionError, match="on_exhausted"):
        RetryPolicy(on_exhausted=value)


def test_the_default_keeps_the_spec_hash_it_had() -> None:
    # A definition that does not use on_exhausted stores (and hashes) exactly as before.
    assert "on_exhausted" not in _spec(attempts=2, on_exhausted="fail").canonical_json()
    assert '"on_exhausted":"pause"' in _spec(attempts=2).canonical_json()
