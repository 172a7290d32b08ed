"""Regressions from the race review: each failed before its fix."""

from __future__ import annotations

from datetime import UTC, datetime

from ductor_celery.definition import Workflow
from ductor_celery.engine import (
    AttemptResult,
    ControlIn,
    RunState,
    RunStatus,
    TickInputs,
    compute_tick,
    needed_outputs,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _two_steps() -> object:
    wf = Workflow("two")
    wf.step("a", "s.a")
    wf.step("b", "s.b", after=["a"], args={"y": "$.nodes.a.output"})
    return wf.build()


def test_cancel_racing_a_finished_attempt_folds_it_instead_of_closing_it() -> None:
    spec = _two_steps()
    started = compute_tick(spec, RunState.initial(["a", "b"]), TickInputs(run_id="r"), NOW)
    token = started.state.nodes["a"].step.token
    assert token is not None
    done = AttemptResult(token=token, node="a", outcome="succeeded", output=1)
    p = compute_tick(
        spec,
        started.state,
        TickInputs(run_id="r", results=(done,), control=ControlIn(id=1, kind="cancel")),
        NOW,
    )
    assert p.state.status == RunStatus.CANCELLED
    # Closing a finished row would conflict on every recompute and wedge the run.
    assert p.closed == []
    assert p.folded == [token]


def test_a_redriven_node_gets_the_outputs_it_reads() -> None:
    spec = _two_steps()
    s1 = compute_tick(spec, RunState.initial(["a", "b"]), TickInputs(run_id="r"), NOW).state
    a_ok = AttemptResult(token="r:a:1", node="a", outcome="succeeded", output={"big": 42})
    s2 = compute_tick(spec, s1, TickInputs(run_id="r", results=(a_ok,)), NOW).state
    b_fail = AttemptResult(
        token="r:b:1", node="b", outcome="failed", retryable=False, error={"message": "no"}
    )
    s3 = compute_tick(spec, s2, TickInputs(run_id="r", results=(b_fail,)), NOW).state
    assert s3.status == RunStatus.FAILED
    # The loader must fetch a's output although b is failed (a redrive makes it pending).
    wanted = needed_outputs(spec, s3)
    assert wanted == {"a": "r:a:1"}
    p = compute_tick(
        spec,
        s3,
        TickInputs(run_id="r", outputs={"a": {"big": 42}}, control=ControlIn(id=2, kind="redrive")),
        NOW,
    )
    assert [(a.node, a.args) for a in p.new_attempts] == [("b", {"y": {"big": 42}})]
