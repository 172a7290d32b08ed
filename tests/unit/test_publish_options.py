"""What ductor's publishes ask of Celery (runtime/dispatch.py): which of them a ``task-sent``
event follows (a step message's, as for any Celery task when ``task_send_sent_event`` is on:
Flower's view of messages still waiting; never a run's start message's, which Flower lists by
the one event its first tick sends), and when they declare their queue (at a connection's
first publish to it, as kombu's own cache says)."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from kombu import Exchange, Queue

from ductor_celery.coordinator.port import OutboxRow
from ductor_celery.engine.kinds import DispatchKind
from ductor_celery.runtime.dispatch import FIRST_TICK_TASK_NAME, Dispatcher, first_tick_id


@pytest.fixture
def app() -> Celery:
    app = Celery("sent_events", set_as_current=False, broker="memory://")
    app.conf.task_send_sent_event = True
    return app


def _published(app: Celery, send: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """The task events and the task ids of the task messages ``send`` published."""
    with app.connection_for_write() as conn:
        events = Queue("sent-events", Exchange("celeryev", type="topic"), routing_key="task.#")
        tasks = Queue("ductor-steps", Exchange("ductor-steps"), routing_key="ductor-steps")
        for queue in (events, tasks):
            queue(conn.default_channel).declare()
            # kombu's in-memory broker is the whole process's: what another test left.
            queue(conn.default_channel).purge()
        send()
        found_events: list[dict[str, Any]] = []
        found_ids: list[str] = []
        while (message := events(conn.default_channel).get(no_ack=True)) is not None:
            found_events.append(message.decode())
        while (message := tasks(conn.default_channel).get(no_ack=True)) is not None:
            found_ids.append(message.headers["id"])
    return found_events, found_ids


def test_a_step_message_is_followed_by_its_sent_event(app: Celery) -> None:
    dispatcher = Dispatcher(app, "ductor-steps", "ductor-coord")
    token = "a" * 32 + ":s1:1"
    row = OutboxRow(1, "a" * 32, DispatchKind.STEP, "c.step", None, {"token": token, "node": "s1"})
    events, ids = _published(app, lambda: dispatcher.send([row]))
    assert ids == [token]
    assert [(e["type"], e["uuid"], e["name"]) for e in events] == [("task-sent", token, "c.step")]


def test_a_runs_start_message_is_sent_with_no_sent_event(app: Celery) -> None:
    dispatcher = Dispatcher(app, "ductor-steps", "ductor-coord")
    run_id = "b" * 32
    events, ids = _published(app, lambda: dispatcher.first_tick(run_id))
    assert ids == [first_tick_id(run_id)]
    assert events == []
    # The app's own tasks keep theirs: the setting is the user's, left as it is.
    sent, _ = _published(app, lambda: app.send_task("user.task", queue="ductor-steps"))
    assert [(e["type"], e["name"]) for e in sent] == [("task-sent", "user.task")]


def test_the_start_message_is_still_the_first_tick_task(app: Celery) -> None:
    """What the worker runs is unchanged: the message names the first-tick task."""
    dispatcher = Dispatcher(app, "ductor-steps", "ductor-coord")
    with app.connection_for_write() as conn:
        tasks = Queue("ductor-steps", Exchange("ductor-steps"), routing_key="ductor-steps")
        tasks(conn.default_channel).declare()
        dispatcher.first_tick("c" * 32)
        message = tasks(conn.default_channel).get(no_ack=True)
    assert message.headers["task"] == FIRST_TICK_TASK_NAME
    assert message.decode()[0] == ["c" * 32]


def test_a_queue_is_declared_at_a_connections_first_publish_only(app: Celery) -> None:
    """Celery has every publish declare its queue; ductor's skip it while kombu's cache says
    the connection declared that queue already (``dispatch.declared``), as kombu itself then
    would, and declare it again once the cache is emptied (a connection replaced or
    reconnected), even between the check and the publish (a retry after a reconnect). Every
    message arrives."""
    from celery.signals import before_task_publish

    declares: list[bool] = []  # whether each publish, as kombu reads it, declares anything
    forget_before_publish: list[Any] = []

    def record(declare: Any = None, **_: Any) -> None:
        for connection in forget_before_publish:
            connection.declared_entities.clear()
        declares.append(bool(declare))

    def forget() -> None:
        """What kombu does when the connection closes, is replaced or reconnects: forget
        what it declared."""
        with app.producer_or_acquire() as producer:
            producer.connection.declared_entities.clear()

    before_task_publish.connect(record, weak=False)
    try:
        dispatcher = Dispatcher(app, "ductor-steps", "ductor-coord")
        run_ids = [c * 32 for c in "defg"]
        _events, ids = _published(
            app, lambda: [dispatcher.first_tick(run_id) for run_id in run_ids[:2]]
        )
        assert ids == [first_tick_id(r) for r in run_ids[:2]]
        assert declares == [True, False]
        forget()
        declares.clear()
        _events, ids = _published(app, lambda: dispatcher.first_tick(run_ids[2]))
        assert ids == [first_tick_id(run_ids[2])] and declares == [True]
        # Forgotten after ductor looked, before kombu publishes: kombu declares it again.
        with app.producer_or_acquire() as producer:
            assert hash(app.amqp.queues["ductor-steps"]) in producer.connection.declared_entities
            forget_before_publish.append(producer.connection)
        declares.clear()
        _events, ids = _published(app, lambda: dispatcher.first_tick(run_ids[3]))
        assert ids == [first_tick_id(run_ids[3])] and declares == [True]
        forget_before_publish.clear()
        with app.producer_or_acquire() as producer:
            assert hash(app.amqp.queues["ductor-steps"]) in producer.connection.declared_entities
    finally:
        before_task_publish.disconnect(record)
