"""The ``ductor`` command and the same group under ``celery -A app ductor``, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
from cluster import TESTS_DIR

pytestmark = pytest.mark.e2e


def _run(cluster: Any, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(cluster.env)
    return subprocess.run(
        list(args),
        cwd=TESTS_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _ductor(cluster: Any, *args: str) -> subprocess.CompletedProcess[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "ductor")
    return _run(cluster, exe, "-A", "e2e_app", *args)


def test_start_wait_show_and_runs(shared_cluster: Any) -> None:
    started = _ductor(
        shared_cluster,
        "start",
        "diamond",
        "--input",
        '{"x": 2}',
        "--workflow-id",
        "cli-1",
        "--wait",
        "--timeout",
        "60",
    )
    assert started.returncode == 0, started.stderr
    handle = json.loads(started.stdout.splitlines()[0])
    final = json.loads(started.stdout.splitlines()[1])
    assert handle["workflow_id"] == "cli-1"
    assert final["status"] == "succeeded" and final["output"]["start"] == 3
    shown = _ductor(shared_cluster, "show", "cli-1", "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["run_id"] == handle["run_id"]
    listed = _ductor(
        shared_cluster, "runs", "--workflow", "diamond", "--status", "succeeded", "--json"
    )
    assert handle["run_id"] in [json.loads(line)["run_id"] for line in listed.stdout.splitlines()]
    table = _ductor(shared_cluster, "show", "cli-1")
    assert table.returncode == 0, table.stderr
    for expected in ("succeeded", "join", "attempts", "transitions", "flowchart TD"):
        assert expected in table.stdout
    runs_table = _ductor(shared_cluster, "runs", "--limit", "5")
    assert runs_table.returncode == 0 and "diamond" in runs_table.stdout


def test_graph_in_mermaid_and_dot(shared_cluster: Any) -> None:
    mermaid = _ductor(shared_cluster, "graph", "diamond")
    assert mermaid.returncode == 0
    assert mermaid.stdout.startswith("flowchart TD") and "-->" in mermaid.stdout
    dot = _ductor(shared_cluster, "graph", "diamond", "--format", "dot")
    assert dot.returncode == 0 and '"start" -> "left";' in dot.stdout
    unknown = _ductor(shared_cluster, "graph", "nope")
    assert unknown.returncode == 1 and "nope" in unknown.stderr


def test_doctor_passes_with_both_queues_consumed(shared_cluster: Any) -> None:
    result = _ductor(shared_cluster, "doctor")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "queue ductor-steps: consumed by" in result.stdout
    assert "queue ductor-coord: consumed by" in result.stdout


def test_doctor_reports_a_queue_nobody_consumes(cluster_factory: Any) -> None:
    cluster = cluster_factory()
    cluster.start_steps(concurrency=1)
    result = _ductor(cluster, "doctor", "--timeout", "1")
    assert result.returncode == 1
    assert "FAIL queue ductor-coord: no worker consumes it" in result.stdout
    assert "ok   queue ductor-steps" in result.stdout


def test_doctor_reports_an_unmigrated_database(cluster_factory: Any, pg_server: Any) -> None:
    cluster = cluster_factory()
    pg_server.create_database("doctor_empty")
    cluster.env["DUCTOR_DATABASE_URL"] = pg_server.url("doctor_empty")
    result = _ductor(cluster, "doctor", "--timeout", "0.5")
    assert result.returncode == 1
    assert "FAIL schema: at nothing" in result.stdout and "ductor migrate" in result.stdout


def test_errors_are_one_line_and_non_zero(shared_cluster: Any) -> None:
    bad_json = _ductor(shared_cluster, "start", "diamond", "--input", "{nope")
    assert bad_json.returncode == 1 and "--input is not valid JSON" in bad_json.stderr
    unknown = _ductor(shared_cluster, "start", "no_such_workflow")
    assert unknown.returncode == 1 and "no_such_workflow" in unknown.stderr
    assert len(unknown.stderr.strip().splitlines()) == 1
    missing = _ductor(shared_cluster, "show", "no-such-run")
    assert missing.returncode == 1 and "no-such-run" in missing.stderr


def test_the_same_group_runs_as_a_celery_subcommand(shared_cluster: Any) -> None:
    result = _run(
        shared_cluster, sys.executable, "-m", "celery", "-A", "e2e_app", "ductor", "show", "nope"
    )
    assert result.returncode == 1
    assert "no run with run id or workflow id 'nope'" in result.stderr


def test_signal_approve_and_controls_from_the_command_line(shared_cluster: Any) -> None:
    started = _ductor(shared_cluster, "start", "approvals", "--workflow-id", "cli-kyc")
    assert started.returncode == 0, started.stderr
    run_id = json.loads(started.stdout)["run_id"]
    early = _ductor(shared_cluster, "approve", "cli-kyc", "kyc")
    assert early.returncode == 1 and "not an approval node" in early.stderr
    deadline = time.monotonic() + 20
    while True:
        shown = json.loads(_ductor(shared_cluster, "show", run_id, "--json").stdout)
        if shown["nodes"]["review"]["status"] == "waiting":
            break
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert _ductor(shared_cluster, "pause", "cli-kyc", "--reason", "lunch").returncode == 0
    resumed = None
    for _ in range(100):
        resumed = _ductor(shared_cluster, "resume", "cli-kyc")
        if resumed.returncode == 0:
            break
        time.sleep(0.1)  # the pause is applied by the coordinator, not by the client
    assert resumed is not None and resumed.returncode == 0, resumed.stderr
    approved = _ductor(
        shared_cluster, "approve", "cli-kyc", "review", "--by", "ops", "--comment", "fine"
    )
    assert approved.returncode == 0, approved.stderr
    for event in ("id_ok", "address_ok"):
        sent = _ductor(
            shared_cluster,
            "signal",
            "cli-kyc",
            event,
            "--payload",
            '{"ok": true}',
            "--idempotency-key",
            event,
        )
        assert sent.returncode == 0 and "signal_id" in sent.stdout
    bad = _ductor(shared_cluster, "signal", "cli-kyc", "x", "--payload", "{nope")
    assert bad.returncode == 1 and "--payload is not valid JSON" in bad.stderr
    deadline = time.monotonic() + 20
    while json.loads(_ductor(shared_cluster, "show", run_id, "--json").stdout)["status"] != (
        "succeeded"
    ):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    again = _ductor(shared_cluster, "cancel", "cli-kyc")
    assert again.returncode == 1 and "succeeded" in again.stderr
    redrive = _ductor(shared_cluster, "redrive", "cli-kyc")
    assert redrive.returncode == 1 and "cannot redrive" in redrive.stderr
