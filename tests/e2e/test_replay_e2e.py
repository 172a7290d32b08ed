"""Export and replay end to end (docs/replay.md): a run executed by real ``celery worker``
processes (a coordinator and a step worker, PostgreSQL and the session's broker) is exported
with the ``ductor`` command as a user runs it (a subprocess, ``-A replay_app:app``); the file
replays the failed step in this process, and loads into the harness where a redrive with the
fixed step finishes the run.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from replay_support import SECRET, SECRET_ENV, define, fingerprint

from ductor_celery import Ductor, NodeStatus, NonRetryableError, RunStatus, testing

pytestmark = pytest.mark.e2e

TESTS_DIR = Path(__file__).parent.parent


@pytest.fixture
def replay_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """replay_app's Ductor in this process, pointed at a cluster's database and broker."""

    def make(cluster: Any) -> Any:
        monkeypatch.setenv("DUCTOR_DATABASE_URL", cluster.database_url)
        monkeypatch.setenv("E2E_BROKER_URL", cluster.broker_url)
        sys.modules.pop("replay_app", None)
        return importlib.import_module("replay_app").ductor

    yield make
    sys.modules.pop("replay_app", None)


def test_a_run_executed_by_workers_exports_replays_and_redrives(
    cluster_factory: Any, replay_client: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)  # before the cluster: its workers inherit it
    cluster = cluster_factory(app="replay_app")
    ductor = replay_client(cluster)
    cluster.start_coordinator()
    cluster.start_steps(concurrency=2)
    handle = ductor.start("replay_order", input={"id": 5, "total": "99.95"}, workflow_id="o-5")
    deadline = time.monotonic() + 60
    while ductor.get(handle.run_id).nodes["paid"].status != NodeStatus.WAITING:
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.05)
    ductor.signal("o-5", "payment_received", {"by": "card"})
    view = ductor.wait(handle.run_id, timeout=60)
    assert view.status == RunStatus.FAILED, cluster.logs()

    out = tmp_path / "run.json"
    # The command as a user runs it, with the cluster's environment (database, broker).
    exe = os.path.join(os.path.dirname(sys.executable), "ductor")
    done = subprocess.run(
        [exe, "-A", "replay_app:app", "export", "o-5"],
        cwd=TESTS_DIR,
        env=dict(cluster.env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out.write_text(done.stdout)
    doc = json.loads(done.stdout)
    assert doc["run"]["run_id"] == handle.run_id and doc["format"] == 1
    assert SECRET not in done.stdout
    # Claimed by the worker processes, not by this one.
    hosts = {a["claimed_by"].split(":")[0] for a in doc["attempts"]}
    assert hosts and all("@" in h for h in hosts), hosts
    assert [(a["node"], a["outcome"]) for a in doc["attempts"]] == [
        ("charge", "failed"),
        ("charge", "succeeded"),
        ("ship", "failed"),
    ]

    with pytest.raises(NonRetryableError, match="^no carrier for order 5$"):
        testing.replay(out, node="ship", ductor=ductor)
    assert testing.replay(out, node="charge", ductor=ductor) == {
        "amount": Decimal("99.95"),
        "key": fingerprint(SECRET),
        "attempt": 2,
    }

    fixed = Ductor(Celery("replay-fixed", set_as_current=False), database_url="sqlite://")
    define(fixed, ship_fixed=True)
    with testing.harness(fixed, from_export=out) as h:
        fixed.redrive(h.run_id)
        after = h.run(h.run_id)
        assert after.status == RunStatus.SUCCEEDED, after.error
        assert after.output["ship"] == {"tracking": "TRK-5", "charged": "99.95"}
    # The cluster's run is untouched.
    assert ductor.get(handle.run_id).status == RunStatus.FAILED
