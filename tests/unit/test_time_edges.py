"""Issue 22 item 7, the pure side: the tick's time arithmetic and a schedule's fire times are
total at the end of the calendar.

Bounded inputs keep real runs far from year 9999 (``start_at`` and every duration at most ten
years, the harness clock before ``limits.LATEST_NOW``); these tests push ``now`` and the
settings past those bounds anyway and check that a tick still returns a payload, its timers
saturating at ``limits.LATEST`` instead of raising ``OverflowError`` on every tick.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import FakeStep

from ductor_celery.definition import RetryPolicy, Workflow
from ductor_celery.engine import AttemptResult, ControlIn, EngineConfig, RunState, TickInputs
from ductor_celery.engine import compute_tick as pure_tick
from ductor_celery.engine.fire_times import Cadence, check_cadence, due_fires
from ductor_celery.engine.inputs import AttemptCheck, TickPayload
from ductor_celery.engine.state import StepWork
from ductor_celery.engine.status import RunStatus
from ductor_celery.limits import LATEST, MAX_DURATION_S, later
from ductor_celery.settings import Settings

TEN_YEARS = MAX_DURATION_S
#: An hour before datetime.max: past LATEST, where every "now + seconds" overflows.
THE_END = datetime(9999, 12, 31, 23, tzinfo=UTC)
NEAR_THE_END = LATEST - timedelta(seconds=1)


def _spec() -> object:
    wf = Workflow("edge", deadline=TEN_YEARS)
    wf.step(
        "a",
        FakeStep(
            "s.long",
            RetryPolicy(max_attempts=5, initial_interval=TEN_YEARS, max_interval=TEN_YEARS),
            timeout=TEN_YEARS,
            heartbeat_timeout=TEN_YEARS,
            schedule_to_start_timeout=TEN_YEARS,
        ),
    )
    wf.sleep("nap", seconds=TEN_YEARS)
    wf.wait_signal("go", signal="go", timeout=TEN_YEARS, on_timeout="continue")
    wf.step("b", FakeStep("s.b"), after=["nap", "go"])
    return wf.build()


SPEC = _spec()
#: Every duration of the engine's own settings past ten years, as a bad config would give.
HUGE = EngineConfig(
    resend_unclaimed_after=1e300,
    default_step_timeout=1e300,
    child_poll_after=1e300,
    cancel_grace=1e300,
)


def _tick(
    state: RunState,
    now: datetime,
    *,
    config: EngineConfig = HUGE,
    results: tuple[AttemptResult, ...] = (),
    checks: dict[str, AttemptCheck] | None = None,
    control: ControlIn | None = None,
) -> TickPayload:
    roundtripped = RunState.from_json(state.to_json())  # as the store reloads it
    inputs = TickInputs(
        run_id="r", results=results, checks=checks or {}, control=control, config=config
    )
    return pure_tick(SPEC, roundtripped, inputs, now)  # type: ignore[arg-type]


def _timers(p: TickPayload) -> list[datetime]:
    found = [p.next_wake_at] if p.next_wake_at is not None else []
    for ns in p.state.nodes.values():
        if ns.deadline is not None:
            found.append(ns.deadline)
        for name in ("check_at", "retry_at", "resend_at", "queued_until"):
            value = getattr(ns.work, name, None)
            if isinstance(value, datetime):
                found.append(value)
    return found


def _work(state: RunState, node: str = "a") -> StepWork:
    work = state.nodes[node].work
    assert isinstance(work, StepWork)
    return work


def test_later_adds_exactly_and_saturates_instead_of_raising() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    assert later(t0, 90.5) == t0 + timedelta(seconds=90.5)
    assert later(t0, TEN_YEARS) == t0 + timedelta(seconds=TEN_YEARS)
    for huge in (1e300, 1e20, math.inf, math.nan, 10**400):
        assert later(t0, huge) == LATEST
    assert later(NEAR_THE_END, 10) == LATEST
    # A clock already past LATEST: the time stays where it is (due), never goes back.
    assert later(THE_END, 3600) == THE_END
    assert later(datetime(1, 1, 1, tzinfo=UTC), -1e300) == datetime(1, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize("now", [NEAR_THE_END, LATEST, THE_END])
def test_a_tick_at_the_end_of_the_calendar_returns_a_payload(now: datetime) -> None:
    """Before: the first tick of a run at such a time raised OverflowError (now + the step's
    timeout), and so did every tick after it. From LATEST on, a saturated timer is due at
    once (the run moves on as time allows); before it, timers land on LATEST."""
    bound = max(now, LATEST)
    started = _tick(RunState.initial(list(SPEC.graph.order)), now)  # type: ignore[attr-defined]
    assert started.state.status == RunStatus.RUNNING
    assert "a" in [a.node for a in started.new_attempts]
    assert all(t <= bound for t in _timers(started))
    state = started.state
    # Unclaimed and due for a re-send many doublings in: the re-send time saturates.
    work = _work(state)
    work.check_at = work.resend_at = now
    work.resends = 5000
    unclaimed = AttemptCheck(token="r:a:1", claimed_at=None, finished=False)
    checked = _tick(state, now, checks={"r:a:1": unclaimed})
    assert all(t <= bound for t in _timers(checked))
    # Claimed: the start-to-close and heartbeat deadlines saturate.
    claimed = AttemptCheck(token="r:a:1", claimed_at=now, finished=False)
    assert all(t <= bound for t in _timers(_tick(state, now, checks={"r:a:1": claimed})))
    # A failure schedules a retry ten years on.
    error = {"type": "E", "message": "x"}
    failure = AttemptResult(token="r:a:1", node="a", outcome="failed", error=error)
    failed = _tick(state, now, results=(failure,))
    assert all(t <= bound for t in _timers(failed))
    # A cancel with an attempt in flight: its grace ends at the saturated time.
    cancelling = _tick(state, now, control=ControlIn(id=1, kind="cancel", reason="ops"))
    if now < LATEST:
        assert _work(checked.state).resends == 5001
        assert _work(failed.state).retry_at == LATEST
        assert cancelling.state.cancel is not None
        assert datetime.fromisoformat(cancelling.state.cancel["grace_until"]) == LATEST


@given(
    st.datetimes(
        min_value=datetime(9000, 1, 1),  # noqa: DTZ001 - hypothesis takes naive bounds
        max_value=datetime(9999, 12, 31, 23, 59, 59),  # noqa: DTZ001
        timezones=st.just(UTC),
    ),
    st.one_of(st.floats(min_value=0, allow_infinity=True), st.just(math.nan)),
)
def test_the_first_tick_never_raises_whatever_the_clock_and_the_settings(
    now: datetime, seconds: float
) -> None:
    config = EngineConfig(
        resend_unclaimed_after=seconds,
        default_step_timeout=seconds,
        child_poll_after=seconds,
        cancel_grace=seconds,
    )
    p = _tick(RunState.initial(list(SPEC.graph.order)), now, config=config)  # type: ignore[attr-defined]
    assert p.state.status == RunStatus.RUNNING


def test_a_cron_whose_year_field_ran_out_fires_never_instead_of_raising() -> None:
    cadence = check_cadence("0 0 1 1 * 0 2020", None, "UTC")  # fired once, on 2020-01-01
    fire = datetime(2020, 1, 1, tzinfo=UTC)
    assert cadence.next_after(fire - timedelta(days=1)) == fire
    assert cadence.next_after(fire) == LATEST
    # The sweeper fires the last time and then leaves the row alone (before: croniter's
    # error on every pass, which also stopped every schedule after it in that pass).
    due = due_fires(cadence, fire, fire + timedelta(seconds=5), catchup_window=300)
    assert due.fires == (fire,) and due.next_fire_at == LATEST
    with pytest.raises(ValueError, match=r"'0 0 1 1 \* 0 2020' has no fire time after"):
        cadence.next_fire(fire, "schedule 'over'")


def test_a_period_near_the_end_of_the_calendar_saturates() -> None:
    every = Cadence(cron=None, every=TEN_YEARS)
    assert every.next_after(THE_END) == LATEST
    assert every.next_after(datetime(2026, 1, 1, tzinfo=UTC)) < LATEST


@pytest.mark.parametrize(
    ("key", "value"),
    [
        # The sweeper computed "now - retention_days" on every pass: 1e12 days overflowed it.
        ("ductor_retention_days", 1e12),
        ("ductor_retention_days", 3651),
        ("ductor_cancel_grace", 1e300),
        ("ductor_cancel_grace", MAX_DURATION_S + 1),
    ],
)
def test_time_settings_past_ten_years_name_the_setting(key: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"{key} must be .*ten years"):
        Settings.from_conf({key: value})


def test_time_settings_of_ten_years_are_kept() -> None:
    settings = Settings.from_conf(
        {"ductor_retention_days": 3650, "ductor_cancel_grace": MAX_DURATION_S}
    )
    assert settings.retention_days == 3650 and settings.cancel_grace == MAX_DURATION_S
