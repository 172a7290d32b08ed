"""RabbitMQ as ductor's broker (issue 24): real workers on a private RabbitMQ node, whatever
``DUCTOR_TEST_BROKER`` says (each test has a vhost of its own).

* ductor's queues (the steps queue, the coordinator's, a step's own ``queue=``) are quorum
  queues, and the app's other queues are left as Celery makes them;
* ``ductor_classic_queues = True``: classic queues, with ``x-max-priority``;
* a RabbitMQ node killed with work in flight loses no message: with the sweeper's re-send of
  unclaimed steps pushed out of reach, every run still finishes, each step run once;
* a ductor queue left on the broker with another type stops the step worker, the client's
  wake-up and ``ductor doctor`` with an error that names it and the way out, and the run
  started meanwhile finishes once the queue is deleted.

The generic broker restart (both brokers) is tests/e2e/test_broker_restart_e2e.py.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import kombu
import pytest
import sqlalchemy as sa

from ductor_celery import RunStatus
from ductor_celery.doctor import run_checks

pytestmark = pytest.mark.e2e

QUEUES = ("ductor-steps", "ductor-coord", "e2e-side")


def _arguments(queue: dict[str, Any]) -> dict[str, Any]:
    """``rabbitmqctl list_queues``' arguments ([name, type, value] triples) as a dict."""
    return {name: value for name, _, value in queue["arguments"]}


def _run_side_workflow(cluster: Any, ductor: Any) -> None:
    """A run whose steps go through all three of ductor's queues (no inline steps: each step
    is a message)."""
    view = ductor.wait(ductor.start("side_queue", input={"value": 7}).run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED, cluster.logs()
    assert view.output == 7


def test_ductors_queues_are_quorum_queues_and_the_apps_own_are_left_alone(
    cluster_factory: Any, client_for: Any, rabbitmq_server: Any
) -> None:
    vhost = rabbitmq_server.new_vhost()
    cluster = cluster_factory(broker=rabbitmq_server.url(vhost), E2E_EAGER="0", E2E_INLINE="0")
    steps = cluster.start_steps(concurrency=2, queues="ductor-steps,e2e-side")
    cluster.start_coordinator()
    ductor = client_for(cluster)
    _run_side_workflow(cluster, ductor)
    import e2e_app

    # A task of the app's own, on a queue of its own: Celery declares it, as before.
    e2e_app.app.send_task("e2e.someone_elses", args=[1], queue="reports")

    queues = rabbitmq_server.queues(vhost)
    for name in QUEUES:
        assert queues[name]["type"] == "quorum", queues
        assert _arguments(queues[name]) == {"x-queue-type": "quorum"}, queues
    assert queues["reports"]["type"] == "classic", queues
    assert _arguments(queues["reports"]) == {}, queues
    # Celery saw the quorum queues: global QoS, which quorum queues refuse, is off.
    assert "Global QoS is disabled" in steps.log_path.read_text(errors="replace")


def test_with_ductor_classic_queues_they_are_classic_queues_with_priorities(
    cluster_factory: Any, client_for: Any, rabbitmq_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    vhost = rabbitmq_server.new_vhost()
    monkeypatch.setenv("DUCTOR_CLASSIC_QUEUES", "true")  # the client's, as the workers'
    cluster = cluster_factory(
        broker=rabbitmq_server.url(vhost),
        E2E_EAGER="0",
        E2E_INLINE="0",
        DUCTOR_CLASSIC_QUEUES="true",
    )
    cluster.start_steps(concurrency=2, queues="ductor-steps,e2e-side")
    cluster.start_coordinator()
    ductor = client_for(cluster)
    assert ductor.settings.classic_queues is True
    _run_side_workflow(cluster, ductor)

    queues = rabbitmq_server.queues(vhost)
    for name in QUEUES:
        assert queues[name]["type"] == "classic", queues
        assert _arguments(queues[name]) == {"x-max-priority": 9}, queues


def test_a_rabbitmq_crash_mid_run_loses_no_message(
    cluster_factory: Any, client_for: Any, rabbitmq_server: Any
) -> None:
    """SIGKILL of the RabbitMQ node while step messages are queued, in flight and being
    published, then the node started again. Unclaimed step messages are re-sent only after 10
    minutes here, and every step's timeout is longer than the test: a step message the broker
    lost would leave its run stuck. Every run finishes within a minute, with its output, each
    step applied once and run once (the ledger), because a message is on disk before the
    broker confirms it and ductor forgets an outbox row only after that confirm."""
    vhost = rabbitmq_server.new_vhost()
    cluster = cluster_factory(
        broker=rabbitmq_server.url(vhost), E2E_RESEND_AFTER="600", E2E_INLINE="0"
    )
    cluster.start_steps(concurrency=2)
    cluster.start_coordinator()
    # The queues the workers just declared settle first: RabbitMQ 3.10 can lose a quorum
    # queue's Raft member declared well under a second before a crash (consuming from it then
    # hangs for 60 s after the restart); a deployment's queues are long-lived.
    time.sleep(2.5)
    ductor = client_for(cluster)
    handles = [ductor.start("chain10", input={"value": i}) for i in range(24)]

    def executed() -> int:
        with cluster.engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM e2e_ledger")).scalar_one())

    deadline = time.monotonic() + 60
    while executed() < 40:  # well under way, with most of the work still ahead
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.02)
    rabbitmq_server.kill()
    time.sleep(1.0)  # the workers notice, and their publishes fail meanwhile
    rabbitmq_server.start()

    for i, handle in enumerate(handles):
        view = ductor.wait(handle.run_id, timeout=60)
        assert view.status == RunStatus.SUCCEEDED, cluster.logs()
        assert view.output == i
        attempts = cluster.attempts(handle.run_id)
        succeeded = sorted(a.node for a in attempts if a.outcome == "succeeded")
        assert succeeded == sorted(f"s{k}" for k in range(10)), attempts
        assert len(attempts) == 10 and all(a.folded for a in attempts), attempts
        assert cluster.executions(handle.run_id) == 10, handle.run_id


def test_a_ductor_queue_of_another_type_stops_with_an_error_that_says_what_to_do(
    cluster_factory: Any,
    client_for: Any,
    rabbitmq_server: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    vhost = rabbitmq_server.new_vhost()
    url = rabbitmq_server.url(vhost)
    # What ductor and Celery left on a broker before quorum queues: a plain classic queue.
    with kombu.Connection(url) as conn:
        conn.default_channel.queue_declare("ductor-steps", durable=True, auto_delete=False)
    cluster = cluster_factory(broker=url)
    said = [
        "RabbitMQ refused ductor's queue 'ductor-steps'",
        "inequivalent arg 'x-queue-type'",
        f"rabbitmqctl delete_queue ductor-steps -p {vhost}",
        "ductor_classic_queues = True",
    ]

    # The step worker stops before it consumes anything, saying why.
    with pytest.raises(RuntimeError, match="exited") as stopped:
        cluster.start_steps(concurrency=1)
    for words in said:
        assert words in str(stopped.value), stopped.value

    # A client's start is stored; its wake-up is refused, and the log says why.
    ductor = client_for(cluster)
    with caplog.at_level(logging.WARNING, logger="ductor_celery"):
        handle = ductor.start("diamond", input={"x": 1})
    for words in said:
        assert words in caplog.text, caplog.text

    # ductor doctor says it too, and that the coordinator's queue is fine (not there yet).
    checks = {c.name: c for c in run_checks(ductor, timeout=1.0)}
    steps_check = checks["queue ductor-steps declaration"]
    assert not steps_check.ok
    for words in said:
        assert words in steps_check.detail, steps_check.detail
    assert checks["queue ductor-coord declaration"].ok, checks

    # The way out it names: delete the queue; the run started meanwhile then finishes.
    rabbitmq_server.ctl("delete_queue", "ductor-steps", "-p", vhost)
    cluster.start_steps(concurrency=1)
    cluster.start_coordinator()
    view = ductor.wait(handle.run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED, cluster.logs()
    assert rabbitmq_server.queues(vhost)["ductor-steps"]["type"] == "quorum"
