"""Which broker the e2e clusters run on, and what tests do to a queue behind ductor's back.

``DUCTOR_TEST_BROKER`` (``redis`` by default, or ``rabbitmq``) picks the broker of every
cluster (``conftest.py``). Fault tests that lose a message on purpose, or wait for a queue to
drain, go through these helpers so that they mean the same on both brokers.
"""

from __future__ import annotations

import os

import kombu
import pytest
import redis

TEST_BROKERS = ("redis", "rabbitmq")


def e2e_broker() -> str:
    """The broker the e2e clusters use: ``$DUCTOR_TEST_BROKER``, ``redis`` by default."""
    broker = os.environ.get("DUCTOR_TEST_BROKER", "").strip().lower() or "redis"
    if broker not in TEST_BROKERS:
        raise pytest.UsageError(
            f"DUCTOR_TEST_BROKER={os.environ['DUCTOR_TEST_BROKER']!r}: "
            f"expected one of {', '.join(TEST_BROKERS)}"
        )
    return broker


def is_amqp(broker_url: str) -> bool:
    return broker_url.split("://", 1)[0] in ("amqp", "amqps", "pyamqp")


#: kombu's Redis transport keeps a queue's messages of priority ``p > 0`` in a list of its own,
#: ``<queue>\x06\x16<p>``, for each of its default ``priority_steps``; ductor's step messages
#: carry their run's priority (docs/flow-control.md), so most of them live there.
REDIS_PRIORITY_STEPS = (0, 3, 6, 9)


def redis_lists(queue: str) -> list[str]:
    """The Redis lists that hold ``queue``'s messages, one per priority step."""
    return [queue if p == 0 else f"{queue}\x06\x16{p}" for p in REDIS_PRIORITY_STEPS]


def queue_length(broker_url: str, queue: str) -> int:
    """Messages ready on ``queue`` (not those delivered and unacknowledged); 0 if it does not
    exist yet."""
    if is_amqp(broker_url):
        with kombu.Connection(broker_url) as conn:
            try:
                return int(conn.default_channel.queue_declare(queue, passive=True).message_count)
            except conn.channel_errors as exc:  # NOT_FOUND: nothing was ever sent there
                if getattr(exc, "reply_code", None) != 404:
                    raise
                return 0
    client = redis.Redis.from_url(broker_url)
    try:
        return sum(int(client.llen(name)) for name in redis_lists(queue))
    finally:
        client.close()


def purge(broker_url: str, queue: str) -> None:
    """Throw away every message ready on ``queue`` (a lost message, as far as ductor knows)."""
    if is_amqp(broker_url):
        with kombu.Connection(broker_url) as conn:
            try:
                conn.default_channel.queue_purge(queue)
            except conn.channel_errors as exc:  # NOT_FOUND: nothing was ever sent there
                if getattr(exc, "reply_code", None) != 404:
                    raise
        return
    client = redis.Redis.from_url(broker_url)
    try:
        client.delete(*redis_lists(queue))
    finally:
        client.close()
