"""Issue 14 item 1: a delayed start (``delay=`` / ``start_at=``) is a pending run with a timer
row, never a broker ETA; it is cancellable, and bad values write nothing. Both databases."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from ductor_celery import Ductor, RunStatus, StepContext, Workflow
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store import sweep
from ductor_celery.store.migrate import upgrade
from ductor_celery.store.schema import workflow_run, workflow_timer


@pytest.fixture(params=["sqlite", "postgresql"])
def ductor(request: pytest.FixtureRequest, tmp_path: Path) -> Ductor:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/delay.sqlite3"
        upgrade(url)
    else:
        url = request.getfixturevalue("database_url")
    app = Celery(f"delay{id(request)}", broker="memory://", set_as_current=False)
    app.conf.ductor_sweep_interval = 0.1
    app.conf.ductor_eager_ticks = False
    d = Ductor(app, database_url=url)

    @d.step(name="delay.echo")
    def echo(ctx: StepContext, value: Any = None) -> Any:
        return value

    wf = Workflow("report")
    wf.step("a", echo, args={"value": "$.input"})
    wf.output("$.nodes.a.output")
    d.register(wf)
    return d


def _timer(d: Ductor, run_id: str) -> datetime | None:
    with d.runtime.engine().connect() as conn:
        value = conn.execute(
            sa.select(workflow_timer.c.fire_at).where(workflow_timer.c.run_id == run_id)
        ).scalar_one_or_none()
    if value is not None and value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value


def _run_count(d: Ductor) -> int:
    with d.runtime.engine().connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(workflow_run)).scalar_one())


def test_a_delayed_run_is_pending_with_a_timer_row_and_an_early_tick_does_nothing(
    ductor: Ductor,
) -> None:
    before = datetime.now(UTC)
    handle = ductor.start("report", input=1, delay=3600)
    view = ductor.get(handle.run_id)
    assert view.status == RunStatus.PENDING
    assert view.start_at is not None and view.deadline_at is None
    assert before + timedelta(seconds=3590) < view.start_at < before + timedelta(seconds=3610)
    assert _timer(ductor, handle.run_id) == view.start_at
    # A tick before the start time (a re-sent wake-up, say) starts nothing.
    assert run_tick(ductor.runtime, handle.run_id) == "noop"
    assert ductor.get(handle.run_id).status == RunStatus.PENDING
    # The sweeper does not take a delayed run for one whose first wake-up was lost.
    assert handle.run_id not in sweep.pending_runs(ductor.runtime.engine(), older_than=0)


def test_cancel_ends_a_delayed_run_before_it_starts(ductor: Ductor) -> None:
    at = datetime.now(UTC) + timedelta(hours=2)
    handle = ductor.start("report", input=1, start_at=at)
    assert ductor.get(handle.run_id).start_at == at
    ductor.cancel(handle.run_id, reason="not needed")  # applied by the call's own tick
    view = ductor.get(handle.run_id)
    assert view.status == RunStatus.CANCELLED
    assert view.nodes["a"].status == "pending" and view.nodes["a"].attempts == 0
    assert _timer(ductor, handle.run_id) is None


def test_pause_then_resume_before_the_start_time_goes_back_to_waiting(ductor: Ductor) -> None:
    handle = ductor.start("report", input=1, delay=3600)
    ductor.pause(handle.run_id)
    run_tick(ductor.runtime, handle.run_id)
    assert ductor.get(handle.run_id).status == RunStatus.PAUSED
    ductor.resume(handle.run_id)
    run_tick(ductor.runtime, handle.run_id)
    view = ductor.get(handle.run_id)
    assert view.status == RunStatus.PENDING and view.nodes["a"].attempts == 0
    assert _timer(ductor, handle.run_id) == view.start_at


def test_a_start_at_in_another_time_zone_is_kept_as_the_same_instant(ductor: Ductor) -> None:
    plus_two = timezone(timedelta(hours=2))
    # Five years ahead: start_at may be at most ten years ahead, like delay.
    at = (datetime.now(UTC) + timedelta(days=5 * 365)).replace(microsecond=0).astimezone(plus_two)
    handle = ductor.start("report", input=1, start_at=at)
    assert ductor.get(handle.run_id).start_at == at
    assert _timer(ductor, handle.run_id) == at


def test_the_sweeper_starts_a_delayed_run_when_it_is_due(ductor: Ductor) -> None:
    with ductor.local_workers():
        handle = ductor.start("report", input=7, delay=1.0)
        time.sleep(0.3)
        assert ductor.get(handle.run_id).status == RunStatus.PENDING
        view = ductor.wait(handle.run_id, timeout=30)
    assert view.status == RunStatus.SUCCEEDED and view.output == 7
    assert view.start_at is not None
    started = view.nodes["a"].started_at
    assert started is not None and started >= view.start_at


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"delay": -1}, ValueError, "delay must be >= 0"),
        ({"delay": math.nan}, ValueError, "finite"),
        ({"delay": math.inf}, ValueError, "finite"),
        ({"delay": "60"}, TypeError, "number of seconds"),
        ({"delay": True}, TypeError, "number of seconds"),
        ({"start_at": datetime(2099, 1, 1)}, ValueError, "aware datetime"),  # noqa: DTZ001
        ({"start_at": "2099-01-01T00:00:00Z"}, TypeError, "must be a datetime"),
        ({"delay": 5, "start_at": datetime(2099, 1, 1, tzinfo=UTC)}, ValueError, "not both"),
    ],
)
def test_bad_delays_are_refused_and_write_nothing(
    ductor: Ductor, kwargs: dict[str, Any], error: type[Exception], words: str
) -> None:
    ductor.start("report", input=0)  # the schema and one run exist
    before = _run_count(ductor)
    with pytest.raises(error, match=words):
        ductor.start("report", input=1, **kwargs)
    assert _run_count(ductor) == before


def test_a_start_time_already_passed_starts_at_once(ductor: Ductor) -> None:
    with ductor.local_workers():
        handle = ductor.start("report", input=3, start_at=datetime.now(UTC) - timedelta(hours=1))
        view = ductor.wait(handle.run_id, timeout=30)
    assert view.status == RunStatus.SUCCEEDED and view.output == 3
