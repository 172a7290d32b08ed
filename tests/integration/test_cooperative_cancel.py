"""Issue 14 item 5 on both databases: a cancel asks running attempts to stop (the heartbeat's
write returns the flag), a step that stops writes ``cancelled`` and the run ends cancelled; an
attempt still running after ``ductor_cancel_grace`` is closed; a message claimed after the
cancel is not run; terminate closes at once. The steps run in-process (``execute_attempt``,
the worker's own code); tests/e2e/test_cancel_terminate.py does it with a real worker."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from ductor_celery import Ductor, NodeStatus, RunStatus, StepCancelled, StepContext, Workflow
from ductor_celery.runtime.steps import execute_attempt
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store import attempts
from ductor_celery.store.migrate import upgrade
from ductor_celery.store.schema import step_attempt

STARTED = threading.Event()


@pytest.fixture(params=["sqlite", "postgresql"])
def ductor(request: pytest.FixtureRequest, tmp_path: Path) -> Ductor:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/cancel.sqlite3"
        upgrade(url)
    else:
        url = request.getfixturevalue("database_url")
    app = Celery(f"cancel{id(request)}", broker="memory://", set_as_current=False)
    app.conf.ductor_eager_ticks = False
    app.conf.ductor_cancel_grace = 0.5
    d = Ductor(app, database_url=url)
    STARTED.clear()

    @d.step(name="cc.loop")
    def loop(ctx: StepContext) -> str:
        STARTED.set()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            ctx.heartbeat({"t": time.monotonic()})  # raises StepCancelled on a cancel
            time.sleep(0.05)
        return "never cancelled"

    @d.step(name="cc.poll")
    def poll(ctx: StepContext) -> str:
        STARTED.set()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not ctx.cancelled:
            time.sleep(0.05)
        if ctx.cancelled:
            raise StepCancelled("saw ctx.cancelled")
        return "never cancelled"

    for name, step in (("looping", loop), ("polling", poll)):
        wf = Workflow(name)
        wf.step("a", step)
        wf.step("b", step, after=["a"])
        d.register(wf)
    return d


def _attempt(d: Ductor, token: str) -> Any:
    with d.runtime.engine().connect() as conn:
        return conn.execute(sa.select(step_attempt).where(step_attempt.c.token == token)).one()


def _run_in_thread(d: Ductor, name: str, token: str) -> tuple[threading.Thread, list[str]]:
    out: list[str] = []
    step = d.runtime.step_named(name)
    assert step is not None
    thread = threading.Thread(target=lambda: out.append(execute_attempt(d.runtime, step, token)))
    thread.start()
    assert STARTED.wait(10)
    return thread, out


@pytest.mark.parametrize(("workflow", "step"), [("looping", "cc.loop"), ("polling", "cc.poll")])
def test_a_running_step_stops_on_the_cancel_and_the_run_ends_cancelled(
    ductor: Ductor, workflow: str, step: str
) -> None:
    handle = ductor.start(workflow)
    assert run_tick(ductor.runtime, handle.run_id) == "committed"
    token = f"{handle.run_id}:a:1"
    thread, out = _run_in_thread(ductor, step, token)
    ductor.cancel(handle.run_id, reason="not needed")
    # Applied by the call: the run is asked to stop, and waits for the attempt.
    view = ductor.get(handle.run_id)
    assert view.status == RunStatus.RUNNING  # asked, waiting for the attempt to stop
    assert _attempt(ductor, token).cancel_requested_at is not None
    thread.join(10)
    assert out == ["cancelled"]
    row = _attempt(ductor, token)
    assert row.outcome == "cancelled" and row.error["type"] == "StepCancelled"
    run_tick(ductor.runtime, handle.run_id)
    view = ductor.get(handle.run_id)
    assert view.status == RunStatus.CANCELLED
    assert view.nodes["a"].status == NodeStatus.CANCELLED
    assert view.nodes["a"].attempts == 1  # not retried
    assert view.nodes["b"].status == NodeStatus.PENDING


def test_the_heartbeat_write_returns_the_cancel_flag(ductor: Ductor) -> None:
    engine = ductor.runtime.engine()
    handle = ductor.start("looping")
    run_tick(ductor.runtime, handle.run_id)
    token = f"{handle.run_id}:a:1"
    assert attempts.claim(engine, token, "w1") is not None
    assert attempts.heartbeat(engine, token, {"n": 1}) is False
    assert attempts.should_stop(engine, token) is False
    ductor.cancel(handle.run_id)
    run_tick(ductor.runtime, handle.run_id)
    assert attempts.heartbeat(engine, token, {"n": 2}) is True
    assert attempts.should_stop(engine, token) is True
    assert _attempt(ductor, token).heartbeat_details == {"n": 2}


def test_an_attempt_still_running_after_the_grace_is_closed(ductor: Ductor) -> None:
    engine = ductor.runtime.engine()
    handle = ductor.start("looping")
    run_tick(ductor.runtime, handle.run_id)
    token = f"{handle.run_id}:a:1"
    assert attempts.claim(engine, token, "deaf worker") is not None  # never heartbeats
    ductor.cancel(handle.run_id)
    run_tick(ductor.runtime, handle.run_id)
    assert ductor.get(handle.run_id).status == RunStatus.RUNNING
    time.sleep(0.6)  # ductor_cancel_grace = 0.5
    assert run_tick(ductor.runtime, handle.run_id) == "committed"
    assert ductor.get(handle.run_id).status == RunStatus.CANCELLED
    row = _attempt(ductor, token)
    assert row.outcome == "cancelled" and row.finished_at is not None
    # Its worker's late heartbeat finds the attempt closed: stop.
    assert attempts.heartbeat(engine, token) is True


def test_a_message_claimed_after_the_cancel_does_not_run_the_step(ductor: Ductor) -> None:
    handle = ductor.start("looping")
    run_tick(ductor.runtime, handle.run_id)
    ductor.cancel(handle.run_id)
    run_tick(ductor.runtime, handle.run_id)  # the attempt is unclaimed: still asked to stop
    token = f"{handle.run_id}:a:1"
    step = ductor.runtime.step_named("cc.loop")
    assert step is not None
    assert execute_attempt(ductor.runtime, step, token) == "cancelled"
    assert not STARTED.is_set()
    run_tick(ductor.runtime, handle.run_id)
    assert ductor.get(handle.run_id).status == RunStatus.CANCELLED


def test_terminate_closes_a_running_attempt_at_once(ductor: Ductor) -> None:
    handle = ductor.start("looping")
    run_tick(ductor.runtime, handle.run_id)
    token = f"{handle.run_id}:a:1"
    thread, out = _run_in_thread(ductor, "cc.loop", token)
    ductor.terminate(handle.run_id)
    run_tick(ductor.runtime, handle.run_id)
    assert ductor.get(handle.run_id).status == RunStatus.TERMINATED
    assert _attempt(ductor, token).outcome == "cancelled"
    thread.join(10)  # in-process nothing kills it: its next heartbeat finds it closed
    assert out == ["closed"]
