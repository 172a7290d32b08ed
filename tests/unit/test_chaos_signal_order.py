"""The chaos checker's signal order (chaos/checker.py, check_signals (3)): signals of one name
sent to one workflow id are consumed in the order they were accepted. The order of consumption
is the order of the commits (the consuming run's place in the workflow id's runs, then the
version its tick wrote), not ``applied_at``: that is the tick's time, taken when its
transaction began, so a tick that waited for the run's lock behind another carries an earlier
time than the tick it waited for. The 62-minute RabbitMQ fleet run reported exactly that case."""

from __future__ import annotations

import sys
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "chaos"))

from checker import Checker  # noqa: E402

T0 = 1_000_000.0


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(T0 + seconds, tz=UTC)


def run(run_id: str, created: float) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "workflow_id": "wf-1",
        "created_at": at(created),
        "state": {"nodes": {}},
        "spec_hash": None,
    }


def signal(sid: int, run_id: str, version: int, applied: float) -> dict[str, Any]:
    return {
        "id": sid,
        "run_id": run_id,
        "workflow_id": "wf-1",
        "name": "go",
        "idempotency_key": f"k{sid}",
        "created_at": at(applied - 1.0),
        "applied_at": at(applied),
        "applied_to": None,  # check (2) is not what these tests are about
        "applied_version": version,
    }


def check(runs: list[dict[str, Any]], signals: list[dict[str, Any]]) -> list[str]:
    c = Checker(None)  # type: ignore[arg-type]
    c.runs = {r["run_id"]: r for r in runs}
    c.signals = signals
    c.transitions = defaultdict(list)
    c.spec_nodes = lambda run: {}  # type: ignore[method-assign]
    c.lineage = lambda run_id: [run_id]  # type: ignore[method-assign]
    c.check_signals()
    return [v.message for v in c.violations if v.invariant == "signals"]


def test_a_tick_that_waited_for_the_lock_is_ordered_by_the_version_it_wrote() -> None:
    # 14827's tick began first (earlier applied_at) but waited for the run's lock, and wrote
    # version 3 after 14826's tick wrote version 2: consumed in order.
    assert (
        check([run("r1", 0.0)], [signal(14826, "r1", 2, 0.160), signal(14827, "r1", 3, 0.154)])
        == []
    )


def test_a_later_signal_consumed_by_an_earlier_version_is_reported() -> None:
    found = check([run("r1", 0.0)], [signal(1, "r1", 3, 0.1), signal(2, "r1", 2, 0.2)])
    assert found == ["'go' of wf-1: signal 2 consumed before the earlier 1"]


def test_across_continue_as_new_the_successor_run_consumes_later() -> None:
    runs = [run("r1", 0.0), run("r2", 5.0)]
    # the successor's tick writes version 2 of its own run: still after version 7 of r1
    assert check(runs, [signal(1, "r1", 7, 4.0), signal(2, "r2", 2, 6.0)]) == []
    found = check(runs, [signal(1, "r2", 2, 6.0), signal(2, "r1", 7, 4.0)])
    assert found == ["'go' of wf-1: signal 2 consumed before the earlier 1"]


def test_an_earlier_signal_left_unconsumed_behind_a_consumed_one_is_reported() -> None:
    unapplied = signal(1, "r1", 0, 0.0) | {"applied_at": None, "applied_version": None}
    found = check([run("r1", 0.0)], [unapplied, signal(2, "r1", 2, 0.2)])
    assert found == ["'go' of wf-1: signal 2 consumed before the earlier 1"]
