"""Database failover with runs in flight (issue 24).

A primary and a streaming standby (``StandbyServer``: ``pg_basebackup -R``), real step and
coordinator workers and the client, all on one multi-host URL written as users write it,
``postgresql://postgres@127.0.0.1:P1,127.0.0.1:P2/ductor`` (ductor adds
``target_session_attrs=read-write``). The fault, with chains and a fan-out in flight, one step
of each run sleeping through it: replication paused (the primary's WAL sender stopped), a
second of work, the primary SIGKILLed, a second with only the standby up (it refuses writes),
then ``pg_ctl promote``. Nobody tells the processes where the new primary is.

* Synchronous replication: the primary acknowledged nothing the standby did not have, so
  nothing is lost: every run succeeds with its output, every step ran exactly once.
* Asynchronous replication: the primary acknowledged the last second's commits (claims,
  outcomes, ticks) and they are gone. A step may run again (a counted duplicate, reported),
  but every run still succeeds with the right output, no result is applied twice, no attempt
  is left open, and no run waits for a step timeout (the default 300 s).

Either way the processes do not spin while the database is away: the retry log lines stay
few. Before: the URL did not even parse (SQLAlchemy reads "P1,127.0.0.1:P2" as the port).
"""

from __future__ import annotations

import collections
import importlib
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from cluster import Cluster
from servers import LOOPBACK, PostgresServer, RedisServer, StandbyServer

from ductor_celery import RunStatus
from ductor_celery.settings import normalize_url
from ductor_celery.store.db import forget_engine
from ductor_celery.store.migrate import upgrade

pytestmark = pytest.mark.e2e

#: The Redis db of these tests (flushed before and after).
BROKER_DB = 15
CHAINS = 5
CHAIN_STEPS = 6  # e2e_app.FAILOVER_CHAIN_STEPS
FAN_ITEMS = 6
#: With asynchronous replication, the primary's commits that never reach the standby.
LOST_WINDOW_S = 1.0
#: After the primary's death, before the standby is promoted: writes find no primary.
NO_PRIMARY_S = 1.0


@dataclass
class Pair:
    primary: PostgresServer
    standby: StandbyServer
    sync: bool

    @property
    def url(self) -> str:
        """The URL as a user writes it (libpq's host list with ports)."""
        return (
            f"postgresql://postgres@{LOOPBACK}:{self.primary.port},"
            f"{LOOPBACK}:{self.standby.port}/ductor"
        )


@pytest.fixture(params=["sync", "async"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    sync = request.param == "sync"
    with PostgresServer() as primary:
        primary.create_database("ductor")
        direct = primary.url("ductor")
        upgrade(direct)  # the tally steps count in a file: no e2e_ledger table needed
        forget_engine(direct)
        with StandbyServer(primary, sync=sync) as standby:
            yield Pair(primary, standby, sync)


@pytest.fixture
def broker(redis_server: RedisServer) -> Iterator[str]:
    client = redis_server.client(BROKER_DB)
    client.flushdb()
    yield redis_server.url(BROKER_DB)
    client.flushdb()
    client.close()


def _client(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Any:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    sys.modules.pop("e2e_app", None)
    return importlib.import_module("e2e_app").ductor


def _ledger(path: Path) -> collections.Counter[tuple[str, str, str]]:
    """Executions per (run, node, branch), as the steps wrote them."""
    lines = path.read_text().splitlines() if path.exists() else []
    return collections.Counter(tuple(line.split()[:3]) for line in lines)  # type: ignore[misc]


def _open_attempts(cluster: Cluster) -> str:
    """The attempts not finished, and the runs waiting (what a stuck run's failure shows)."""
    with cluster.engine.connect() as conn:
        attempts = conn.execute(
            sa.text(
                "SELECT run_id, node, branch, token, claimed_by, claimed_at, created_at "
                "FROM eec_workflow_step_attempt WHERE finished_at IS NULL OR NOT folded"
            )
        ).all()
        runs = conn.execute(
            sa.text(
                "SELECT run_id, status, record_version FROM eec_workflow_run "
                "WHERE status NOT IN ('succeeded', 'failed', 'cancelled')"
            )
        ).all()
    return "\n".join([*map(str, attempts), *map(str, runs), cluster.logs()])


def _retry_lines(text: str) -> int:
    return len(
        re.findall(r"database error, retrying|sweep failed|sweep: database unreachable", text)
    )


def test_failover_with_runs_in_flight(
    pair: Pair,
    broker: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    record_property: Any,
) -> None:
    began = time.monotonic()
    ledger = tmp_path / "ledger.txt"
    env = {"DUCTOR_DATABASE_URL": pair.url, "E2E_LEDGER_FILE": str(ledger)}
    # The cluster reads the ledger and the attempts through SQLAlchemy: the normalized URL.
    url = normalize_url(pair.url)
    cluster = Cluster(url, broker, tmp_path, **env)
    try:
        cluster.start_steps(concurrency=3)
        cluster.start_coordinator()
        ductor = _client(monkeypatch, {**env, "E2E_BROKER_URL": broker})
        try:
            _run_through_a_failover(pair, cluster, ductor, ledger, record_property, began)
        finally:
            sys.modules.pop("e2e_app", None)
            forget_engine(url)
    finally:
        cluster.stop()


def _run_through_a_failover(
    pair: Pair, cluster: Cluster, ductor: Any, ledger: Path, record: Any, began: float
) -> None:
    expected: dict[str, Any] = {}
    for i in range(CHAINS):
        # The first chain is slow: one of its steps is always in flight, the fault included.
        pause = 1.2 if i == 0 else 0.3
        handle = ductor.start("failover_chain", input={"value": 100 * i, "pause": pause})
        expected[handle.run_id] = 100 * i + CHAIN_STEPS
    items = list(range(FAN_ITEMS))
    handle = ductor.start("failover_fan", input={"items": items, "pause": 0.4})
    expected[handle.run_id] = sum(item + 1 for item in items)
    # The runs themselves are on the standby (a start is a client's commit like any other).
    pair.standby.wait_caught_up()
    deadline = time.monotonic() + 20
    while sum(_ledger(ledger).values()) < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    executed_before = sum(_ledger(ledger).values())
    logs_before = {w.name: w.log_path.stat().st_size for w in cluster.workers}

    pair.standby.pause_streaming()
    time.sleep(LOST_WINDOW_S)
    pair.primary.kill()
    fault_at = time.monotonic()
    time.sleep(NO_PRIMARY_S)
    pair.standby.promote()
    promoted_at = time.monotonic()

    # The client finds the new primary too: runs started after the failover.
    for i in range(CHAINS, CHAINS + 2):
        handle = ductor.start("failover_chain", input={"value": 100 * i, "pause": 0.1})
        expected[handle.run_id] = 100 * i + CHAIN_STEPS
    views = {}
    for run_id in expected:
        try:
            views[run_id] = ductor.wait(
                run_id, timeout=max(1.0, promoted_at + 60 - time.monotonic())
            )
        except TimeoutError:
            raise AssertionError(f"run {run_id} is stuck:\n{_open_attempts(cluster)}") from None
    recovered_s = time.monotonic() - promoted_at

    # Every run finished with the right output.
    problems = [
        (run_id, view.status, view.output, view.error)
        for run_id, view in views.items()
        if view.status != RunStatus.SUCCEEDED or view.output != expected[run_id]
    ]
    assert not problems, f"{problems}\n{cluster.logs()}"

    # No result applied twice, nothing left open: one succeeded attempt per node (and branch),
    # every attempt finished and folded.
    with cluster.engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT run_id, node, branch, outcome, finished_at, folded "
                "FROM eec_workflow_step_attempt"
            )
        ).all()
    succeeded = collections.Counter(
        (r.run_id, r.node, str(r.branch)) for r in rows if r.outcome == "succeeded"
    )
    assert [k for k, n in succeeded.items() if n != 1] == []
    assert [r for r in rows if r.finished_at is None or not r.folded] == []
    outcomes = collections.Counter(r.outcome for r in rows)

    # Executions: each node ran once, or (asynchronous) again where its commit was lost.
    executions = _ledger(ledger)
    assert set(executions) == set(succeeded), "a step ran that no attempt accounts for"
    duplicates = sum(n - 1 for n in executions.values())
    executed = sum(executions.values())

    # No spinning: a handful of retry lines per process for a two-second outage.
    retry_lines = {}
    rewritten = 0
    for worker in cluster.workers:
        with worker.log_path.open("rb") as fh:
            fh.seek(logs_before[worker.name])
            text = fh.read().decode(errors="replace")
        retry_lines[worker.name] = _retry_lines(text)
        rewritten += text.count("writing it again")

    report = {
        "mode": "sync" if pair.sync else "async",
        "runs": len(views),
        "steps_executed": executed,
        "executed_before_fault": executed_before,
        "duplicates": duplicates,
        "outcomes_written_again": rewritten,
        "attempt_outcomes": dict(outcomes),
        "retry_log_lines": retry_lines,
        "fault_to_promote_s": round(promoted_at - fault_at, 2),
        "promote_to_all_done_s": round(recovered_s, 2),
        "test_s": round(time.monotonic() - began, 1),
    }
    record("failover", report)
    print(f"\nfailover report: {report}")  # noqa: T201 - the figures, with -s
    if pair.sync:
        # Nothing acknowledged was lost: no step ran twice, no attempt needed a retry.
        assert duplicates == 0, (report, executions)
        assert set(outcomes) == {"succeeded"}, report
        assert rewritten == 0, report  # no outcome was lost to write again
    assert max(retry_lines.values()) <= 40, (report, cluster.logs())
