"""End to end with real workers: ``celery worker -Q ductor-steps`` and ``-Q ductor-coord -c 1``."""

from __future__ import annotations

import time
from typing import Any

import pytest
import sqlalchemy as sa

from ductor_celery import NodeStatus, RunStatus

pytestmark = pytest.mark.e2e
#: Run again over RabbitMQ by scripts/test (conftest.py, "broker_core").
broker_core = pytest.mark.broker_core


@pytest.fixture
def ductor(shared_cluster: Any, client_for: Any) -> Any:
    return client_for(shared_cluster)


@broker_core
def test_diamond_runs_with_the_right_outputs(ductor: Any, shared_cluster: Any) -> None:
    handle = ductor.start("diamond", input={"x": 4, "extra": True})
    view = ductor.wait(handle.run_id, timeout=30)
    assert view.status == RunStatus.SUCCEEDED, view.error
    assert view.output == {"join": {"left": 10, "right": 15}, "start": 5}
    assert {n: v.status for n, v in view.nodes.items()} == {
        "start": "succeeded",
        "left": "succeeded",
        "right": "succeeded",
        "extra": "succeeded",
        "join": "succeeded",
    }
    assert view.nodes["extra"].output == 101
    assert view.context == {"collected": ["left", "right"]}
    assert all(v.attempts == 1 for v in view.nodes.values())
    assert shared_cluster.executions(handle.run_id) == 5


@broker_core
def test_when_falsy_skips_the_node_and_the_join_still_runs(ductor: Any) -> None:
    view = ductor.wait(ductor.start("diamond", input={"x": 1}).run_id, timeout=30)
    assert view.status == RunStatus.SUCCEEDED
    assert view.nodes["extra"].status == NodeStatus.SKIPPED
    assert view.nodes["join"].status == NodeStatus.SUCCEEDED


@broker_core
def test_flaky_step_succeeds_on_attempt_three(ductor: Any, shared_cluster: Any) -> None:
    handle = ductor.start("flaky", input={"fail_times": 2})
    view = ductor.wait(handle.run_id, timeout=30)
    assert view.status == RunStatus.SUCCEEDED
    assert view.output == {"succeeded_on": 3}
    assert view.nodes["flaky"].attempts == 3
    assert shared_cluster.executions(handle.run_id, "flaky") == 3


@broker_core
def test_failing_step_fails_the_run_with_its_error(ductor: Any, shared_cluster: Any) -> None:
    handle = ductor.start("failing")
    view = ductor.wait(handle.run_id, timeout=30)
    assert view.status == RunStatus.FAILED
    assert view.error["node"] == "boom"
    assert view.error["type"] == "ValueError"
    assert "always fails" in view.error["message"]
    assert view.nodes["boom"].status == NodeStatus.FAILED
    assert view.nodes["boom"].attempts == 2  # max_attempts=2
    assert view.nodes["never"].status == NodeStatus.PENDING
    assert shared_cluster.executions(handle.run_id, "never") == 0


@broker_core
def test_non_retryable_error_fails_without_retry(ductor: Any, shared_cluster: Any) -> None:
    handle = ductor.start("fatal")
    view = ductor.wait(handle.run_id, timeout=30)
    assert view.status == RunStatus.FAILED
    assert view.nodes["fatal"].attempts == 1
    assert shared_cluster.executions(handle.run_id) == 1


@broker_core
def test_unserializable_result_fails_once_and_the_worker_survives(
    ductor: Any, shared_cluster: Any
) -> None:
    handle = ductor.start("bad_result")
    view = ductor.wait(handle.run_id, timeout=30)
    assert view.status == RunStatus.FAILED
    assert "not JSON-serializable" in view.error["message"]
    assert view.nodes["bad"].attempts == 1
    # The same worker processes keep serving.
    after = ductor.wait(ductor.start("diamond", input={"x": 0}).run_id, timeout=30)
    assert after.status == RunStatus.SUCCEEDED


@broker_core
def test_start_twice_with_an_open_workflow_id_returns_the_same_run(ductor: Any) -> None:
    first = ductor.start("flaky", input={"fail_times": 1}, workflow_id="order-42")
    second = ductor.start("flaky", input={"fail_times": 1}, workflow_id="order-42")
    assert first.run_id == second.run_id
    view = ductor.wait("order-42", timeout=30)
    assert view.run_id == first.run_id and view.status == RunStatus.SUCCEEDED
    third = ductor.start("flaky", input={"fail_times": 0}, workflow_id="order-42")
    assert third.run_id != first.run_id  # the first run is closed: a new one starts
    assert ductor.wait(third.run_id, timeout=30).status == RunStatus.SUCCEEDED
    listed = ductor.list_runs(workflow="flaky", limit=100)
    assert {first.run_id, third.run_id} <= {v.run_id for v in listed}


@broker_core
def test_fifty_duplicate_wakeups_leave_the_run_as_one_would(
    ductor: Any, shared_cluster: Any
) -> None:
    handle = ductor.start("chain10", input={"value": 7})
    view = ductor.wait(handle.run_id, timeout=30)
    assert view.status == RunStatus.SUCCEEDED
    version = shared_cluster.record_version(handle.run_id)
    with shared_cluster.engine.connect() as conn:
        transitions = conn.execute(
            sa.text("SELECT count(*) FROM eec_workflow_history WHERE run_id = :r"),
            {"r": handle.run_id},
        ).scalar_one()
    for _ in range(50):
        ductor.runtime.wake(handle.run_id)
    # A marker run queued behind the duplicates tells us they have all been consumed.
    assert ductor.wait(ductor.start("chain10", input={"value": 1}).run_id, timeout=30).status == (
        RunStatus.SUCCEEDED
    )
    assert shared_cluster.record_version(handle.run_id) == version
    with shared_cluster.engine.connect() as conn:
        assert (
            conn.execute(
                sa.text("SELECT count(*) FROM eec_workflow_history WHERE run_id = :r"),
                {"r": handle.run_id},
            ).scalar_one()
            == transitions
        )
    assert shared_cluster.executions(handle.run_id) == 10
    assert ductor.get(handle.run_id).output == 7


@broker_core
def test_many_concurrent_runs_all_finish_with_each_step_applied_once(
    ductor: Any, shared_cluster: Any
) -> None:
    handles = [ductor.start("chain10", input={"value": i}) for i in range(20)]
    for i, handle in enumerate(handles):
        view = ductor.wait(handle.run_id, timeout=60)
        assert view.status == RunStatus.SUCCEEDED and view.output == i
    for handle in handles:
        attempts = shared_cluster.attempts(handle.run_id)
        assert len(attempts) == 10
        assert all(a.outcome == "succeeded" and a.folded for a in attempts)


@broker_core
def test_an_oversized_result_fails_the_attempt_without_retry(
    ductor: Any, shared_cluster: Any
) -> None:
    # 64 MiB of text is 64 MiB and 2 bytes of JSON (its quotes): over the default limit.
    handle = ductor.start("big", input={"size": 64 * 1024 * 1024})
    view = ductor.wait(handle.run_id, timeout=60)
    assert view.status == RunStatus.FAILED
    assert "over ductor_max_payload_bytes=67108864" in view.error["message"]
    assert view.nodes["big"].attempts == 1
    assert shared_cluster.executions(handle.run_id) == 1
    small = ductor.wait(ductor.start("big", input={"size": 10}).run_id, timeout=30)
    assert small.status == RunStatus.SUCCEEDED and small.output == "x" * 10


def test_an_attempt_that_stops_heartbeating_is_retried_and_its_late_result_ignored(
    ductor: Any, shared_cluster: Any
) -> None:
    handle = ductor.start("heartbeats", input={"hang": 6})
    view = ductor.wait(handle.run_id, timeout=30)
    assert view.status == RunStatus.SUCCEEDED
    assert view.output == "done on attempt 2"
    assert view.nodes["beat"].attempts == 2
    first, second = shared_cluster.attempts(handle.run_id)
    assert first.outcome == "timed_out" and second.outcome == "succeeded"
    with shared_cluster.engine.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT error->>'message' AS message, heartbeat_details FROM "
                "eec_workflow_step_attempt WHERE token = :t"
            ),
            {"t": first.token},
        ).one()
    assert "sent no heartbeat for 1.5s" in row.message
    assert row.heartbeat_details == {"progress": 0.1, "attempt": 1}
    time.sleep(6)  # the hung attempt wakes up and tries to record its result: refused
    assert ductor.get(handle.run_id).output == "done on attempt 2"
    assert [a.outcome for a in shared_cluster.attempts(handle.run_id)] == ["timed_out", "succeeded"]
