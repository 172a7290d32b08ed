"""Cooperative cancel (issue 14 item 5), on the pure tick: attempts in flight are asked to
stop and get ``cancel_grace`` to do so; terminate closes at once and kills."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from ductor_celery.definition import RetryPolicy, Workflow
from ductor_celery.engine import AttemptResult, ControlIn, EngineConfig, RunState, TickInputs
from ductor_celery.engine import compute_tick as pure_tick
from ductor_celery.engine.inputs import TickPayload
from ductor_celery.engine.kinds import DispatchKind
from ductor_celery.engine.status import RunStatus

T0 = datetime(2026, 1, 1, tzinfo=UTC)
CFG = EngineConfig(resend_unclaimed_after=30.0, cancel_grace=10.0)
SPEC = (
    Workflow("c")
    .step("a", "s", retry=RetryPolicy(max_attempts=3, initial_interval=1.0))
    .step("b", "s", after=["a"])
    .build()
)


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _tick(
    state: RunState,
    now: datetime,
    *,
    results: tuple[AttemptResult, ...] = (),
    control: ControlIn | None = None,
    config: EngineConfig = CFG,
) -> TickPayload:
    roundtripped = RunState.from_json(state.to_json())  # as the store reloads it
    inputs = TickInputs(run_id="r", results=results, control=control, config=config)
    return pure_tick(SPEC, roundtripped, inputs, now)


def _cancelling() -> TickPayload:
    started = _tick(RunState(), T0).state
    return _tick(started, _at(1), control=ControlIn(id=1, kind="cancel", reason="ops"))


def _result(outcome: str, token: str = "r:a:1") -> AttemptResult:
    error = None if outcome == "succeeded" else {"type": "StepCancelled", "message": "stop"}
    return AttemptResult(token=token, node="a", outcome=outcome, output=1, error=error)


def test_a_cancel_with_an_attempt_in_flight_asks_it_to_stop_and_waits() -> None:
    p = _cancelling()
    assert p.state.status == RunStatus.RUNNING
    assert p.state.cancel == {"reason": "cancel: ops", "grace_until": _at(11).isoformat()}
    assert p.cancel_requested == ["r:a:1"]
    assert p.closed == [] and p.dispatches == []
    assert p.next_wake_at == _at(11)
    assert "cancel requested" in p.transitions[-1].reason


def test_an_attempt_that_stops_on_the_cancel_ends_the_run_cancelled_without_retry() -> None:
    p = _tick(_cancelling().state, _at(3), results=(_result("cancelled"),))
    assert p.state.status == RunStatus.CANCELLED
    assert p.state.nodes["a"].status == "cancelled"
    assert p.state.nodes["b"].status == "pending"
    assert p.closed == [] and p.new_attempts == []
    assert p.folded == ["r:a:1"]
    assert p.error == {"type": "Cancel", "message": "cancel: ops"}
    assert p.state.cancel is None and p.next_wake_at is None


def test_past_the_grace_a_running_attempt_is_closed_and_revoked_without_killing() -> None:
    waiting = _tick(_cancelling().state, _at(10))
    assert waiting.state.status == RunStatus.RUNNING and waiting.closed == []
    p = _tick(waiting.state, _at(11))
    assert p.state.status == RunStatus.CANCELLED
    assert [(c.token, c.outcome) for c in p.closed] == [("r:a:1", "cancelled")]
    revokes = [d for d in p.dispatches if d.kind == DispatchKind.REVOKE]
    assert [(d.token, d.terminate) for d in revokes] == [("r:a:1", False)]
    assert "still running after the grace" in p.transitions[-1].reason


def test_a_success_during_the_grace_is_kept_and_nothing_new_starts() -> None:
    p = _tick(_cancelling().state, _at(2), results=(_result("succeeded"),))
    assert p.state.nodes["a"].status == "succeeded"
    assert p.state.nodes["b"].status == "pending"  # its dependency finished, yet it never starts
    assert p.new_attempts == []
    assert p.state.status == RunStatus.CANCELLED


def test_a_failure_during_the_grace_fires_no_retry() -> None:
    failed = AttemptResult(token="r:a:1", node="a", outcome="failed", error={"message": "x"})
    p = _tick(_cancelling().state, _at(2), results=(failed,))
    assert p.new_attempts == []
    assert p.state.status == RunStatus.CANCELLED
    assert p.state.nodes["a"].status == "cancelled" and p.state.nodes["a"].step.retry_at is None


def test_terminate_during_the_grace_closes_and_kills_at_once() -> None:
    p = _tick(_cancelling().state, _at(2), control=ControlIn(id=2, kind="terminate"))
    assert p.state.status == RunStatus.TERMINATED
    assert p.state.cancel is None
    assert [(d.token, d.terminate) for d in p.dispatches] == [("r:a:1", True)]


def test_a_second_cancel_keeps_the_first_grace() -> None:
    p = _tick(_cancelling().state, _at(5), control=ControlIn(id=2, kind="cancel"))
    assert p.state.cancel is not None
    assert p.state.cancel["grace_until"] == _at(11).isoformat()
    assert p.cancel_requested == []


def test_without_anything_in_flight_or_without_a_grace_cancel_closes_at_once() -> None:
    started = _tick(RunState(), T0).state
    immediate = EngineConfig(cancel_grace=0)
    p = _tick(started, _at(1), control=ControlIn(id=1, kind="cancel"), config=immediate)
    assert p.state.status == RunStatus.CANCELLED
    assert [(d.token, d.terminate) for d in p.dispatches] == [("r:a:1", False)]
    pending = _tick(RunState(), T0, control=ControlIn(id=1, kind="cancel"))
    assert pending.state.status == RunStatus.CANCELLED


def test_step_cancelled_outside_a_cancel_fails_the_node_without_retry() -> None:
    started = _tick(RunState(), T0).state
    p = _tick(started, _at(1), results=(_result("cancelled"),))
    assert p.state.nodes["a"].status == "failed"
    assert p.state.nodes["a"].error == {"type": "StepCancelled", "message": "stop"}
    assert p.new_attempts == []
    assert p.state.status == RunStatus.FAILED


def test_a_scatter_waits_for_its_branches_and_starts_no_new_one() -> None:
    wf = Workflow("sc")
    wf.scatter("each", "s.x", over="$.input", max_parallel=3)
    spec = wf.build()

    def step(state: RunState, now: datetime, **kw: object) -> TickPayload:
        inputs = TickInputs(run_id="r", input=[1, 2, 3, 4], config=CFG, **kw)  # type: ignore[arg-type]
        return pure_tick(spec, RunState.from_json(state.to_json()), inputs, now)

    p = step(RunState(), T0)
    tokens = [a.token for a in p.new_attempts]
    p = step(p.state, _at(1), control=ControlIn(id=1, kind="cancel"))
    assert p.state.status == RunStatus.RUNNING and p.cancel_requested == tokens
    stopped = AttemptResult(token=tokens[0], node="each", outcome="cancelled", branch=0)
    done = AttemptResult(token=tokens[1], node="each", outcome="succeeded", output=5, branch=1)
    p = step(p.state, _at(2), results=(stopped, done))
    assert p.state.status == RunStatus.RUNNING
    assert p.new_attempts == []  # the fourth item never starts
    last = AttemptResult(token=tokens[2], node="each", outcome="cancelled", branch=2)
    p = step(p.state, _at(3), results=(last,))
    assert p.state.status == RunStatus.CANCELLED and p.closed == []
    assert p.state.nodes["each"].status == "cancelled"
