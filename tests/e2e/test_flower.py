"""Flower shows steps under their step names and ticks as ``ductor.tick``, from the plain
worker commands (ductor turns task events on)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from cluster import TESTS_DIR
from servers import free_port

pytestmark = pytest.mark.e2e


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - loopback only
        return json.loads(response.read())


TICKS = {"ductor.tick", "ductor.first_tick"}


def test_flower_lists_step_and_tick_tasks_by_name(
    shared_cluster: Any, client_for: Any, tmp_path: Path
) -> None:
    port = free_port()
    log = open(tmp_path / "flower.log", "wb")  # noqa: SIM115
    flower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "e2e_app",
            "flower",
            f"--port={port}",
            "--address=127.0.0.1",
        ],
        cwd=TESTS_DIR,
        env={**shared_cluster.env, "FLOWER_UNAUTHENTICATED_API": "true"},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                _get(f"{base}/api/workers?refresh=true")
                break
            except OSError:
                assert time.monotonic() < deadline, (tmp_path / "flower.log").read_text()
                time.sleep(0.3)
        time.sleep(1.0)  # let Flower subscribe to the event stream before the run
        ductor = client_for(shared_cluster)
        handle = ductor.start("diamond", input={"x": 1})
        assert ductor.wait(handle.run_id, timeout=30).status == "succeeded"
        deadline = time.monotonic() + 20
        while True:
            tasks = _get(f"{base}/api/tasks?limit=500")
            names = {t.get("name") for t in tasks.values()}
            mine = [
                t
                for t in tasks.values()
                if handle.run_id in (t.get("kwargs") or "")
                or handle.run_id in (t.get("args") or "")
            ]
            # The last step's task-succeeded event is sent after the run's commit, which is
            # what ``wait`` returns on: wait for the events, then look at them.
            done = all(t["state"] == "SUCCESS" for t in mine if t["name"] != "ductor.tick")
            # With eager ticks (the default) the run's first tick is the one tick message.
            wanted = {"e2e.add", "e2e.mul", "e2e.collect", "ductor.first_tick"}
            if wanted <= names and len(mine) >= 4:
                if done:
                    break
            assert time.monotonic() < deadline, names
            time.sleep(0.5)
        steps = [t for t in mine if t["name"] not in TICKS]
        assert {t["state"] for t in steps} == {"SUCCESS"}
        # The start message: one event of ductor's instead of Celery's three, the same view.
        (start,) = [t for t in mine if t["name"] == "ductor.first_tick"]
        assert start["state"] == "SUCCESS" and start["result"] == "'committed'"
        assert start["received"] and start["started"] and start["worker"]
        # No task-sent event follows a start message (runtime/dispatch.py, ``UNSENT``).
        assert start.get("sent") is None
        assert all(handle.run_id not in t["name"] for t in tasks.values())  # names are labels

        # A chain runs most of its steps inline (no message of their own, runtime/inline.py):
        # each attempt still shows as a task of its own, under its token and step name.
        chain = ductor.start("chain10", input={"value": 3})
        assert ductor.wait(chain.run_id, timeout=30).output == 3
        tokens = {a.token for a in shared_cluster.attempts(chain.run_id)}
        assert len(tokens) == 10
        deadline = time.monotonic() + 20
        while True:
            tasks = _get(f"{base}/api/tasks?limit=1000")
            shown = {u: t for u, t in tasks.items() if u in tokens}
            if len(shown) == 10 and all(t["state"] == "SUCCESS" for t in shown.values()):
                break
            assert time.monotonic() < deadline, sorted(
                (t.get("name"), t.get("state")) for t in shown.values()
            )
            time.sleep(0.5)
        assert {t["name"] for t in shown.values()} == {"e2e.echo"}
        # Quick ones send one event each, which tells their start too.
        assert all(t["started"] and t["succeeded"] >= t["started"] for t in shown.values())
        assert all(chain.run_id in (t.get("kwargs") or "") for t in shown.values())
    finally:
        os.killpg(flower.pid, signal.SIGTERM)
        flower.wait(15)
        log.close()
