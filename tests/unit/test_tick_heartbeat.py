"""heartbeat_timeout: an attempt silent for longer than it is declared lost and retried."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from support import FakeStep

from ductor_celery.definition import RetryPolicy, Workflow
from ductor_celery.definition.spec import StepNodeSpec
from ductor_celery.engine import AttemptCheck, RunState, TickInputs, compute_tick

T0 = datetime(2026, 1, 1, tzinfo=UTC)


STEP = FakeStep(
    "s.beat",
    RetryPolicy(max_attempts=3, initial_interval=1.0),
    timeout=300.0,
    heartbeat_timeout=10.0,
)


def _spec() -> object:
    wf = Workflow("hb")
    wf.step("a", STEP)
    return wf.build()


def test_heartbeat_timeout_is_part_of_the_spec_and_sets_the_first_look() -> None:
    spec = _spec()
    node = spec.nodes[0]
    assert isinstance(node, StepNodeSpec) and node.heartbeat_timeout == 10.0
    p = compute_tick(spec, RunState(), TickInputs(run_id="r"), T0)
    assert p.state.nodes["a"].step.check_at == T0 + timedelta(seconds=10)


def test_a_fresh_heartbeat_moves_the_deadline_and_silence_loses_the_attempt() -> None:
    spec = _spec()
    s0 = compute_tick(spec, RunState(), TickInputs(run_id="r"), T0).state
    claimed = T0 + timedelta(seconds=1)
    beat = T0 + timedelta(seconds=9)
    at_10 = T0 + timedelta(seconds=10)
    check = AttemptCheck("r:a:1", claimed_at=claimed, finished=False, heartbeat_at=beat)
    p1 = compute_tick(spec, s0, TickInputs(run_id="r", checks={"r:a:1": check}), at_10)
    assert p1.closed == []
    assert p1.state.nodes["a"].step.check_at == beat + timedelta(seconds=10)
    at_20 = T0 + timedelta(seconds=20)
    p2 = compute_tick(spec, p1.state, TickInputs(run_id="r", checks={"r:a:1": check}), at_20)
    assert [(c.token, c.outcome) for c in p2.closed] == [("r:a:1", "timed_out")]
    assert "sent no heartbeat for 10s" in p2.closed[0].error["message"]
    assert p2.state.nodes["a"].step.retry_at == at_20 + timedelta(seconds=1)


def test_without_heartbeats_the_claim_time_counts_as_the_last_sign_of_life() -> None:
    spec = _spec()
    s0 = compute_tick(spec, RunState(), TickInputs(run_id="r"), T0).state
    check = AttemptCheck("r:a:1", claimed_at=T0, finished=False)
    p = compute_tick(
        spec, s0, TickInputs(run_id="r", checks={"r:a:1": check}), T0 + timedelta(seconds=10)
    )
    assert [c.outcome for c in p.closed] == ["timed_out"]
