"""The pure fire-time rules of schedules (engine/fire_times.py) and the pure side of a delayed
start (engine/delay.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import CFG, NOW

from ductor_celery.definition import Workflow, WorkflowSpec
from ductor_celery.engine import RunState, RunStatus, TickInputs, compute_tick
from ductor_celery.engine.delay import resumed_status, waiting_to_start
from ductor_celery.engine.fire_times import check_cadence, due_fires, fire_id

T0 = datetime(2026, 3, 28, 12, 0, tzinfo=UTC)


def test_every_fires_on_multiples_of_its_period_since_the_epoch() -> None:
    c = check_cadence(None, 300, "UTC")
    assert c.next_after(datetime(2026, 1, 1, 0, 7, 30, tzinfo=UTC)) == datetime(
        2026, 1, 1, 0, 10, tzinfo=UTC
    )
    at = datetime(2026, 1, 1, 0, 10, tzinfo=UTC)
    assert c.next_after(at) == at + timedelta(minutes=5), "strictly after"


@given(
    st.floats(min_value=1, max_value=86400 * 30),
    st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1)),  # noqa: DTZ001
)
def test_every_next_after_is_the_first_later_multiple(every: float, naive: datetime) -> None:
    after = naive.replace(tzinfo=UTC)
    found = check_cadence(None, every, "UTC").next_after(after)
    step = timedelta(microseconds=round(every * 1_000_000))
    assert after < found <= after + step


def test_cron_fires_at_wall_clock_time_of_its_time_zone_across_dst() -> None:
    c = check_cadence("0 9 * * *", None, "Europe/Paris")
    before = c.next_after(datetime(2026, 3, 28, 12, 0, tzinfo=UTC))  # Saturday, UTC+1
    after = c.next_after(before)  # Sunday: DST began at 02:00, UTC+2
    assert before == datetime(2026, 3, 29, 7, 0, tzinfo=UTC)
    assert after == datetime(2026, 3, 30, 7, 0, tzinfo=UTC)
    assert before.tzinfo == UTC


def test_due_fires_catches_up_within_the_window_and_counts_the_rest_missed() -> None:
    c = check_cadence(None, 60, "UTC")
    due = due_fires(c, T0 - timedelta(hours=1), T0, catchup_window=300)
    assert due.fires == tuple(T0 - timedelta(minutes=m) for m in (5, 4, 3, 2, 1, 0))
    assert due.missed == 55
    assert due.next_fire_at == T0 + timedelta(minutes=1)


def test_due_fires_is_bounded_per_pass_and_resumes_where_it_stopped() -> None:
    c = check_cadence(None, 1, "UTC")
    due = due_fires(c, T0 - timedelta(seconds=250), T0, catchup_window=3600, limit=100)
    assert len(due.fires) == 100 and due.missed == 0
    assert due.next_fire_at == T0 - timedelta(seconds=150)
    rest = due_fires(c, due.next_fire_at, T0, catchup_window=3600, limit=1000)
    assert len(rest.fires) == 151 and rest.next_fire_at == T0 + timedelta(seconds=1)


def test_nothing_is_due_before_the_next_fire_time() -> None:
    c = check_cadence("*/5 * * * *", None, "UTC")
    due = due_fires(c, T0 + timedelta(minutes=5), T0, catchup_window=300)
    assert due.fires == () and due.next_fire_at == T0 + timedelta(minutes=5)


def test_fire_ids_name_the_fire_time_in_utc() -> None:
    paris = check_cadence("0 9 * * *", None, "Europe/Paris").next_after(T0)
    assert fire_id("nightly", paris) == "nightly@2026-03-29T07:00:00+00:00"


@pytest.mark.parametrize(
    ("cron", "every", "tz", "words"),
    [
        ("*/0 * * * *", None, "UTC", "bad cron"),
        ("", None, "UTC", "bad cron"),
        ("R R * * *", None, "UTC", "random"),
        (5, None, "UTC", "cron must be a string"),
        ("0 2 * * *", None, "", "unknown time zone"),
        ("0 2 * * *", None, 3, "timezone must be a string"),
        (None, float("inf"), "UTC", "finite"),
        (None, 10**30, "UTC", "at most"),
    ],
)
def test_bad_cadences(cron: object, every: object, tz: object, words: str) -> None:
    with pytest.raises((ValueError, TypeError), match=words):
        check_cadence(cron, every, tz)


def _spec() -> WorkflowSpec:
    return Workflow("d").step("a", "s").build()


def test_a_delayed_run_waits_for_its_start_and_then_starts() -> None:
    spec = _spec()
    later = NOW + timedelta(minutes=10)
    state = RunState.initial(["a"], start_at=later)
    assert RunState.from_json(state.to_json()) == state
    early = compute_tick(spec, state, TickInputs(run_id="r1", config=CFG), NOW)
    assert not early.changed and early.next_wake_at == later
    assert early.state.status == RunStatus.PENDING and early.new_attempts == []
    due = compute_tick(spec, state, TickInputs(run_id="r1", config=CFG), later)
    assert due.state.status == RunStatus.RUNNING and len(due.new_attempts) == 1


def test_resume_of_a_run_paused_before_its_start_goes_back_to_pending() -> None:
    state = RunState(status=RunStatus.PAUSED, start_at=NOW + timedelta(seconds=1))
    assert resumed_status(state, NOW) == RunStatus.PENDING
    assert resumed_status(state, NOW + timedelta(seconds=1)) == RunStatus.RUNNING
    assert not waiting_to_start(RunState(status=RunStatus.PENDING), NOW)
