"""Run deadlines (issue 14 item 2): past ``deadline_at`` an open run ends ``timed_out``,
its attempts closed and revoked as on terminate, its children closed by their policy."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from support import FakeStep

from ductor_celery.definition import RetryPolicy, Workflow
from ductor_celery.engine import RunState, TickInputs, compute_tick
from ductor_celery.engine.kinds import CONTROL_ALLOWED, ControlKind, DispatchKind
from ductor_celery.engine.status import TERMINAL_RUN_STATUSES, RunStatus
from ductor_celery.errors import DefinitionError

T0 = datetime(2026, 1, 1, tzinfo=UTC)
STEP = FakeStep("s.slow", RetryPolicy(max_attempts=3), timeout=3600.0)


def _spec(deadline: float | None = None) -> object:
    wf = Workflow("dl", deadline=deadline)
    wf.step("a", STEP)
    wf.step("b", STEP, after=["a"])
    return wf.build()


def _started(deadline_at: datetime) -> RunState:
    spec = _spec()
    state = RunState.initial(["a", "b"], deadline_at=deadline_at)
    return compute_tick(spec, state, TickInputs(run_id="r"), T0).state


def test_the_earliest_of_deadline_and_checks_is_the_timer() -> None:
    for seconds in (5, 60):  # before and after the attempt's first look (the 30 s re-send)
        deadline = T0 + timedelta(seconds=seconds)
        p = compute_tick(
            _spec(), RunState.initial(["a", "b"], deadline_at=deadline), TickInputs(run_id="r"), T0
        )
        assert p.state.status == RunStatus.RUNNING
        assert p.next_wake_at == min(deadline, T0 + timedelta(seconds=30))


def test_past_its_deadline_a_run_times_out_closing_and_killing_its_attempts() -> None:
    deadline = T0 + timedelta(seconds=60)
    state = _started(deadline)
    p = compute_tick(_spec(), state, TickInputs(run_id="r"), deadline)
    assert p.state.status == RunStatus.TIMED_OUT
    assert p.state.nodes["a"].status == "cancelled"
    assert p.state.nodes["b"].status == "pending"
    assert [(c.token, c.outcome) for c in p.closed] == [("r:a:1", "cancelled")]
    revokes = [d for d in p.dispatches if d.kind == DispatchKind.REVOKE]
    assert [(d.token, d.terminate) for d in revokes] == [("r:a:1", True)]
    assert p.error is not None and p.error["type"] == "RunTimeout"
    assert p.next_wake_at is None
    assert (None, "running", "timed_out") in [
        (tr.node, tr.from_status, tr.to_status) for tr in p.transitions
    ]


def test_a_run_before_its_deadline_is_left_alone() -> None:
    deadline = T0 + timedelta(seconds=60)
    state = _started(deadline)
    p = compute_tick(_spec(), state, TickInputs(run_id="r"), deadline - timedelta(seconds=1))
    assert p.state.status == RunStatus.RUNNING
    assert p.closed == []


def test_a_paused_run_times_out_too() -> None:
    deadline = T0 + timedelta(seconds=60)
    state = _started(deadline)
    state.status = RunStatus.PAUSED
    p0 = compute_tick(_spec(), state, TickInputs(run_id="r"), T0 + timedelta(seconds=1))
    assert p0.next_wake_at is not None and p0.next_wake_at <= deadline
    p = compute_tick(_spec(), state, TickInputs(run_id="r"), deadline)
    assert p.state.status == RunStatus.TIMED_OUT


def test_timed_out_is_terminal_and_can_be_redriven() -> None:
    assert RunStatus.TIMED_OUT in TERMINAL_RUN_STATUSES
    assert CONTROL_ALLOWED[RunStatus.TIMED_OUT] == frozenset({ControlKind.REDRIVE})


def test_the_state_keeps_its_deadline_through_json() -> None:
    deadline = T0 + timedelta(seconds=60)
    state = _started(deadline)
    assert RunState.from_json(state.to_json()).deadline_at == deadline
    assert "deadline_at" not in RunState().to_json()


def test_a_workflow_deadline_is_part_of_its_spec_only_when_set() -> None:
    assert _spec(3600).deadline == 3600
    assert "deadline" not in _spec().model_dump(mode="json")
    assert _spec().spec_hash != _spec(3600).spec_hash


@pytest.mark.parametrize("bad", [0, -5, float("inf"), float("nan"), "1h", True])
def test_a_bad_workflow_deadline_is_refused(bad: object) -> None:
    with pytest.raises(DefinitionError, match="deadline"):
        Workflow("dl", deadline=bad)  # type: ignore[arg-type]


def test_a_redrive_past_the_deadline_drops_it_and_runs_again() -> None:
    from ductor_celery.engine import ControlIn

    deadline = T0 + timedelta(seconds=60)
    timed_out = compute_tick(_spec(), _started(deadline), TickInputs(run_id="r"), deadline).state
    assert timed_out.status == RunStatus.TIMED_OUT
    later = deadline + timedelta(seconds=5)
    control = ControlIn(id=1, kind=ControlKind.REDRIVE)
    p = compute_tick(_spec(), timed_out, TickInputs(run_id="r", control=control), later)
    assert p.state.status == RunStatus.RUNNING
    assert p.state.deadline_at is None
    assert [a.token for a in p.new_attempts] == ["r:a:2"]
