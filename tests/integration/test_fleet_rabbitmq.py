"""RabbitMQ on a fleet host (chaos/fleet_servers.py ``FleetRabbitMQ``, docs/fleet.md): AMQP on
the host's address from another host, ``rabbitmqctl`` inside the host, a persistent message
in a quorum queue kept across a clean restart and a SIGKILL (the ``rabbitmq_restart`` and
``rabbitmq_kill`` faults), nothing left running after ``stop()``. About 20 s; skipped without
network namespaces or RabbitMQ."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "chaos"))
sys.path.insert(0, str(ROOT / "tests"))

import fleet  # noqa: E402
import servers  # noqa: E402


def _rabbitmq_missing() -> str | None:
    try:
        servers.find_rabbitmq_bindir()
    except servers.ServerError as exc:
        return str(exc)
    return None


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        fleet.unavailable_reason() is not None,
        reason=f"no network namespaces here: {fleet.unavailable_reason()}",
    ),
    pytest.mark.skipif(_rabbitmq_missing() is not None, reason=str(_rabbitmq_missing())),
]


def test_rabbitmq_on_a_fleet_host_keeps_a_quorum_message_across_restart_and_kill() -> None:
    import kombu
    from fleet_servers import make_broker

    f = fleet.Fleet()
    f.create(["broker", "driver"])
    seen: dict[str, Any] = {}

    def driver() -> None:
        f.enter("driver")
        broker = make_broker("rabbitmq", f, "broker")
        try:
            broker.start()
            seen["url"] = broker.url(0)
            queue = kombu.Queue("q", durable=True, queue_arguments={"x-queue-type": "quorum"})
            with kombu.Connection(broker.url()) as conn:
                conn.Producer().publish({"n": 1}, routing_key="q", declare=[queue], delivery_mode=2)
            seen["queues"] = broker.ctl("list_queues", "name", "type", "-q")
            time.sleep(2.0)  # RabbitMQ 3.10: a quorum queue SIGKILLed just after its declaration
            broker.restart()
            broker.kill()
            assert not broker.running
            broker.start()
            with kombu.Connection(broker.url()) as conn:
                message = conn.SimpleQueue(queue).get(timeout=10)
                seen["payload"] = message.payload
                message.ack()
        finally:
            broker.stop()

    try:
        thread = threading.Thread(target=driver)
        thread.start()
        thread.join(120)
        assert not thread.is_alive()
        # Nothing of the node (epmd, beam.smp, erl_child_setup) outlives stop().
        leftovers = subprocess.run(
            ["ip", "netns", "pids", f.ns_of("broker")], capture_output=True, text=True, check=True
        ).stdout.split()
    finally:
        f.teardown()
    assert seen["url"] == f"amqp://guest:guest@{f.addr('broker')}:5672/%2F"
    assert "quorum" in seen["queues"]
    assert seen["payload"] == {"n": 1}
    assert not leftovers
