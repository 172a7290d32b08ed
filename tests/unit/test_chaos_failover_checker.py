"""The chaos checker after a database failover (chaos/checker.py, docs/fleet.md): with an
asynchronous standby a claim the old primary acknowledged may be lost, which leaves a ledger
execution whose attempt the database forgot; that is counted, not a violation. With a
synchronous standby, or outside the failover's window, it stays a ``claimed_once`` violation."""

from __future__ import annotations

import sys
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "chaos"))

from checker import Checker  # noqa: E402

T0 = 1_000_000.0


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(T0 + seconds, tz=UTC)


def execution(token: str, started: float) -> dict[str, Any]:
    return {
        "token": token,
        "run_id": "r1",
        "node": "a",
        "branch": None,
        "ok": True,
        "started_at": at(started),
        "ended_at": at(started + 0.1),
        "nonce": token,
    }


def checker(sync: bool, ledger: list[dict[str, Any]], attempts: dict[str, Any]) -> Checker:
    failover = {
        "kind": "failover",
        "started": 50.0,
        "result": "done",
        "detail": {"from": "pg0", "to": "pg1", "sync": sync, "promoted_after_s": 4.0},
    }
    c = Checker(None, faults=[failover], t0_wall=T0)  # type: ignore[arg-type]
    c.ledger = ledger
    c.attempts = attempts
    c.transitions = defaultdict(list)
    return c


def attempt(token: str) -> dict[str, Any]:
    return {
        "token": token,
        "run_id": "r1",
        "node": "a",
        "branch": None,
        "attempt": 2,
        "outcome": "succeeded",
        "args": {},
        "finished_at": at(60.0),
    }


def test_a_claim_lost_in_an_async_failover_is_a_counted_duplicate() -> None:
    # t-lost's claim committed on the old primary just before it died and never reached the
    # standby; the step ran again under t-new.
    c = checker(
        False, [execution("t-lost", 49.0), execution("t-new", 57.0)], {"t-new": attempt("t-new")}
    )
    c.check_ledger()
    c.duplicates()
    assert c.violations == []
    assert c.figures["executions_of_lost_attempts"] == 1
    assert c.figures["duplicate_executions"] == 1
    assert list(c.figures["duplicates_by_cause"]) == [
        "the attempt's claim was lost with the primary (asynchronous failover)"
    ]


@pytest.mark.parametrize(
    ("sync", "started"),
    [(True, 49.0), (False, 10.0), (False, 70.0)],
    ids=["synchronous", "long-before", "after-the-promotion"],
)
def test_an_execution_without_an_attempt_is_a_violation_otherwise(
    sync: bool, started: float
) -> None:
    c = checker(sync, [execution("t-lost", started)], {})
    c.check_ledger()
    assert [v.invariant for v in c.violations] == ["claimed_once"]
    assert "executions_of_lost_attempts" not in c.figures
