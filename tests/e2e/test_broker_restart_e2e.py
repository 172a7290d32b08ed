"""The broker restarted with runs in flight, on whichever broker the e2e tier runs on
(``DUCTOR_TEST_BROKER``; scripts/test runs it over Redis and over RabbitMQ).

Redis runs without persistence here, so its restart loses every queued message: the sweeper
re-sends unclaimed steps (after 2 s in this test) and wakes runs whose wake-up was lost.
RabbitMQ keeps ductor's quorum queues and their messages across the restart. Either way every
run finishes with its output, each step applied once and run once (the ledger).
test_rabbitmq_e2e.py kills a RabbitMQ node with the re-send out of reach, to show it loses no
message at all.

The workers run under a supervisor, as the README's production set-up asks: about one Redis
restart in fifty makes a Celery 5.7 / kombu 5.7 step worker exit (an ``AttributeError`` on
``conninfo.hostname`` in kombu's Redis transport, acknowledging a message of the lost
connection), and its runs then wait, intact, for a worker to come back.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import sqlalchemy as sa
from brokers import e2e_broker

from ductor_celery import RunStatus

pytestmark = [pytest.mark.e2e, pytest.mark.broker_core]


@pytest.fixture
def broker_server(request: pytest.FixtureRequest) -> Any:
    """The session's server of the e2e broker (the one ``cluster_factory`` uses)."""
    name = "rabbitmq_server" if e2e_broker() == "rabbitmq" else "redis_server"
    return request.getfixturevalue(name)


def test_a_broker_restart_with_runs_in_flight_loses_nothing(
    cluster_factory: Any, client_for: Any, broker_server: Any
) -> None:
    # Every step a message (no inline steps), so that the restart finds some in the broker.
    cluster = cluster_factory(E2E_RESEND_AFTER="2", E2E_INLINE="0")
    cluster.start_steps(concurrency=2)
    cluster.start_coordinator()
    cluster.supervise()
    ductor = client_for(cluster)
    handles = [ductor.start("chain10", input={"value": i}) for i in range(8)]

    def executed() -> int:
        with cluster.engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM e2e_ledger")).scalar_one())

    deadline = time.monotonic() + 60
    while executed() < 16:
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.02)
    broker_server.restart()

    for i, handle in enumerate(handles):
        try:
            view = ductor.wait(handle.run_id, timeout=90)
        except TimeoutError as exc:
            pytest.fail(f"{exc}\n{cluster.diagnosis(handle.run_id)}")
        assert view.status == RunStatus.SUCCEEDED, cluster.logs()
        assert view.output == i
        attempts = cluster.attempts(handle.run_id)
        succeeded = sorted(a.node for a in attempts if a.outcome == "succeeded")
        assert succeeded == sorted(f"s{k}" for k in range(10)), attempts
        assert all(a.folded for a in attempts), attempts
        assert cluster.executions(handle.run_id) == 10, handle.run_id
    crashes = [crash for worker in cluster.workers for crash in worker.crashes]
    unknown = [crash for crash in crashes if "'hostname'" not in crash]
    assert not unknown, unknown
    if crashes:  # shown with -s: how often the supervisor was needed
        print(f"{len(crashes)} worker exit(s) on the restart, restarted")  # noqa: T201
