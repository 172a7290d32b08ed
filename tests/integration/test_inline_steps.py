"""Inline steps (``ductor_inline_steps``, runtime/inline.py): the step worker that ticks a run
runs the next step itself when it is for the queue its message came from.

Each test plays the first message by hand: start a run, tick it once (so the first attempt and
its outbox row exist), then call ``execute_attempt`` as the Celery task does, with the queue
the message came from. The dispatcher records what would have gone to the broker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import current_task
from celery._state import (
    get_current_task,
    get_current_worker_task,
    pop_current_task,
    push_current_task,
)
from celery.local import Proxy
from celery.signals import before_task_publish
from inline_support import (
    QUEUE,
    attempt_rows,
    deliver,
    make_ductor,
    outbox_rows,
    run_row,
    start_run,
    url,
)

__all__ = ["url"]  # the fixture: PostgreSQL and SQLite

from ductor_celery import ConcurrencyLimit, Ductor, RetryPolicy, StepContext
from ductor_celery.definition import Workflow
from ductor_celery.runtime import inline, task_events
from ductor_celery.runtime.dispatch import FIRST_TICK_TASK_NAME, first_tick_id
from ductor_celery.runtime.steps import first_tick
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.settings import Settings
from ductor_celery.store.outbox import OutboxRow


def _add_one(ductor: Ductor, name: str = "inline.add", **kw: Any) -> Any:
    def add_one(ctx: StepContext, value: int = 0) -> int:
        return value + 1

    return ductor.step(name=name, **kw)(add_one)


def _chain(ductor: Ductor, length: int, step: Any, name: str = "chain") -> None:
    wf = Workflow(name)
    wf.step("s0", step, args={"value": 0})
    for i in range(1, length):
        wf.step(f"s{i}", step, after=[f"s{i - 1}"], args={"value": f"$.nodes.s{i - 1}.output"})
    wf.output(f"$.nodes.s{length - 1}.output")
    ductor.register(wf)


@contextlib.contextmanager
def _as_message(ductor: Ductor, row: OutboxRow) -> Iterator[None]:
    """What Celery's tracer sets around a task delivered by a message."""
    step = ductor.runtime.step_named(row.task)
    assert step is not None
    step.task.push_request(id=row.payload["token"])
    push_current_task(step.task)
    try:
        yield
    finally:
        pop_current_task()
        step.task.pop_request()


def test_a_chain_runs_to_the_end_from_one_message(url: str) -> None:
    ductor, recorder = make_ductor(url)
    task_ids: list[str | None] = []

    def add_one(ctx: StepContext, value: int = 0) -> int:
        task_ids.append(current_task.request.id if current_task else None)
        return value + 1

    _chain(ductor, 6, ductor.step(name="inline.add")(add_one))
    run_id, first = start_run(ductor, "chain", recorder)

    with _as_message(ductor, first):
        assert deliver(ductor, first) == "succeeded"

    run = run_row(ductor, run_id)
    assert run.status == "succeeded" and run.output == 6
    assert recorder.steps() == []  # not one more step message
    rows = attempt_rows(ductor, run_id)
    assert [r.node for r in rows] == [f"s{i}" for i in range(6)]
    assert all(r.outcome == "succeeded" and r.claimed_at is not None for r in rows)
    assert {r.claimed_by.split(":")[1] for r in rows} == {str(os.getpid())}
    # Celery's current task is each attempt's own, with its token as the task id, as when a
    # message delivers it (user code and Celery's task log format read it).
    assert task_ids == [r.token for r in rows]
    assert outbox_rows(ductor) == []  # each kept row marked sent once claimed


def test_an_inline_step_sees_its_own_request_not_the_carrying_message_s(url: str) -> None:
    """The request in force while an inline attempt runs is the one a message delivering it
    would have made: its token as id and correlation id, the worker's host, the queue, not
    called directly, and nothing of the carrying message's own request (its reply-to, its
    custom headers, its other fields)."""
    ductor, recorder = make_ductor(url)
    seen: list[dict[str, Any]] = []

    def look(ctx: StepContext, value: int = 0) -> int:
        request = current_task.request
        seen.append(
            {
                "task": current_task.name,
                # The registered task itself, as Celery's tracer pushes it, not its proxy.
                "unproxied": not isinstance(current_task._get_current_object(), Proxy),
                **{
                    field: getattr(request, field)
                    for field in (
                        "id",
                        "correlation_id",
                        "root_id",
                        "hostname",
                        "delivery_info",
                        "called_directly",
                        "reply_to",
                        "headers",
                        "args",
                        "kwargs",
                        "retries",
                        "eta",
                    )
                },
            }
        )
        return value + 1

    _chain(ductor, 3, ductor.step(name="inline.look")(look))
    run_id, first = start_run(ductor, "chain", recorder)
    step = ductor.runtime.step_named(first.task)
    assert step is not None
    # The carrying message's request, as Celery's tracer would set it, with fields of its own.
    step.task.push_request(
        id=first.payload["token"],
        reply_to="carrier-reply-queue",
        eta="2026-01-01T00:00:00+00:00",
        headers={"custom": "of the carrier"},
        called_directly=False,
    )
    push_current_task(step.task)
    try:
        assert deliver(ductor, first) == "succeeded"
        # Each inline request was popped as its attempt ended: the carrier's is in force.
        assert step.task.request.id == first.payload["token"]
        assert get_current_task() is step.task
    finally:
        pop_current_task()
        step.task.pop_request()

    tokens = [r.token for r in attempt_rows(ductor, run_id)]
    assert run_row(ductor, run_id).status == "succeeded" and len(seen) == 3
    # The first ran under the carrier's own request; the two after it inline, under theirs.
    assert seen[0]["id"] == tokens[0] and seen[0]["reply_to"] == "carrier-reply-queue"
    for request, token in zip(seen[1:], tokens[1:], strict=True):
        assert request == {
            "task": "inline.look",
            "unproxied": True,
            "id": token,
            "correlation_id": token,
            "root_id": token,
            "hostname": "w1@host",
            "delivery_info": {"routing_key": QUEUE},
            "called_directly": False,
            "reply_to": None,
            "headers": None,
            "args": [token],
            "kwargs": {},
            "retries": 0,
            "eta": None,
        }


def test_tasks_an_inline_step_sends_name_it_as_their_parent(url: str) -> None:
    """A step run inline under a task of another name (a run's start message,
    ``ductor.first_tick``) is Celery's current worker task while it runs: a task it sends
    names the attempt as its parent and root, as one sent from a step delivered by its own
    message does, not the start message."""
    ductor, _recorder = make_ductor(url)
    sent: list[tuple[str, Any, Any]] = []
    seen: list[tuple[str | None, bool]] = []

    def record(sender: Any = None, headers: Any = None, **_: Any) -> None:
        sent.append((headers["task"], headers["parent_id"], headers["root_id"]))

    def sends(ctx: StepContext, value: int = 0) -> int:
        worker_task = get_current_worker_task()
        seen.append((worker_task.request.id, worker_task.request.called_directly))
        ductor.app.send_task("user.elsewhere", args=[value])
        return value + 1

    _chain(ductor, 2, ductor.step(name="inline.sends")(sends))
    run_id = ductor.start("chain").run_id
    before_task_publish.connect(record, weak=False)
    try:
        assert first_tick(ductor.runtime, run_id, "w1@host", QUEUE, first_tick_id(run_id)) == (
            "committed"
        )
    finally:
        before_task_publish.disconnect(record)
    tokens = [r.token for r in attempt_rows(ductor, run_id)]
    assert run_row(ductor, run_id).status == "succeeded"
    assert seen == [(token, False) for token in tokens]
    assert sent == [("user.elsewhere", token, token) for token in tokens]


@pytest.mark.parametrize(
    ("conf", "queue"),
    [({"inline_steps": 0}, QUEUE), ({"eager_ticks": False}, QUEUE), ({}, None)],
    ids=["inline-steps-0", "eager-ticks-off", "no-delivery-queue"],
)
def test_without_inline_steps_each_step_is_a_message(
    database_url: str, conf: dict[str, Any], queue: str | None
) -> None:
    ductor, recorder = make_ductor(database_url, **conf)
    _chain(ductor, 3, _add_one(ductor))
    run_id, first = start_run(ductor, "chain", recorder)
    deliver(ductor, first, queue=queue)
    if conf.get("eager_ticks") is False:
        assert recorder.wakes == [run_id]  # the coordinator ticks, and sends s1
        assert run_row(ductor, run_id).status == "running"
        return
    assert recorder.steps() == ["s1"]
    assert [r.node for r in attempt_rows(ductor, run_id)] == ["s0", "s1"]


def test_at_most_inline_steps_follow_one_message(database_url: str) -> None:
    ductor, recorder = make_ductor(database_url, inline_steps=2)
    _chain(ductor, 6, _add_one(ductor))
    run_id, first = start_run(ductor, "chain", recorder)
    deliver(ductor, first)
    assert recorder.steps() == ["s3"]  # s0 from the message, s1 and s2 inline, s3 sent
    [s3] = recorder.rows
    recorder.rows.clear()
    deliver(ductor, s3)
    assert recorder.steps() == []
    assert run_row(ductor, run_id).output == 6


def test_no_inline_step_starts_past_the_time_budget(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inline, "INLINE_BUDGET_S", -1.0)
    ductor, recorder = make_ductor(database_url)
    _chain(ductor, 3, _add_one(ductor))
    _, first = start_run(ductor, "chain", recorder)
    deliver(ductor, first)
    assert recorder.steps() == ["s1"]


def test_a_step_for_another_queue_or_under_a_limit_goes_through_the_broker(
    database_url: str,
) -> None:
    ductor, recorder = make_ductor(database_url)
    add = _add_one(ductor)
    elsewhere = _add_one(ductor, "inline.elsewhere", queue="gpu")
    limited = _add_one(ductor, "inline.limited", concurrency=ConcurrencyLimit(key="api", limit=1))
    wf = Workflow("mixed")
    wf.step("a", add, args={"value": 0})
    wf.step("b", elsewhere, after=["a"], args={"value": "$.nodes.a.output"})
    wf.step("c", limited, after=["b"], args={"value": "$.nodes.b.output"})
    wf.output("$.nodes.c.output")
    ductor.register(wf)
    run_id, first = start_run(ductor, "mixed", recorder)

    deliver(ductor, first)
    [b] = recorder.rows
    assert b.payload["node"] == "b" and b.queue == "gpu"
    recorder.rows.clear()
    deliver(ductor, b, queue="gpu")
    assert recorder.steps() == ["c"]  # leased: never inline
    [c] = recorder.rows
    recorder.rows.clear()
    deliver(ductor, c)
    assert run_row(ductor, run_id).output == 3


def test_a_fan_out_keeps_one_branch_and_sends_the_others(database_url: str) -> None:
    ductor, recorder = make_ductor(database_url)
    add = _add_one(ductor)
    wf = Workflow("fan")
    wf.step("root", add, args={"value": 0})
    for name in ("x", "y", "z"):
        wf.step(name, add, after=["root"], args={"value": "$.nodes.root.output"})
    wf.output("$.nodes.x.output")
    ductor.register(wf)
    run_id, first = start_run(ductor, "fan", recorder)

    deliver(ductor, first)
    sent = recorder.steps()
    assert len(sent) == 2 and set(sent) < {"x", "y", "z"}
    ran = {r.node for r in attempt_rows(ductor, run_id) if r.finished_at is not None}
    assert ran == {"root"} | ({"x", "y", "z"} - set(sent))


def test_a_failing_inline_step_fails_its_node_as_from_a_message(database_url: str) -> None:
    ductor, recorder = make_ductor(database_url)
    add = _add_one(ductor)

    def boom(ctx: StepContext, value: int = 0) -> int:
        raise ValueError(f"bad value {value}")

    wf = Workflow("fails")
    wf.step("a", add, args={"value": 0})
    wf.step(
        "b",
        ductor.step(name="inline.boom", retry=RetryPolicy(max_attempts=1))(boom),
        after=["a"],
        args={"value": "$.nodes.a.output"},
    )
    ductor.register(wf)
    run_id, first = start_run(ductor, "fails", recorder)
    deliver(ductor, first)
    run = run_row(ductor, run_id)
    assert run.status == "failed"
    [_, b] = attempt_rows(ductor, run_id)
    assert b.outcome == "failed" and b.error["message"] == "bad value 1"


def test_a_worker_dying_before_its_inline_step_leaves_it_to_the_step_timeout(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KeyboardInterrupt from the events stands for the process dying right after the commit
    that claimed s1 for it: s1 is claimed with no message; its timeout retries it."""
    ductor, recorder = make_ductor(database_url)
    _chain(ductor, 2, _add_one(ductor, timeout=1.0, retry=RetryPolicy(initial_interval=0.1)))
    run_id, first = start_run(ductor, "chain", recorder)

    def die(self: Any, *_: Any, **__: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(task_events.TaskEvents, "started", die)
    with pytest.raises(KeyboardInterrupt):
        deliver(ductor, first)
    monkeypatch.undo()
    [_, s1] = attempt_rows(ductor, run_id)
    assert s1.node == "s1" and s1.claimed_at is not None and s1.finished_at is None
    assert recorder.steps() == [] and outbox_rows(ductor) == []

    time.sleep(1.2)  # past s1's start-to-close timeout: timed out, retried after its backoff
    assert run_tick(ductor.runtime, run_id) == "committed"
    time.sleep(0.2)
    assert run_tick(ductor.runtime, run_id) == "committed"
    [retry] = recorder.rows
    assert retry.payload["node"] == "s1" and retry.payload["token"] != s1.token
    recorder.rows.clear()
    deliver(ductor, retry)
    assert run_row(ductor, run_id).output == 2
    assert [(r.node, r.outcome) for r in attempt_rows(ductor, run_id)] == [
        ("s0", "succeeded"),
        ("s1", "timed_out"),
        ("s1", "succeeded"),
    ]


def test_a_step_that_exits_its_process_takes_no_inline_step(database_url: str) -> None:
    """The outcome is written and the tick runs, but the next step goes out as a message:
    claimed here, it would wait for its timeout once the process has exited."""
    ductor, recorder = make_ductor(database_url)

    def exits(ctx: StepContext, value: int = 0) -> int:
        raise SystemExit(0)

    add = _add_one(ductor)
    wf = Workflow("exits")
    exits_step = ductor.step(name="inline.exits", retry=RetryPolicy(max_attempts=1))(exits)
    wf.step("a", exits_step, continue_on_failure=True)
    wf.step("b", add, after=["a"], args={"value": 1})
    ductor.register(wf)
    run_id, first = start_run(ductor, "exits", recorder)
    with pytest.raises(SystemExit):
        deliver(ductor, first)
    assert recorder.steps() == ["b"]
    [a, b] = attempt_rows(ductor, run_id)
    assert a.outcome == "failed" and b.claimed_at is None


def test_each_inline_step_records_the_message_it_runs_under(url: str) -> None:
    """The carrier: the task id of the message whose process runs the attempt, written with
    its claim (here in the commit of the tick that creates it)."""
    ductor, recorder = make_ductor(url)
    _chain(ductor, 4, _add_one(ductor))
    run_id, first = start_run(ductor, "chain", recorder)
    deliver(ductor, first)
    rows = attempt_rows(ductor, run_id)
    assert [r.carrier for r in rows] == [first.payload["token"]] * 4


def _terminating_chain(ductor: Ductor, kind: str) -> None:
    """s0 adds one; s1, run inline after s0's message, applies ``kind`` to its own run (as an
    operator would meanwhile) and returns."""

    def stop_my_run(ctx: StepContext, value: int = 0) -> int:
        getattr(ductor, kind)(ctx.run_id, reason="stop now")
        return value + 1

    wf = Workflow("stops")
    wf.step("s0", _add_one(ductor), args={"value": 0})
    stop = ductor.step(name="inline.stop_my_run", retry=RetryPolicy(max_attempts=1))(stop_my_run)
    wf.step("s1", stop, after=["s0"], args={"value": "$.nodes.s0.output"})
    ductor.register(wf)


def test_a_terminate_kills_the_message_an_inline_step_runs_under(url: str) -> None:
    """s1 has no message of its own: the terminate revokes its token (which reaches nothing)
    and, with terminate=True, s0's message, whose process runs s1."""
    ductor, recorder = make_ductor(url)
    _terminating_chain(ductor, "terminate")
    run_id, first = start_run(ductor, "stops", recorder)
    deliver(ductor, first)
    assert run_row(ductor, run_id).status == "terminated"
    s0, s1 = attempt_rows(ductor, run_id)
    assert s1.carrier == s0.token and s1.outcome == "cancelled"
    revokes = [(r.payload["token"], r.payload.get("terminate")) for r in recorder.rows]
    assert revokes == [(s1.token, True), (s0.token, True)]
    assert recorder.rows[1].payload["carrier_of"] == s1.token
    assert all(r.kind == "revoke" and r.run_id == run_id for r in recorder.rows)


def test_a_cancel_kills_no_message(url: str) -> None:
    """A cooperative cancel (and its close after the grace) only revokes without terminate:
    a step is asked to stop, never killed, so no carrier is revoked."""
    ductor, recorder = make_ductor(url, cancel_grace=0)
    _terminating_chain(ductor, "cancel")
    run_id, first = start_run(ductor, "stops", recorder)
    deliver(ductor, first)
    assert run_row(ductor, run_id).status == "cancelled"
    s0, s1 = attempt_rows(ductor, run_id)
    assert s1.carrier == s0.token
    assert [(r.payload["token"], r.payload.get("terminate")) for r in recorder.rows] == [
        (s1.token, None)
    ]


def test_a_chain_never_runs_another_runs_attempt(database_url: str) -> None:
    """A carrier only ever runs attempts of one run (what makes killing it on that run's
    terminate safe): a chain bound to run A offered a tick of run B claims nothing, and B's
    step goes out as a message."""
    ductor, recorder = make_ductor(database_url)
    _chain(ductor, 2, _add_one(ductor))
    run_a = ductor.start("chain").run_id
    run_b = ductor.start("chain").run_id
    chain = inline.InlineChain.start(
        ductor.runtime, QUEUE, lambda: "w1@host:1:x", carrier="message-a", run_id=run_a
    )
    assert chain is not None
    chain.bind(run_b)  # bound once: a later bind changes nothing
    assert chain.run_id == run_a
    assert run_tick(ductor.runtime, run_b, eager=True, keep=chain) == "committed"
    assert chain.kept is None
    [b0] = attempt_rows(ductor, run_b)
    assert b0.claimed_at is None and b0.carrier is None
    assert recorder.steps() == ["s0"]
    recorder.rows.clear()
    assert run_tick(ductor.runtime, run_a, eager=True, keep=chain) == "committed"
    assert chain.kept is not None and chain.kept[0].run_id == run_a
    [a0] = attempt_rows(ductor, run_a)
    assert a0.claimed_at is not None and a0.carrier == "message-a"
    assert recorder.steps() == []


class RecordingEvents:
    """Stands for ``app.events``: what the inline steps' event dispatcher buffers and
    publishes (one broker message per ``flush``, as Celery's ``task.multi`` batches)."""

    def __init__(self) -> None:
        self.buffer: list[tuple[str, dict[str, Any]]] = []
        self.published: list[list[tuple[str, dict[str, Any]]]] = []

    def Dispatcher(self, connection: Any, hostname: str | None = None, **kw: Any) -> Any:  # noqa: N802
        assert kw["buffer_group"] == ["task"]
        events = self

        class Dispatcher:
            def send(self, kind: str, **fields: Any) -> None:
                events.buffer.append((kind, {**fields, "hostname": hostname}))

            def flush(self) -> None:
                if events.buffer:
                    events.published.append(events.buffer)
                    events.buffer = []

        return Dispatcher()

    @property
    def sent(self) -> list[tuple[str, dict[str, Any]]]:
        return [event for batch in self.published for event in batch] + self.buffer


def test_each_inline_step_shows_in_flower_as_a_task_of_its_own(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ductor, recorder = make_ductor(database_url)
    events = RecordingEvents()
    monkeypatch.setattr(type(ductor.app), "events", events, raising=False)
    # Every step counts as quick, and no 50 ms flush falls inside the chain on a slow machine.
    monkeypatch.setattr(inline, "HOLD_IF_QUICKER_S", 10.0)
    monkeypatch.setattr(inline, "EVENTS_AT_MOST_EVERY_S", 10.0)
    assert ductor.app.conf.worker_send_task_events  # Ductor turns them on for Flower
    _chain(ductor, 3, _add_one(ductor))
    run_id, first = start_run(ductor, "chain", recorder)
    deliver(ductor, first)

    tokens = {r.node: r.token for r in attempt_rows(ductor, run_id)}
    # Quick steps: their events go out together (one broker message, not one per attempt),
    # at the chain's end at the latest: nothing left in the buffer. Each start, not
    # published at once, is told by its task-succeeded (one event per attempt).
    assert events.buffer == []
    assert [[(kind, fields["uuid"]) for kind, fields in batch] for batch in events.published] == [
        [("task-succeeded", tokens["s1"]), ("task-succeeded", tokens["s2"])],
    ]
    done = events.published[0][0][1]
    assert done["name"] == "inline.add" and done["hostname"] == "w1@host"
    assert done["kwargs"] == repr({"run_id": run_id, "node": "s1"})
    assert done["args"] == repr([tokens["s1"]]) and done["root_id"] == tokens["s1"]
    assert done["result"] == "'succeeded'" and done["retries"] == 0
    assert done["started"] <= time.time() and 0 <= done["runtime"] < 60


def test_after_a_slow_step_the_next_inline_steps_start_is_published_at_once(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Flower sees a step start while it runs when the step before it was slow."""
    ductor, recorder = make_ductor(database_url)
    events = RecordingEvents()
    monkeypatch.setattr(type(ductor.app), "events", events, raising=False)
    monkeypatch.setattr(inline, "HOLD_IF_QUICKER_S", 0.0)  # every step counts as slow
    monkeypatch.setattr(inline, "EVENTS_AT_MOST_EVERY_S", 10.0)
    # The chain's end publishes at once, however recent the last publish was.
    monkeypatch.setattr(task_events, "PUBLISH_AT_MOST_EVERY_S", 0.0)
    _chain(ductor, 3, _add_one(ductor))
    run_id, first = start_run(ductor, "chain", recorder)
    deliver(ductor, first)
    tokens = {r.node: r.token for r in attempt_rows(ductor, run_id)}
    assert [[(kind, fields["uuid"]) for kind, fields in batch] for batch in events.published] == [
        [("task-started", tokens["s1"])],
        [("task-succeeded", tokens["s1"]), ("task-started", tokens["s2"])],
        [("task-succeeded", tokens["s2"])],
    ]


def test_a_runs_first_step_is_announced_at_once_unless_it_ran_quickly_here_before(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run started on a step worker has no step before its first one in the chain: that
    step's ``task-started`` goes out at once the first time this process runs it (it may be
    long: Flower shows it running) and when it ran slowly last time, and is buffered with
    the rest once the same step ran quickly here (one broker publish per quick run)."""
    ductor, _recorder = make_ductor(database_url)
    events = RecordingEvents()
    monkeypatch.setattr(type(ductor.app), "events", events, raising=False)
    monkeypatch.setattr(inline, "HOLD_IF_QUICKER_S", 10.0)  # every step counts as quick
    monkeypatch.setattr(inline, "EVENTS_AT_MOST_EVERY_S", 10.0)
    monkeypatch.setattr(inline, "_last_ran_by_step", {})  # a new process
    # Each run's end publishes at once, however recent the last publish was.
    monkeypatch.setattr(task_events, "PUBLISH_AT_MOST_EVERY_S", 0.0)
    _chain(ductor, 2, _add_one(ductor, name="inline.first_add"))

    def one_run() -> tuple[list[list[tuple[str, str]]], str, str]:
        events.published.clear()
        run_id = ductor.start("chain").run_id
        assert first_tick(ductor.runtime, run_id, "w1@host", QUEUE) == "committed"
        assert run_row(ductor, run_id).output == 2
        s0, s1 = (r.token for r in attempt_rows(ductor, run_id))
        batches = [[(kind, f["uuid"]) for kind, f in batch] for batch in events.published]
        return batches, s0, s1

    def announced_at_once(s0: str, s1: str) -> list[list[tuple[str, str]]]:
        return [[("task-started", s0)], [("task-succeeded", s0), ("task-succeeded", s1)]]

    published, s0, s1 = one_run()  # never ran in this process
    assert published == announced_at_once(s0, s1)
    # Announced at once: its end does not tell its start again; the next one's does.
    [[(_, told)], [(_, s0_done), (_, s1_done)]] = events.published
    assert "started" not in s0_done and s1_done["started"] and s1_done["name"] == told["name"]
    published, s0, s1 = one_run()  # ran quickly last time: one publish, at the run's end
    assert published == [[("task-succeeded", s0), ("task-succeeded", s1)]]
    inline._last_ran_by_step["inline.first_add"] = 60.0  # slow last time (over the bound)
    published, s0, s1 = one_run()
    assert published[0] == [("task-started", s0)]


def test_quick_runs_one_after_another_publish_their_events_together(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chain that ends soon after its thread's last publish leaves its events to a publish
    ``PUBLISH_AT_MOST_EVERY_S`` after that one (a timer's), with whatever the next chains
    buffer meanwhile: one broker message for several quick runs. A chain that raises
    publishes at once, and so does a worker process that stops with a publish put off."""
    from celery import signals

    ductor, _recorder = make_ductor(database_url)
    events = RecordingEvents()
    monkeypatch.setattr(type(ductor.app), "events", events, raising=False)
    monkeypatch.setattr(inline, "HOLD_IF_QUICKER_S", 10.0)  # every step counts as quick
    monkeypatch.setattr(inline, "EVENTS_AT_MOST_EVERY_S", 10.0)
    monkeypatch.setattr(inline, "_last_ran_by_step", {"inline.add": 0.0})  # quick before
    window = 3.0
    monkeypatch.setattr(task_events, "PUBLISH_AT_MOST_EVERY_S", window)
    add = _add_one(ductor)
    _chain(ductor, 2, add)

    def one_run() -> list[str]:
        """Its start message's id and its attempts' tokens, as its events name them."""
        run_id = ductor.start("chain").run_id
        message = first_tick_id(run_id)
        assert first_tick(ductor.runtime, run_id, "w1@host", QUEUE, message) == "committed"
        return [message, *(r.token for r in attempt_rows(ductor, run_id))]

    def batches() -> list[list[str]]:
        return [[f["uuid"] for _, f in batch] for batch in events.published]

    began = time.monotonic()
    first = one_run()  # no publish before: at once
    assert batches() == [first]
    # Nothing left to publish: no timer (the start message's own ``publishing_after`` ends
    # after the chain's, which published).
    assert task_events._local.buffer.later is None
    second = one_run()  # within the window of that publish: put off
    assert batches() == [first] and [f["uuid"] for _, f in events.buffer] == second
    deadline = time.monotonic() + window + 30
    while len(events.published) < 2:
        assert time.monotonic() < deadline, "the put-off publish never came"
        time.sleep(0.05)
    assert time.monotonic() >= began + window  # not before the window's end
    assert batches() == [first, second] and events.buffer == []

    # Put off again, then the pool process stops: Celery's signal publishes it at once.
    third = one_run()
    fourth = one_run()
    # The window may have ended meanwhile (a slow machine): then some went out, in order.
    early = [u for b in batches()[2:] for u in b]
    assert early == (third + fourth)[: len(early)] and len(early) < len(third + fourth)
    signals.worker_process_shutdown.send(sender=None, pid=os.getpid(), exitcode=0)
    assert [u for b in batches()[2:] for u in b] == third + fourth and events.buffer == []

    # A chain that raises publishes at once, however recent the last publish.
    def exits(ctx: StepContext, value: int = 0) -> int:
        raise SystemExit(3)

    wf = Workflow("exits_at_once")
    wf.step("a", add)
    wf.step("b", ductor.step(name="inline.exits_at_once")(exits), after=["a"])
    ductor.register(wf)
    published = len(events.published)
    run_id = ductor.start("exits_at_once").run_id
    with pytest.raises(SystemExit):
        first_tick(ductor.runtime, run_id, "w1@host", QUEUE, first_tick_id(run_id))
    assert len(events.published) == published + 1 and events.buffer == []
    assert events.published[-1][-1][0] == "task-failed"


def test_a_runs_start_message_is_one_task_event_published_with_its_chains(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Celery sends no events of its own for the start message (``ductor.first_tick``: its
    three cost the worker's main process about 0.6 ms per run); its first tick sends one
    ``task-succeeded`` that names the task as ``task-received`` would (name, args, when it
    was received and started), so Flower still lists it, and it goes out in the same publish
    as the chain's quick steps. A start message forwarded to the coordinator publishes its
    event at once."""
    ductor, _recorder = make_ductor(database_url)
    assert ductor.app.tasks[FIRST_TICK_TASK_NAME].send_events is False
    events = RecordingEvents()
    monkeypatch.setattr(type(ductor.app), "events", events, raising=False)
    monkeypatch.setattr(inline, "HOLD_IF_QUICKER_S", 10.0)  # every step counts as quick
    monkeypatch.setattr(inline, "EVENTS_AT_MOST_EVERY_S", 10.0)
    monkeypatch.setattr(inline, "_last_ran_by_step", {"inline.add": 0.0})  # quick before
    _chain(ductor, 2, _add_one(ductor))
    run_id = ductor.start("chain").run_id
    message = first_tick_id(run_id)
    before = time.time()
    assert first_tick(ductor.runtime, run_id, "w1@host", QUEUE, message) == "committed"
    s0, s1 = (r.token for r in attempt_rows(ductor, run_id))
    assert [[(kind, f["uuid"]) for kind, f in batch] for batch in events.published] == [
        [("task-succeeded", message), ("task-succeeded", s0), ("task-succeeded", s1)]
    ]
    fields = events.published[0][0][1]
    assert fields["name"] == FIRST_TICK_TASK_NAME and fields["hostname"] == "w1@host"
    assert fields["args"] == repr([run_id]) and fields["root_id"] == message
    assert fields["result"] == "'committed'" and fields["retries"] == 0
    assert before <= fields["received"] == fields["started"] <= time.time()
    assert 0 <= fields["runtime"] < 60

    # Forwarded (this worker ticks nothing): the event goes out on its own, at once.
    events.published.clear()
    settings = dataclasses.replace(ductor.runtime.settings, eager_ticks=False)
    monkeypatch.setattr(ductor.runtime, "settings", settings)
    run_id = ductor.start("chain").run_id
    assert first_tick(ductor.runtime, run_id, "w1@host", QUEUE, "start-2") == "forwarded"
    assert [[(kind, f["uuid"], f["result"]) for kind, f in b] for b in events.published] == [
        [("task-succeeded", "start-2", "'forwarded'")]
    ]
    # Called with no message (no task id): no event.
    events.published.clear()
    first_tick(ductor.runtime, ductor.start("chain").run_id, "w1@host", QUEUE)
    assert events.sent == []


def test_an_inline_step_that_exits_its_process_shows_failed_in_flower(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quick chain's step whose run raises through the worker (``SystemExit``) sends
    ``task-failed``, with what its start would have told: not left started, nor unseen."""
    ductor, recorder = make_ductor(database_url)
    events = RecordingEvents()
    monkeypatch.setattr(type(ductor.app), "events", events, raising=False)
    monkeypatch.setattr(inline, "HOLD_IF_QUICKER_S", 10.0)  # every step counts as quick
    monkeypatch.setattr(inline, "EVENTS_AT_MOST_EVERY_S", 10.0)

    def exits(ctx: StepContext, value: int = 0) -> int:
        raise SystemExit(3)

    wf = Workflow("exits_inline")
    wf.step("a", _add_one(ductor))
    wf.step("b", ductor.step(name="inline.exit_now")(exits), after=["a"])
    ductor.register(wf)
    run_id, first = start_run(ductor, "exits_inline", recorder)
    events.published.clear()
    with pytest.raises(SystemExit):
        deliver(ductor, first)
    tokens = {r.node: r.token for r in attempt_rows(ductor, run_id)}
    assert [(kind, f["uuid"]) for kind, f in events.sent] == [("task-failed", tokens["b"])]
    failed = events.sent[0][1]
    assert failed["name"] == "inline.exit_now" and "SystemExit(3)" in failed["exception"]
    assert failed["started"] and failed["root_id"] == tokens["b"]
    assert events.buffer == []  # published on the way out


def test_a_start_messages_event_is_never_left_in_the_buffer(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first tick that fails wakes the coordinator, then sends its event ("failed"), at
    once; when the wake-up itself raises, no event is sent and none waits in the thread's
    buffer for another task's publish."""
    from ductor_celery.runtime import steps

    ductor, recorder = make_ductor(database_url)
    events = RecordingEvents()
    monkeypatch.setattr(type(ductor.app), "events", events, raising=False)
    _chain(ductor, 2, _add_one(ductor))

    def tick_fails(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("database away")

    monkeypatch.setattr(steps, "run_tick", tick_fails)
    run_id = ductor.start("chain").run_id
    assert first_tick(ductor.runtime, run_id, "w1@host", QUEUE, "start-1") == "failed"
    assert recorder.wakes == [run_id]
    assert [[(k, f["uuid"], f["result"]) for k, f in b] for b in events.published] == [
        [("task-succeeded", "start-1", "'failed'")]
    ]

    def wake_fails(_run_id: str, _quick: Any = None) -> None:
        raise ConnectionError("broker away")

    events.published.clear()
    monkeypatch.setattr(recorder, "wake", wake_fails)
    with pytest.raises(ConnectionError):
        first_tick(ductor.runtime, run_id, "w1@host", QUEUE, "start-2")
    assert events.sent == []


def test_no_events_are_sent_when_the_user_turned_them_off(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ductor, recorder = make_ductor(database_url)
    ductor.app.conf.worker_send_task_events = False
    events = RecordingEvents()
    monkeypatch.setattr(type(ductor.app), "events", events, raising=False)
    _chain(ductor, 3, _add_one(ductor))
    run_id, first = start_run(ductor, "chain", recorder)
    deliver(ductor, first)
    assert run_row(ductor, run_id).output == 3 and events.sent == []


@pytest.mark.parametrize("value", [-1, True, "many", 1.5])
def test_a_bad_inline_steps_setting_is_refused_by_name(value: Any) -> None:
    with pytest.raises(ValueError, match="ductor_inline_steps must be a whole number"):
        Settings.from_conf({"ductor_inline_steps": value})


def test_inline_steps_setting_reads_strings_from_env_driven_configs() -> None:
    assert Settings.from_conf({"ductor_inline_steps": "7"}).inline_steps == 7
    assert Settings.from_conf({}).inline_steps == 50


def test_compensations_after_the_first_run_inline(url: str) -> None:
    """docs/compensation.md: the failure's tick starts the saga and wakes the run to read the
    first compensated node's output; that compensation goes out as a message, and the next
    one runs inline after it, in the same worker, with no message of its own."""
    ductor, recorder = make_ductor(url)
    ran: list[str] = []

    @ductor.step(name="inline.book")
    def book(ctx: StepContext) -> str:
        ran.append(ctx.node)
        return f"booked {ctx.node}"

    @ductor.step(name="inline.fail", retry=RetryPolicy(max_attempts=1))
    def fail(ctx: StepContext) -> None:
        ran.append(ctx.node)
        raise RuntimeError("sold out")

    @ductor.step(name="inline.undo")
    def undo(ctx: StepContext, output: str, input: Any) -> str:
        ran.append(ctx.node)
        return f"undid {output}"

    wf = Workflow("inline_saga")
    wf.step("a", book, compensate=undo)
    wf.step("b", book, after=["a"], compensate=undo)
    wf.step("c", fail, after=["b"])
    ductor.register(wf)
    run_id, first = start_run(ductor, "inline_saga", recorder)
    with _as_message(ductor, first):
        deliver(ductor, first)
    assert ran == ["a", "b", "c"] and recorder.steps() == []
    # The failing tick woke the run (an outbox row) to read b's output for its compensation.
    assert [(r.kind, r.run_id) for r in recorder.rows] == [("wakeup", run_id)]
    recorder.rows.clear()
    assert run_tick(ductor.runtime, run_id) == "committed"
    [undo_b] = [r for r in recorder.rows if r.kind == "step"]
    assert undo_b.payload["node"] == "b~compensate"
    recorder.rows.clear()
    with _as_message(ductor, undo_b):
        deliver(ductor, undo_b)
    assert ran == ["a", "b", "c", "b~compensate", "a~compensate"]
    assert recorder.steps() == []  # a's compensation needed no message
    assert run_row(ductor, run_id).status == "failed"
    assert ductor.get(run_id).compensations[1].output == "undid booked a"
