"""A run's first tick on a step worker (eager ticks; ``steps.first_tick``): the start message
goes to the steps queue, and the worker that takes it ticks the run and runs its first step
itself, then the inline chain after it. No hop to the coordinator, no step message.

Each test plays the start message by hand, as the ``ductor.first_tick`` task does; the
dispatcher records what would have been published.
"""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa
from inline_support import QUEUE, attempt_rows, make_ductor, outbox_rows, url

__all__ = ["url"]  # the fixture: PostgreSQL and SQLite

from ductor_celery import Ductor, RunStatus, StepContext
from ductor_celery.definition import Workflow
from ductor_celery.runtime.dispatch import first_tick_id
from ductor_celery.runtime.steps import first_tick
from ductor_celery.runtime.tick_task import run_tick


def _chain(ductor: Ductor, length: int, queue: str | None = None) -> None:
    def add_one(ctx: StepContext, value: int = 0) -> int:
        return value + 1

    step = ductor.step(name="first.add", queue=queue)(add_one)
    wf = Workflow("chain")
    wf.step("s0", step, args={"value": 0})
    for i in range(1, length):
        wf.step(f"s{i}", step, after=[f"s{i - 1}"], args={"value": f"$.nodes.s{i - 1}.output"})
    wf.output(f"$.nodes.s{length - 1}.output")
    ductor.register(wf)


def test_a_started_run_goes_to_the_step_workers_and_runs_to_the_end_there(url: str) -> None:
    ductor, recorder = make_ductor(url)
    _chain(ductor, 5)
    run_id = ductor.start("chain").run_id
    assert recorder.first_ticks == [run_id] and recorder.wakes == []
    assert ductor.get(run_id).status == RunStatus.PENDING
    assert first_tick(ductor.runtime, run_id, "w1@host", QUEUE) == "committed"
    view = ductor.get(run_id)
    assert view.status == RunStatus.SUCCEEDED and view.output == 5
    assert recorder.rows == [] and recorder.wakes == []  # no step message, no coordinator
    assert [a.claimed_by.split(":")[0] for a in attempt_rows(ductor, run_id)] == ["w1@host"] * 5
    assert outbox_rows(ductor) == []


def test_the_steps_a_first_tick_runs_record_its_message_as_their_carrier(url: str) -> None:
    ductor, _ = make_ductor(url)
    _chain(ductor, 3)
    run_id = ductor.start("chain").run_id
    carrier = first_tick_id(run_id)
    assert first_tick(ductor.runtime, run_id, "w1@host", QUEUE, carrier) == "committed"
    assert [a.carrier for a in attempt_rows(ductor, run_id)] == [carrier] * 3


def test_with_eager_ticks_off_a_started_run_wakes_the_coordinator(url: str) -> None:
    ductor, recorder = make_ductor(url, eager_ticks=False)
    _chain(ductor, 2)
    run_id = ductor.start("chain").run_id
    assert recorder.wakes == [run_id] and recorder.first_ticks == []


def test_a_first_step_for_another_queue_is_sent_there(url: str) -> None:
    """The start message's worker ticks the run; a first step routed to another queue goes
    there as a message, as the coordinator's tick would have sent it."""
    ductor, recorder = make_ductor(url)
    _chain(ductor, 2, queue="elsewhere")
    run_id = ductor.start("chain").run_id
    assert first_tick(ductor.runtime, run_id, "w1@host", QUEUE) == "committed"
    assert [(r.payload["node"], r.queue) for r in recorder.rows] == [("s0", "elsewhere")]
    assert ductor.get(run_id).status == RunStatus.RUNNING


def test_a_duplicate_start_message_is_a_no_op(url: str) -> None:
    ductor, recorder = make_ductor(url)
    _chain(ductor, 3)
    run_id = ductor.start("chain").run_id
    assert first_tick(ductor.runtime, run_id, "w1@host", QUEUE) == "committed"
    assert first_tick(ductor.runtime, run_id, "w2@host", QUEUE) == "noop"
    assert len(attempt_rows(ductor, run_id)) == 3
    assert first_tick(ductor.runtime, "no-such-run", "w2@host", QUEUE) == "missing"


def test_a_run_another_tick_holds_is_left_to_the_coordinator(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL: the first tick takes the run's lock at its commit, waiting at most the
    tick's lock timeout; when a coordinator tick holds it past that, the worker wakes the
    coordinator and runs nothing."""
    from ductor_celery.store import tick_store

    monkeypatch.setattr(tick_store, "TICK_LOCK_TIMEOUT", "200ms")
    ductor, recorder = make_ductor(database_url)
    _chain(ductor, 2)
    run_id = ductor.start("chain").run_id
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        engine = sa.create_engine(database_url, poolclass=sa.pool.NullPool)
        with engine.begin() as conn:
            conn.execute(
                sa.text("SELECT 1 FROM eec_workflow_run WHERE run_id = :r FOR UPDATE"),
                {"r": run_id},
            )
            held.set()
            release.wait(10)
        engine.dispose()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(5)
        assert first_tick(ductor.runtime, run_id, "w1@host", QUEUE) == "busy"
        assert recorder.wakes == [run_id]
        assert attempt_rows(ductor, run_id) == []
    finally:
        release.set()
        holder.join()
    assert run_tick(ductor.runtime, run_id) == "committed"  # the coordinator's tick
    assert ductor.get(run_id).status == RunStatus.RUNNING


@pytest.mark.parametrize("inline_steps", [0, 50])
def test_without_inline_steps_the_first_step_is_sent_as_a_message(
    url: str, inline_steps: int
) -> None:
    ductor, recorder = make_ductor(url, inline_steps=inline_steps)
    _chain(ductor, 2)
    run_id = ductor.start("chain").run_id
    assert first_tick(ductor.runtime, run_id, "w1@host", QUEUE) == "committed"
    sent = [r.payload["node"] for r in recorder.rows if r.kind == "step"]
    assert sent == ([] if inline_steps else ["s0"])


def test_a_worker_with_eager_ticks_off_forwards_a_start_to_the_coordinator(url: str) -> None:
    """A client with eager ticks on, a step worker with them off: the worker ticks nothing."""
    client, _ = make_ductor(url)
    _chain(client, 2)
    run_id = client.start("chain").run_id
    worker, recorder = make_ductor(url, eager_ticks=False)
    _chain(worker, 2)
    assert first_tick(worker.runtime, run_id, "w1@host", QUEUE) == "forwarded"
    assert recorder.wakes == [run_id]
    assert worker.get(run_id).status == RunStatus.PENDING
