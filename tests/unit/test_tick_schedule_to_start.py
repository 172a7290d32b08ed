"""schedule_to_start_timeout (issue 14 item 3): an attempt not claimed in time, because no
worker took its message or because it waited for a concurrency lease, times out and retries."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from support import FakeStep

from ductor_celery.definition import RetryPolicy, Workflow
from ductor_celery.definition.spec import StepNodeSpec
from ductor_celery.engine import AttemptCheck, EngineConfig, RunState, TickInputs, compute_tick
from ductor_celery.engine.inputs import TickPayload
from ductor_celery.errors import DefinitionError

T0 = datetime(2026, 1, 1, tzinfo=UTC)
CFG = EngineConfig(resend_unclaimed_after=30.0, default_step_timeout=300.0)


def _step(sts: float | None = 10.0, attempts: int = 2) -> FakeStep:
    return FakeStep(
        "s.q",
        RetryPolicy(max_attempts=attempts, initial_interval=1.0),
        schedule_to_start_timeout=sts,
    )


def _spec(step: FakeStep) -> object:
    wf = Workflow("sts")
    wf.step("a", step)
    return wf.build()


def _tick(spec: object, state: RunState, now: datetime, **checks: AttemptCheck) -> TickPayload:
    inputs = TickInputs(run_id="r", checks={c.token: c for c in checks.values()}, config=CFG)
    return compute_tick(spec, RunState.from_json(state.to_json()), inputs, now)  # type: ignore[arg-type]


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_it_is_part_of_the_spec_only_when_set_and_sets_the_first_look() -> None:
    spec = _spec(_step())
    node = spec.nodes[0]  # type: ignore[attr-defined]
    assert isinstance(node, StepNodeSpec) and node.schedule_to_start_timeout == 10.0
    plain = _spec(_step(None))
    assert "schedule_to_start_timeout" not in plain.model_dump(mode="json")["nodes"][0]  # type: ignore[attr-defined]
    p = _tick(spec, RunState(), T0)
    ns = p.state.nodes["a"]
    assert ns.step.queued_until == _at(10) and ns.step.check_at == _at(10)


@pytest.mark.parametrize(("lease_waiting", "why"), [(False, "no worker"), (True, "lease")])
def test_an_attempt_not_claimed_in_time_times_out_and_retries(
    lease_waiting: bool, why: str
) -> None:
    spec = _spec(_step())
    s0 = _tick(spec, RunState(), T0).state
    check = AttemptCheck("r:a:1", claimed_at=None, finished=False, lease_waiting=lease_waiting)
    p = _tick(spec, s0, _at(10), c=check)
    assert [(c.token, c.outcome) for c in p.closed] == [("r:a:1", "timed_out")]
    error = p.closed[0].error
    assert error["type"] == "ScheduleToStartTimeout" and why in error["message"]
    ns = p.state.nodes["a"]
    assert ns.status == "running" and ns.step.token is None and ns.step.retry_at == _at(11)
    retried = _tick(spec, p.state, _at(11))
    assert [a.token for a in retried.new_attempts] == ["r:a:2"]
    assert retried.state.nodes["a"].step.queued_until == _at(21)


def test_the_last_attempt_not_started_in_time_fails_the_node() -> None:
    spec = _spec(_step(attempts=1))
    s0 = _tick(spec, RunState(), T0).state
    check = AttemptCheck("r:a:1", claimed_at=None, finished=False)
    p = _tick(spec, s0, _at(10), c=check)
    assert p.state.nodes["a"].status == "failed"
    assert p.state.status == "failed"


def test_an_attempt_claimed_in_time_is_left_to_its_start_to_close_timeout() -> None:
    spec = _spec(_step())
    s0 = _tick(spec, RunState(), T0).state
    check = AttemptCheck("r:a:1", claimed_at=_at(5), finished=False)
    p = _tick(spec, s0, _at(10), c=check)
    assert p.closed == []
    ns = p.state.nodes["a"]
    assert ns.step.queued_until is None and ns.step.check_at == _at(305)


def test_without_it_an_unclaimed_message_is_only_re_sent() -> None:
    spec = _spec(_step(None))
    s0 = _tick(spec, RunState(), T0).state
    check = AttemptCheck("r:a:1", claimed_at=None, finished=False)
    p = _tick(spec, s0, _at(30), c=check)
    assert p.closed == [] and [d.token for d in p.dispatches] == ["r:a:1"]


@pytest.mark.parametrize("bad", [0, -1, float("inf"), "30s"])
def test_a_bad_schedule_to_start_timeout_is_refused(bad: object) -> None:
    from celery import Celery

    from ductor_celery import Ductor

    d = Ductor(Celery("sts", set_as_current=False), database_url="sqlite://")
    with pytest.raises(DefinitionError, match="schedule_to_start_timeout"):

        @d.step(name="s.bad", schedule_to_start_timeout=bad)  # type: ignore[arg-type]
        def bad_step(ctx: object) -> None: ...
