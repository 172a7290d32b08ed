"""The fleet under fire, the short form: ``scripts/chaos --fleet --minutes 2 --seed 3``
(docs/fleet.md), then one assertion per invariant of its checker. PostgreSQL with a
synchronous standby, Redis, three step-worker hosts, two coordinator hosts and the driver,
each in a network namespace of its own; partitions, flapping links and a failover among the
faults. About 2.5 minutes (2 of faults). Skipped where namespaces cannot be made (not root, no
``ip netns``); ``.ci/run`` runs as root, so CI runs it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAOS = ROOT / "chaos"
sys.path.insert(0, str(CHAOS))

import fleet  # noqa: E402
from chaos_support import chaos_report, violation_details  # noqa: E402
from checker import INVARIANTS  # noqa: E402

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        fleet.unavailable_reason() is not None,
        reason=f"no network namespaces here: {fleet.unavailable_reason()}",
    ),
]

SEED = 3
MINUTES = 2.0
NETWORK_KINDS = ("partition_db", "partition_broker", "failover")


@pytest.fixture(scope="module")
def fleet_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("fleet")
    args = ("--fleet", "--minutes", str(MINUTES), "--seed", str(SEED))
    return chaos_report(out, *args, timeout=400)


def _details(report: dict[str, Any], invariant: str) -> str:
    return violation_details(report, invariant, rows=0)


@pytest.mark.timeout(420)
def test_the_short_fleet_run_cuts_links_and_fails_the_database_over(
    fleet_report: dict[str, Any],
) -> None:
    injected = fleet_report["faults_by_kind"]
    if "failover" in fleet_report.get("faults_not_scheduled", {}):
        pytest.skip(f"no failover here: {fleet_report['faults_not_scheduled']['failover']}")
    assert all(injected[kind] >= 1 for kind in NETWORK_KINDS), injected
    assert fleet_report["figures"]["step_attempts"] >= 500
    # Every host was a namespace of the harness's, and none is left once it has exited.
    assert len(fleet_report["hosts"]) >= 9, fleet_report["hosts"]
    left = set(fleet_report["hosts"]) & set(fleet.netns_names())
    assert not left, left
    assert fleet_report["_exit"] in (0, 1), fleet_report["_stdout"][-3000:]


@pytest.mark.timeout(420)
def test_every_fleet_run_ends_within_a_minute_of_the_last_fault(
    fleet_report: dict[str, Any],
) -> None:
    assert fleet_report["time_to_all_terminal_s"] is not None, _details(fleet_report, "terminal")
    assert fleet_report["time_to_all_terminal_s"] <= 60
    assert fleet_report["stuck_runs"] == 0


@pytest.mark.timeout(420)
@pytest.mark.parametrize("invariant", INVARIANTS)
def test_no_violation_on_the_fleet(fleet_report: dict[str, Any], invariant: str) -> None:
    count = fleet_report["violations_by_invariant"][invariant]
    assert count == 0, f"{count} violations of {invariant}:\n{_details(fleet_report, invariant)}"
