"""Compensation end to end (docs/compensation.md): real ``celery worker`` processes run a
3-step saga whose third step fails. The steps' own log (``saga_log``, written by the steps,
not by ductor) shows each refund ran exactly once, in reverse order of the bookings, and the
run ends ``failed`` with its compensations recorded."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from ductor_celery import NodeStatus, RunStatus

pytestmark = pytest.mark.e2e


@pytest.fixture
def saga_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """saga_app's Ductor in this process, pointed at a cluster's database and broker."""

    def make(cluster: Any) -> Any:
        monkeypatch.setenv("DUCTOR_DATABASE_URL", cluster.database_url)
        monkeypatch.setenv("E2E_BROKER_URL", cluster.broker_url)
        sys.modules.pop("saga_app", None)
        module = importlib.import_module("saga_app")
        with cluster.engine.begin() as conn:
            conn.execute(sa.text(module.LOG_DDL))
        return module.ductor

    yield make
    sys.modules.pop("saga_app", None)


def _log(cluster: Any, run_id: str) -> list[tuple[str, str]]:
    with cluster.engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT action, subject FROM saga_log WHERE run_id = :r ORDER BY id"),
            {"r": run_id},
        ).all()
    return [(r.action, r.subject) for r in rows]


@pytest.mark.parametrize("flaky", [False, True], ids=["clean", "flaky-refunds"])
def test_a_failed_saga_refunds_in_reverse_order_exactly_once_each(
    cluster_factory: Any, saga_client: Any, flaky: bool
) -> None:
    cluster = cluster_factory(app="saga_app")
    ductor = saga_client(cluster)
    cluster.start_coordinator()
    cluster.start_steps(concurrency=2, name="steps-a")
    cluster.start_steps(concurrency=2, name="steps-b")
    handles = [ductor.start("trip", input={"flaky_refunds": flaky}) for _ in range(4)]
    for handle in handles:
        view = ductor.wait(handle.run_id, timeout=90)
        assert view.status == RunStatus.FAILED, view.error
        assert view.error["node"] == "car" and "no car available" in view.error["message"]
        assert [(c.node, c.status) for c in view.compensations] == [
            ("hotel", NodeStatus.SUCCEEDED),
            ("flight", NodeStatus.SUCCEEDED),
        ]
        prefix = handle.run_id[:8]
        log = _log(cluster, handle.run_id)
        refunds = [entry for entry in log if entry[0] == "refund"]
        assert refunds == [("refund", f"hotel-{prefix}"), ("refund", f"flight-{prefix}")]
        assert [entry for entry in log if entry[0] == "book"] == [
            ("book", "flight"),
            ("book", "hotel"),
            ("book", "car"),
            ("book", "car"),
        ]
        # Every refund comes after the failure it answers.
        assert log.index(refunds[0]) > max(i for i, e in enumerate(log) if e == ("book", "car"))
        if flaky:
            assert [c.attempts for c in view.compensations] == [2, 2]
            assert [e[0] for e in log].count("refund-failed") == 2
        else:
            assert [c.attempts for c in view.compensations] == [1, 1]


def test_a_booking_still_running_when_the_run_fails_is_waited_for_and_undone(
    cluster_factory: Any, saga_client: Any
) -> None:
    """The car fails (twice) while the slow flight booking is running in another worker: the
    run does not throw the booking away, it waits for it and then cancels it."""
    cluster = cluster_factory(app="saga_app")
    ductor = saga_client(cluster)
    cluster.start_coordinator()
    cluster.start_steps(concurrency=2, name="steps-a")
    cluster.start_steps(concurrency=2, name="steps-b")
    handle = ductor.start("race", input={})
    view = ductor.wait(handle.run_id, timeout=90)
    assert view.status == RunStatus.FAILED, view.error
    assert view.error["node"] == "car"
    assert [(c.node, c.status) for c in view.compensations] == [("flight", NodeStatus.SUCCEEDED)]
    log = _log(cluster, handle.run_id)
    booked = ("book", "flight")
    refund = ("refund", f"flight-{handle.run_id[:8]}")
    assert log.count(booked) == 1 and log.count(refund) == 1
    # The car had failed for good before the flight was booked: the saga waited for it.
    assert log.index(booked) > max(i for i, e in enumerate(log) if e == ("book", "car"))
    assert log.index(refund) > log.index(booked)
