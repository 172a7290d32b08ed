"""Writes an asynchronous failover loses (chaos/checker.py, docs/fleet.md): a signal whose
``signal()`` returned inside the loss window (from the moment the standby stopped receiving WAL
to the kill of the primary) and that the promoted primary does not hold was lost with the
primary: counted, not a ``signals`` violation. With synchronous replication, or acknowledged
outside the window, it stays a violation. Also: the fleet schedules RabbitMQ's broker faults
only with RabbitMQ, Redis's only with Redis."""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "chaos"))

from checker import Checker, async_loss_windows  # noqa: E402


def failover(sync: bool, lag: float = 1.0) -> dict[str, Any]:
    # Walsenders stopped at 6.3 s, the primary killed at 7.3 s.
    return {
        "kind": "failover",
        "started": 6.3,
        "result": "done",
        "detail": {"sync": sync, "lag_s": lag, "killed_at": 7.3, "promoted_after_s": 3.0},
    }


def stored(sid: int, wf: str = "w1", key: str | None = "k1") -> dict[str, Any]:
    return {
        "id": sid,
        "run_id": "r1",
        "workflow_id": wf,
        "name": "go",
        "payload": {"go": True},
        "idempotency_key": key,
        "applied_at": None,
        "applied_to": None,
    }


def sent(sid: int, acked: float, wf: str = "w1", key: str | None = "k1") -> dict[str, Any]:
    return {
        "workflow_id": wf,
        "name": "go",
        "key": key,
        "payload": {"go": True},
        "t": acked - 0.01,
        "acked": acked,
        "id": sid,
    }


def checker(faults: list[dict[str, Any]], signals, signals_sent, decisions=()) -> Checker:  # type: ignore[no-untyped-def]
    c = Checker(
        None,  # type: ignore[arg-type]
        faults=faults,
        signals_sent=list(signals_sent),
        decisions=list(decisions),
        t0_wall=0.0,
    )
    c.signals = list(signals)
    c.runs = {}
    c.transitions = defaultdict(list)
    return c


def test_the_window_runs_from_the_fault_s_start_to_the_kill() -> None:
    ((a, b),) = async_loss_windows([failover(False)])
    assert a == pytest.approx(6.3 - 1.0) and b == pytest.approx(7.8)
    assert async_loss_windows([failover(True)]) == []
    # Stopping the WAL senders took 1.3 s (seed 3, --failover-lag 1: the kill came at 8.623
    # s); signals acknowledged at 6.378 s and 6.456 s were lost: inside the window.
    slow = failover(False)
    slow["started"], slow["detail"]["killed_at"] = 6.311, 8.623
    ((a, b),) = async_loss_windows([slow])
    assert a < 6.378 and b == pytest.approx(9.123)
    # A report without killed_at: the fault's start plus the lag.
    del slow["detail"]["killed_at"]
    ((a, b),) = async_loss_windows([slow])
    assert b == pytest.approx(6.311 + 1.0 + 0.5)


def test_a_signal_acknowledged_in_the_window_and_not_stored_is_lost_with_the_primary() -> None:
    # Signal 30 was acknowledged at 6.9 s and is gone; the retry of the same key after the
    # promotion got id 31, which is stored.
    c = checker([failover(False)], [stored(31)], [sent(30, 6.9), sent(31, 12.0)])
    c.check_signals()
    assert c.violations == []
    assert c.figures["signals_lost_with_primary"] == 1


def test_a_lost_id_reused_by_another_signal_is_lost_too() -> None:
    # The promoted primary handed id 30 again, to another workflow's signal.
    c = checker(
        [failover(False)],
        [stored(30, wf="w2", key="k2")],
        [sent(30, 7.0), sent(30, 15.0, wf="w2", key="k2")],
    )
    c.check_signals()
    assert c.violations == []
    assert c.figures["signals_lost_with_primary"] == 1


@pytest.mark.parametrize(
    ("sync", "acked"),
    [(True, 6.9), (False, 3.0), (False, 9.0)],
    ids=["synchronous", "before-the-window", "after-the-kill"],
)
def test_a_missing_signal_is_a_violation_otherwise(sync: bool, acked: float) -> None:
    c = checker([failover(sync)], [stored(31)], [sent(30, acked), sent(31, 12.0)])
    c.check_signals()
    assert {v.invariant for v in c.violations} == {"signals"}
    assert c.figures["signals_lost_with_primary"] == 0


def test_a_decision_acknowledged_in_the_window_is_not_counted_against_the_stored_ones() -> None:
    decision = {"workflow_id": "w1", "accepted": True, "acked": 7.0}
    c = checker([failover(False)], [], [], [decision])
    c.check_signals()
    assert c.violations == []
    assert c.figures["decisions_in_loss_window"] == 1
    c = checker([failover(True)], [], [], [decision])
    c.check_signals()
    assert [v.invariant for v in c.violations] == ["signals"]


def fleet_args(broker: str) -> argparse.Namespace:
    import run

    return run.parse_args(["--fleet", "--broker", broker, "--minutes", "2", "--seed", "3"])


def test_rabbitmq_faults_with_rabbitmq_and_redis_faults_with_redis() -> None:
    from fleet_run import Topology, fleet_schedule

    kinds = {b: {f.kind for f in fleet_schedule(fleet_args(b))} for b in ("redis", "rabbitmq")}
    assert "rabbitmq_restart" in kinds["rabbitmq"]
    assert not {"redis_restart", "redis_outage"} & kinds["rabbitmq"]
    assert not {"rabbitmq_restart", "rabbitmq_kill"} & kinds["redis"]
    skipped = Topology.from_args(fleet_args("rabbitmq")).not_scheduled()
    assert skipped["redis_outage"] == "the broker is rabbitmq, not Redis"
    assert "rabbitmq_kill" not in skipped


def test_the_workload_stops_waiting_for_a_start_lost_in_the_window() -> None:
    from workload import Script, Workload

    w = Workload(None, None, 3)  # type: ignore[arg-type]
    try:
        w.newest = lambda workflow_id: None  # type: ignore[method-assign]
        w.loss_windows = lambda: [(5.3, 7.8)]

        def script(started_at: float) -> Script:
            import random

            s = Script(0, "chaos_signals", "w1", {}, random.Random(0), started=True, pending=1)
            s.started_at = started_at
            return s

        lost, kept = script(7.0), script(9.0)
        w._watch(lost)
        w._watch(kept)
        assert lost.done and lost.notes == ["start lost with the primary"]
        assert not kept.done  # still polled: its run may yet appear
        assert w.stats["starts_lost_with_primary"] == 1
    finally:
        w.stop()
