"""Issue 14 item 4: schedules are rows fired by the sweeper. One run per fire time even with
two sweepers racing, catch-up within the window after downtime, the overlap policies,
pause/resume, trigger, and bad definitions writing nothing."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from ductor_celery import Ductor, RunStatus, ScheduleNotFound, StepContext, Workflow
from ductor_celery.errors import WorkflowNotFound
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store import schedules
from ductor_celery.store.db import db_now
from ductor_celery.store.migrate import upgrade
from ductor_celery.store.schema import workflow_run, workflow_schedule


def _make(url: str, name: str) -> Ductor:
    app = Celery(name, broker="memory://", set_as_current=False)
    app.conf.ductor_eager_ticks = False
    d = Ductor(app, database_url=url)

    @d.step(name="sched.echo")
    def echo(ctx: StepContext, value: Any = None) -> Any:
        return value

    wf = Workflow("report")
    wf.wait_signal("hold", signal="go")  # keeps a run open until the test says so
    d.register(wf)
    d.runtime.dispatcher.wake = lambda run_id: None  # type: ignore[method-assign]
    d.runtime.dispatcher.first_tick = lambda run_id: None  # type: ignore[method-assign]
    d.runtime.dispatcher.wake_many = lambda run_ids: None  # type: ignore[method-assign]
    return d


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        found = f"sqlite:///{tmp_path}/sched.sqlite3"
        upgrade(found)
        return found
    value: str = request.getfixturevalue("database_url")
    return value


@pytest.fixture
def ductor(url: str) -> Ductor:
    return _make(url, f"sched{id(url)}")


def _set_next(d: Ductor, name: str, when: datetime) -> None:
    with d.runtime.engine().begin() as conn:
        conn.execute(
            sa.update(workflow_schedule)
            .where(workflow_schedule.c.name == name)
            .values(next_fire_at=when)
        )


def _runs(d: Ductor, name: str) -> list[str]:
    with d.runtime.engine().connect() as conn:
        return sorted(
            conn.execute(
                sa.select(workflow_run.c.workflow_id).where(
                    workflow_run.c.workflow_id.like(f"{name}@%")
                )
            ).scalars()
        )


def _fire_time(workflow_id: str) -> datetime:
    return datetime.fromisoformat(workflow_id.split("@", 1)[1])


def _count(d: Ductor, table: sa.Table) -> int:
    with d.runtime.engine().connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def test_define_list_and_replace(ductor: Ductor) -> None:
    before = datetime.now(UTC)
    view = ductor.schedule("nightly", workflow="report", cron="0 2 * * *", timezone="Europe/Paris")
    assert view.name == "nightly" and view.workflow == "report" and view.cron == "0 2 * * *"
    assert view.every is None and view.overlap == "skip" and view.paused is False
    assert view.next_fire_at is not None and view.next_fire_at > before
    # 02:00 in Paris is 01:00 or 00:00 UTC, whatever the season.
    assert view.next_fire_at.astimezone(UTC).hour in (0, 1)
    ductor.schedule("nightly", workflow="report", every=300, input={"x": 1}, overlap="allow")
    (only,) = ductor.list_schedules()
    assert only.cron is None and only.every == 300 and only.overlap == "allow"
    assert only.input == {"x": 1}
    assert only.next_fire_at is not None
    assert only.next_fire_at.timestamp() % 300 == 0
    ductor.unschedule("nightly")
    assert ductor.list_schedules() == []
    with pytest.raises(ScheduleNotFound):
        ductor.unschedule("nightly")


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"cron": "not a cron"}, ValueError, "bad cron expression"),
        ({"cron": "61 * * * *"}, ValueError, "bad cron expression"),
        ({"cron": "0 0 30 2 *"}, ValueError, "never fires"),
        ({"cron": "0 2 * * *", "timezone": "Mars/Olympus"}, ValueError, "unknown time zone"),
        ({"cron": "0 2 * * *", "timezone": "../../etc/passwd"}, ValueError, "unknown time zone"),
        ({"every": 0.5}, ValueError, "at least 1 second"),
        ({"every": -5}, ValueError, "positive"),
        ({"every": "5"}, TypeError, "number of seconds"),
        ({}, ValueError, "exactly one of cron= or every="),
        ({"cron": "0 2 * * *", "every": 60}, ValueError, "exactly one of cron= or every="),
        ({"every": 60, "overlap": "queue"}, ValueError, "unknown overlap policy"),
        ({"every": 60, "catchup_window": -1}, ValueError, "catchup_window"),
        ({"every": 60, "input": {"x": float("nan")}}, Exception, "NaN"),
        ({"every": 60, "workflow": "nope"}, WorkflowNotFound, "nope"),
        ({"every": 60, "name": "a@b"}, ValueError, "must not contain '@'"),
        ({"every": 60, "name": ""}, ValueError, "schedule name"),
    ],
)
def test_bad_schedules_are_refused_and_write_nothing(
    ductor: Ductor, kwargs: dict[str, Any], error: type[Exception], words: str
) -> None:
    ductor.schedule("keep", workflow="report", every=60)
    args = {"workflow": "report", **kwargs}
    name = args.pop("name", "bad")
    with pytest.raises(error, match=words):
        ductor.schedule(name, **args)
    assert [s.name for s in ductor.list_schedules()] == ["keep"]
    assert ductor.list_schedules()[0].every == 60


def test_two_sweepers_racing_on_one_fire_time_start_one_run(url: str) -> None:
    first, second = _make(url, "race1"), _make(url, "race2")
    first.schedule("race", workflow="report", every=3600, overlap="allow", catchup_window=10 * 3600)
    hour = db_now(first.runtime.engine()).timestamp() // 3600 * 3600
    expected = []
    for back in range(5):
        # Each round makes one more (older) fire time due; the newer ones have their runs.
        fire = datetime.fromtimestamp(hour - back * 3600, UTC)
        expected.append(fire)
        _set_next(first, "race", fire)
        barrier = threading.Barrier(2)
        results: list[schedules.FireResult] = []

        def sweep(
            d: Ductor, barrier: threading.Barrier, results: list[schedules.FireResult]
        ) -> None:
            barrier.wait()
            results.append(schedules.fire_due(d.runtime.engine()))

        threads = [
            threading.Thread(target=sweep, args=(d, barrier, results)) for d in (first, second)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum(len(r.started) for r in results) == 1, results
    ids = _runs(first, "race")
    assert len(ids) == 5
    assert sorted(_fire_time(i) for i in ids) == sorted(expected)


def test_catch_up_after_downtime_fires_only_within_the_window(ductor: Ductor) -> None:
    ductor.schedule("catch", workflow="report", every=60, overlap="allow", catchup_window=300)
    engine = ductor.runtime.engine()
    before = db_now(engine)
    if before.second >= 58:
        # The test's few milliseconds must not cross a minute: its next fire time would then
        # be due before ``after`` (a fire time exactly at the boundary, seen failing in CI).
        time.sleep(60.2 - before.second - before.microsecond / 1e6)
        before = db_now(engine)
    minute = datetime.fromtimestamp(before.timestamp() // 60 * 60, UTC)
    _set_next(ductor, "catch", minute - timedelta(hours=1))  # the coordinators were down
    result = schedules.fire_due(engine)
    after = db_now(engine)
    fires = [_fire_time(i) for i in _runs(ductor, "catch")]
    assert len(fires) == len(result.started) in (5, 6)
    assert all(before - timedelta(seconds=300) <= f <= after for f in fires)
    assert all(b - a == timedelta(seconds=60) for a, b in zip(fires, fires[1:], strict=False))
    assert result.missed == 61 - len(fires)  # minute - 60 min .. minute: 61 fire times
    (view,) = ductor.list_schedules()
    assert view.next_fire_at is not None and view.next_fire_at > after
    assert schedules.fire_due(engine).started == [], "a fire time is handled once"


def _close(d: Ductor, workflow_id: str) -> None:
    run_id = d.get(workflow_id).run_id
    d.terminate(run_id)
    run_tick(d.runtime, run_id)
    assert d.get(run_id).status == RunStatus.TERMINATED


@pytest.mark.parametrize("overlap", ["skip", "buffer_one", "allow"])
def test_overlap_policies(ductor: Ductor, overlap: str) -> None:
    ductor.schedule("ov", workflow="report", every=3600, overlap=overlap, catchup_window=3 * 3600)
    engine = ductor.runtime.engine()
    hour = datetime.fromtimestamp(db_now(engine).timestamp() // 3600 * 3600, UTC)
    # Three fire times due at once (hour - 2h, hour - 1h, hour); every run stays open.
    _set_next(ductor, "ov", hour - timedelta(hours=2))
    result = schedules.fire_due(engine)
    fires = [_fire_time(i) for i in _runs(ductor, "ov")]
    if overlap == "skip":
        assert (len(result.started), result.skipped, result.buffered) == (1, 2, 0)
        assert fires == [hour - timedelta(hours=2)]
    elif overlap == "allow":
        assert (len(result.started), result.skipped) == (3, 0)
        assert fires == [hour - timedelta(hours=k) for k in (2, 1, 0)]
    else:
        assert (len(result.started), result.skipped, result.buffered) == (1, 1, 1)
        (view,) = ductor.list_schedules()
        assert view.buffered_fire_at == hour - timedelta(hours=1)
        assert schedules.fire_due(engine).started == [], "still open: stays buffered"
        _close(ductor, fire_id_of(hour - timedelta(hours=2)))
        assert len(schedules.fire_due(engine).started) == 1, "started once the run ended"
        assert [_fire_time(i) for i in _runs(ductor, "ov")] == [
            hour - timedelta(hours=2),
            hour - timedelta(hours=1),
        ]
        assert ductor.list_schedules()[0].buffered_fire_at is None


def fire_id_of(fire: datetime) -> str:
    return f"ov@{fire.isoformat()}"


def test_pause_resume_and_trigger(ductor: Ductor) -> None:
    ductor.schedule("p", workflow="report", every=60)
    engine = ductor.runtime.engine()
    ductor.pause_schedule("p")
    (view,) = ductor.list_schedules()
    assert view.paused is True
    assert view.next_fire_at is not None and view.next_fire_at > db_now(engine)
    _set_next(ductor, "p", db_now(engine) - timedelta(seconds=30))
    assert schedules.fire_due(engine).started == [], "a paused schedule does not fire"
    handle = ductor.trigger_schedule("p")  # a trigger works while paused
    assert handle.workflow_id.startswith("p@")
    assert ductor.get(handle.run_id).status == RunStatus.PENDING
    assert ductor.list_schedules()[0].last_workflow_id == handle.workflow_id
    ductor.resume_schedule("p")
    (view,) = ductor.list_schedules()
    assert view.paused is False and view.next_fire_at is not None
    assert view.next_fire_at > db_now(engine), "fire times passed while paused are dropped"
    assert schedules.fire_due(engine).started == []
    for call in (ductor.pause_schedule, ductor.resume_schedule, ductor.trigger_schedule):
        with pytest.raises(ScheduleNotFound):
            call("missing")


def test_a_fired_run_runs_the_workflow_with_the_schedules_input(ductor: Ductor) -> None:
    ductor.schedule("in", workflow="report", every=60, input={"day": 1}, overlap="allow")
    engine = ductor.runtime.engine()
    _set_next(ductor, "in", db_now(engine) - timedelta(seconds=1))
    started = schedules.fire_due(engine).started
    # Schedules of earlier tests in this database may come due too: only ours counts here.
    (workflow_id,) = _runs(ductor, "in")
    view = ductor.get(workflow_id)
    run_id = view.run_id
    assert run_id in started
    assert view.input == {"day": 1} and view.workflow == "report"
    assert view.workflow_id.startswith("in@")
    assert _fire_time(view.workflow_id).tzinfo is not None
    assert run_tick(ductor.runtime, run_id) == "committed"
    assert ductor.get(run_id).status == RunStatus.RUNNING


def test_the_sweeper_stops_with_local_workers(tmp_path: Path) -> None:
    """Or a schedule would go on firing from a thread whose workers are gone."""
    url = f"sqlite:///{tmp_path}/stop.sqlite3"
    upgrade(url)
    d = _make(url, "stops")
    with d.local_workers():
        assert any(t.name == "ductor-sweeper" for t in threading.enumerate())
    assert not any(t.name == "ductor-sweeper" for t in threading.enumerate())


def test_a_zero_catchup_window_still_fires_the_fire_time_just_passed(ductor: Ductor) -> None:
    ductor.schedule("now", workflow="report", every=60, catchup_window=0)
    engine = ductor.runtime.engine()
    minute = datetime.fromtimestamp(db_now(engine).timestamp() // 60 * 60, UTC)
    _set_next(ductor, "now", minute - timedelta(minutes=5))
    result = schedules.fire_due(engine, min_window=65)
    fires = [_fire_time(i) for i in _runs(ductor, "now")]
    assert fires in ([minute - timedelta(minutes=1)], [minute]), "the one(s) within 65 s"
    assert len(result.started) == 1 and result.missed >= 4


def test_an_open_run_started_by_hand_under_the_fire_id_is_that_fire_times_run(
    ductor: Ductor,
) -> None:
    ductor.schedule("hand", workflow="report", every=3600, catchup_window=7200)
    engine = ductor.runtime.engine()
    hour = datetime.fromtimestamp(db_now(engine).timestamp() // 3600 * 3600, UTC)
    taken = ductor.start("report", workflow_id=f"hand@{hour.isoformat()}")
    _set_next(ductor, "hand", hour)
    result = schedules.fire_due(engine)
    assert result.started == []
    assert _runs(ductor, "hand") == [f"hand@{hour.isoformat()}"]
    (view,) = ductor.list_schedules()
    assert view.last_workflow_id == taken.workflow_id and view.next_fire_at is not None
    assert view.next_fire_at > hour
