"""A run's priority on the broker (runtime/dispatch.py): RabbitMQ reads a message's priority
higher-first as ductor does; kombu's Redis transport serves priority 0 first, so ductor sends
``9 - priority`` there. Step messages of a run carry its priority (coordinator/rows.py)."""

from __future__ import annotations

from types import SimpleNamespace

from ductor_celery.coordinator.rows import step_intent
from ductor_celery.runtime.dispatch import Dispatcher


def _dispatcher(amqp: bool) -> Dispatcher:
    return Dispatcher(None, "ductor-steps", "ductor-coord", queues=SimpleNamespace(amqp=amqp))  # type: ignore[arg-type]


def test_rabbitmq_gets_the_priority_as_it_is_and_redis_gets_it_reversed() -> None:
    rabbit, redis = _dispatcher(True), _dispatcher(False)
    assert [rabbit.broker_priority(p) for p in (0, 5, 9)] == [0, 5, 9]
    assert [redis.broker_priority(p) for p in (0, 5, 9)] == [9, 4, 0]


def test_a_step_row_carries_its_runs_priority_only_when_set() -> None:
    assert "priority" not in step_intent("r", "t", "n", "s", None)["payload"]
    assert step_intent("r", "t", "n", "s", None, 7)["payload"]["priority"] == 7
