"""Issue 14 item 3 on both databases: an attempt nobody claims within its step's
``schedule_to_start_timeout``, a lost message or one waiting for a concurrency lease, is closed
as timed out and retried; ``NodeView.attempts`` counts the unclaimed attempts too."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from ductor_celery import ConcurrencyLimit, Ductor, RetryPolicy, RunStatus, StepContext, Workflow
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store import attempts
from ductor_celery.store.migrate import upgrade
from ductor_celery.store.schema import concurrency_lease, step_attempt


@pytest.fixture(params=["sqlite", "postgresql"])
def ductor(request: pytest.FixtureRequest, tmp_path: Path) -> Ductor:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/sts.sqlite3"
        upgrade(url)
    else:
        url = request.getfixturevalue("database_url")
    app = Celery(f"sts{id(request)}", broker="memory://", set_as_current=False)
    app.conf.ductor_eager_ticks = False
    d = Ductor(app, database_url=url)
    quick = RetryPolicy(max_attempts=2, initial_interval=0.1)

    @d.step(name="sts.lonely", schedule_to_start_timeout=0.5, retry=quick)
    def lonely(ctx: StepContext) -> str:
        return "ran"

    @d.step(
        name="sts.limited",
        schedule_to_start_timeout=0.5,
        retry=quick,
        concurrency=ConcurrencyLimit("one", 1),
    )
    def limited(ctx: StepContext) -> str:
        return "ran"

    for name, step in (("lonely", lonely), ("limited", limited)):
        wf = Workflow(name)
        wf.step("a", step)
        d.register(wf)
    return d


def _row(d: Ductor, token: str) -> Any:
    with d.runtime.engine().connect() as conn:
        return conn.execute(sa.select(step_attempt).where(step_attempt.c.token == token)).one()


def _leases(d: Ductor) -> list[str]:
    with d.runtime.engine().connect() as conn:
        return sorted(conn.execute(sa.select(concurrency_lease.c.token)).scalars())


def test_a_message_nobody_claims_in_time_times_out_and_retries(ductor: Ductor) -> None:
    handle = ductor.start("lonely")
    run_tick(ductor.runtime, handle.run_id)
    first = f"{handle.run_id}:a:1"
    time.sleep(0.6)  # no worker: the message sits unclaimed
    assert run_tick(ductor.runtime, handle.run_id) == "committed"
    row = _row(ductor, first)
    assert row.outcome == "timed_out" and row.claimed_at is None
    assert row.error["type"] == "ScheduleToStartTimeout"
    view = ductor.get(handle.run_id)
    assert view.status == RunStatus.RUNNING and view.nodes["a"].attempts == 1
    time.sleep(0.2)  # the retry's backoff
    run_tick(ductor.runtime, handle.run_id)
    assert ductor.get(handle.run_id).nodes["a"].attempts == 2  # an unclaimed attempt counts
    # The retry's worker claims it in time: it runs.
    assert attempts.claim(ductor.runtime.engine(), f"{handle.run_id}:a:2", "w") is not None
    assert attempts.finish(
        ductor.runtime.engine(), f"{handle.run_id}:a:2", outcome="succeeded", output="ran"
    )[0]
    run_tick(ductor.runtime, handle.run_id)
    assert ductor.get(handle.run_id).status == RunStatus.SUCCEEDED


def test_an_attempt_waiting_for_a_lease_times_out_and_leaves_the_queue(ductor: Ductor) -> None:
    engine = ductor.runtime.engine()
    holder = ductor.start("limited")
    run_tick(ductor.runtime, holder.run_id)
    held = f"{holder.run_id}:a:1"
    assert _leases(ductor) == [held]
    assert attempts.claim(engine, held, "busy worker") is not None  # holds the one slot
    waiter = ductor.start("limited")
    run_tick(ductor.runtime, waiter.run_id)
    waiting = f"{waiter.run_id}:a:1"
    assert _leases(ductor) == [held]  # the second waits for the slot
    time.sleep(0.6)
    assert run_tick(ductor.runtime, waiter.run_id) == "committed"
    row = _row(ductor, waiting)
    assert row.outcome == "timed_out"
    assert "waited for a concurrency lease" in row.error["message"]
    # The holder finishing hands its slot to nobody: the timed-out waiter left the queue.
    written, granted = attempts.finish(engine, held, outcome="succeeded", output=1, leased=True)
    assert written and waiting not in [g.payload["token"] for g in granted]
