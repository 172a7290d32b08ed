"""Signals, timers, approvals and controls with real workers."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa

from ductor_celery import InvalidOperation, NodeStatus, RunNotFound, RunStatus

pytestmark = pytest.mark.e2e
#: Run again over RabbitMQ by scripts/test (conftest.py, "broker_core").
broker_core = pytest.mark.broker_core


@pytest.fixture
def ductor(shared_cluster: Any, client_for: Any) -> Any:
    return client_for(shared_cluster)


def _wait_for(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@broker_core
def test_a_signal_sent_early_is_kept_until_its_node_is_reached(ductor: Any) -> None:
    handle = ductor.start("signals")
    ductor.signal(handle.run_id, "payment", {"amount": 10}, idempotency_key="pay-1")
    ductor.signal(handle.run_id, "payment", {"amount": 99}, idempotency_key="pay-1")  # ignored
    view = ductor.wait(handle.run_id, timeout=30)
    assert view.status == RunStatus.SUCCEEDED
    assert view.output == {"amount": 10}
    assert view.nodes["paid"].output == {"amount": 10}


@broker_core
def test_signals_to_finished_or_unknown_runs_are_refused(ductor: Any, shared_cluster: Any) -> None:
    handle = ductor.start("flaky", input={"fail_times": 0})
    ductor.wait(handle.run_id, timeout=30)
    with pytest.raises(InvalidOperation, match="succeeded"):
        ductor.signal(handle.run_id, "payment", {})
    with pytest.raises(RunNotFound):
        ductor.signal("no-such-run", "payment", {})
    with shared_cluster.engine.connect() as conn:
        stored = conn.execute(
            sa.text("SELECT count(*) FROM eec_workflow_signal WHERE run_id = :r"),
            {"r": handle.run_id},
        ).scalar_one()
    assert stored == 0


@broker_core
def test_hundred_concurrent_signals_with_twenty_duplicate_keys_apply_eighty_times_in_order(
    ductor: Any, shared_cluster: Any
) -> None:
    handle = ductor.start("counter")
    # 100 sends from 10 threads: keys k0..k79 once each, plus 20 repeats of k0..k19.
    keys = [f"k{i}" for i in range(80)] + [f"k{i}" for i in range(20)]
    accepted: dict[str, int] = {}
    lock = threading.Lock()

    def send(chunk: list[str]) -> None:
        for key in chunk:
            signal_id = ductor.signal(handle.run_id, "tick", {"key": key}, idempotency_key=key)
            with lock:
                assert accepted.setdefault(key, signal_id) == signal_id

    errors: list[BaseException] = []

    def guarded(chunk: list[str]) -> None:
        try:
            send(chunk)
        except BaseException as exc:  # surfaced below with its traceback
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(keys[i::10],)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    view = ductor.wait(handle.run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED
    with shared_cluster.engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT id, payload->>'key' AS key, applied_to FROM eec_workflow_signal "
                "WHERE run_id = :r ORDER BY id"
            ),
            {"r": handle.run_id},
        ).all()
    assert len(rows) == 80  # duplicates were accepted and ignored, not stored
    # Consumed in the order accepted: node s0 got the first accepted signal, s1 the next...
    assert [r.applied_to for r in rows] == [f"s{i}" for i in range(80)]
    assert view.output == [{"key": r.key} for r in rows]


@broker_core
def test_a_sleep_survives_a_coordinator_sigkill_and_fires_once(
    cluster_factory: Any, client_for: Any
) -> None:
    cluster = cluster_factory(E2E_NAP_SECONDS="2")
    cluster.start_steps(concurrency=1)
    coordinator = cluster.start_coordinator()
    ductor = client_for(cluster)
    handle = ductor.start("napper")
    _wait_for(lambda: ductor.get(handle.run_id).nodes["nap"].status == NodeStatus.WAITING)
    coordinator.kill()
    time.sleep(2.5)  # the timer comes due while no coordinator runs
    cluster.start_coordinator(name="coord-again")
    view = ductor.wait(handle.run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED and view.output == "woke"
    with cluster.engine.connect() as conn:
        fired = conn.execute(
            sa.text(
                "SELECT count(*) FROM eec_workflow_history WHERE run_id = :r "
                "AND node = 'nap' AND reason = 'timer fired'"
            ),
            {"r": handle.run_id},
        ).scalar_one()
    assert fired == 1
    assert cluster.executions(handle.run_id, "woke") == 1


@broker_core
def test_approval_and_event_set(ductor: Any) -> None:
    handle = ductor.start("approvals", workflow_id="kyc-1")
    with pytest.raises(InvalidOperation, match="not an approval node"):
        ductor.approve("kyc-1", "kyc", by="alice")
    _wait_for(lambda: ductor.get("kyc-1").nodes["review"].status == NodeStatus.WAITING)
    ductor.approve("kyc-1", "review", by="alice", comment="looks fine")
    with pytest.raises(InvalidOperation):
        ductor.reject("kyc-1", "review", by="bob")  # decided already
    ductor.signal("kyc-1", "id_ok", {"doc": "passport"})
    ductor.signal("kyc-1", "address_ok", {"doc": "bill"})
    view = ductor.wait(handle.run_id, timeout=30)
    assert view.status == RunStatus.SUCCEEDED
    assert view.output["review"]["approved"] is True and view.output["review"]["by"] == "alice"
    assert view.output["kyc"] == {"id_ok": {"doc": "passport"}, "address_ok": {"doc": "bill"}}
    with pytest.raises(InvalidOperation):
        ductor.approve("kyc-1", "review", by="carol")  # too late: the run is finished


@broker_core
def test_reject_fails_the_run(ductor: Any) -> None:
    handle = ductor.start("approvals")
    _wait_for(lambda: ductor.get(handle.run_id).nodes["review"].status == NodeStatus.WAITING)
    ductor.reject(handle.run_id, "review", by="bob", comment="no")
    view = ductor.wait(handle.run_id, timeout=30)
    assert view.status == RunStatus.FAILED
    assert view.nodes["review"].status == NodeStatus.FAILED
    assert "rejected by 'bob'" in view.error["message"]


def _open_attempts(cluster: Any, run_id: str) -> int:
    with cluster.engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM eec_workflow_step_attempt "
                    "WHERE run_id = :r AND finished_at IS NULL"
                ),
                {"r": run_id},
            ).scalar_one()
        )


@pytest.mark.parametrize(
    "control", ["cancel", pytest.param("terminate", marks=pytest.mark.broker_core)]
)
def test_cancel_and_terminate_leave_no_attempt_open(
    ductor: Any, shared_cluster: Any, control: str
) -> None:
    handle = ductor.start("long_steps", input={"seconds": 1.5})
    _wait_for(lambda: ductor.get(handle.run_id).nodes["slow_a"].status == NodeStatus.RUNNING)
    getattr(ductor, control)(handle.run_id, reason="operator said so")
    view = ductor.wait(handle.run_id, timeout=30)
    assert view.status == (RunStatus.CANCELLED if control == "cancel" else RunStatus.TERMINATED)
    if control == "cancel":
        # Cooperative: a step already running (it never heartbeats) gets the grace to finish
        # and keeps its result; one not started yet is stopped at its claim.
        assert view.nodes["slow_a"].status in (NodeStatus.SUCCEEDED, NodeStatus.CANCELLED)
    else:
        assert view.nodes["slow_a"].status == NodeStatus.CANCELLED
    assert view.nodes["after"].status == NodeStatus.PENDING
    assert _open_attempts(shared_cluster, handle.run_id) == 0
    time.sleep(2.0)  # a step that was running finishes: its outcome is discarded
    assert _open_attempts(shared_cluster, handle.run_id) == 0
    assert ductor.get(handle.run_id).status == view.status
    with pytest.raises(InvalidOperation):
        ductor.resume(handle.run_id)
    ductor.redrive(handle.run_id)
    redriven = ductor.wait(handle.run_id, timeout=60)
    assert redriven.status == RunStatus.SUCCEEDED
    if view.nodes["slow_a"].status == NodeStatus.CANCELLED:
        assert redriven.nodes["slow_a"].attempts >= 2


@broker_core
def test_pause_lets_running_attempts_finish_and_dispatches_nothing(
    ductor: Any, shared_cluster: Any
) -> None:
    handle = ductor.start("long_steps", input={"seconds": 0.8})
    _wait_for(lambda: ductor.get(handle.run_id).nodes["slow_a"].status == NodeStatus.RUNNING)
    ductor.pause(handle.run_id, reason="maintenance")
    _wait_for(lambda: ductor.get(handle.run_id).status == RunStatus.PAUSED)
    with pytest.raises(InvalidOperation, match="paused"):
        ductor.pause(handle.run_id)
    _wait_for(lambda: _open_attempts(shared_cluster, handle.run_id) == 0)
    time.sleep(0.5)
    view = ductor.get(handle.run_id)
    assert view.status == RunStatus.PAUSED
    assert view.nodes["slow_a"].status == NodeStatus.SUCCEEDED  # folded while paused
    assert view.nodes["after"].status == NodeStatus.PENDING  # but nothing new dispatched
    ductor.resume(handle.run_id)
    assert ductor.wait(handle.run_id, timeout=30).status == RunStatus.SUCCEEDED


@broker_core
def test_continue_as_new_carries_finished_steps_and_links_both_ways(
    ductor: Any, shared_cluster: Any
) -> None:
    handle = ductor.start("signals", workflow_id="loop-1")
    _wait_for(lambda: ductor.get(handle.run_id).nodes["paid"].status == NodeStatus.WAITING)
    ductor.continue_as_new("loop-1")
    _wait_for(lambda: ductor.get(handle.run_id).status == RunStatus.CONTINUED)
    old = ductor.get(handle.run_id)
    successor = ductor.get(old.continued_to)
    assert successor.continued_from == handle.run_id
    assert successor.workflow_id == "loop-1"
    assert successor.nodes["first"].status == NodeStatus.SUCCEEDED  # carried, not re-run
    ductor.signal("loop-1", "payment", {"amount": 5})
    final = ductor.wait("loop-1", timeout=30)  # follows continue-as-new
    assert final.run_id == successor.run_id and final.output == {"amount": 5}
    assert shared_cluster.executions(handle.run_id, "first") == 1
    assert shared_cluster.executions(successor.run_id, "first") == 0
