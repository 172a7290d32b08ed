"""The shop example's README commands, run for real against the test servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from cluster import ROOT_DIR

pytestmark = pytest.mark.e2e


def _ductor(cluster: Any, *args: str) -> subprocess.CompletedProcess[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "ductor")
    return subprocess.run(
        [exe, "-A", "examples.shop.app", *args],
        cwd=ROOT_DIR,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_shop_example_runs_as_its_readme_says(cluster_factory: Any, pg_server: Any) -> None:
    # From the repository root, configured by its celeryconfig.py through the environment.
    cluster = cluster_factory(app="examples.shop.app", cwd=ROOT_DIR)
    cluster.env["CELERY_BROKER_URL"] = cluster.broker_url
    # A blank database: the README's first command creates the schema.
    pg_server.create_database("shop_example")
    cluster.env["DUCTOR_DATABASE_URL"] = pg_server.url("shop_example")
    migrated = _ductor(cluster, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    cluster.start_steps(concurrency=2)
    cluster.start_coordinator()
    order = {"order": {"id": 7, "total": 1250, "items": ["mug", "lamp"], "gift": True}}
    result = _ductor(
        cluster, "start", "order", "--wait", "--timeout", "60", "--input", json.dumps(order)
    )
    assert result.returncode == 0, result.stderr + cluster.logs()
    view = json.loads(result.stdout.splitlines()[1])
    assert view["status"] == "succeeded"
    assert view["output"]["tracking"].startswith("TRK-")
    assert view["nodes"]["gift_wrap"]["output"] == "1 boxes wrapped"
    assert view["output"]["picked"] == ["picked mug (#0)", "picked lamp (#1)"]
    no_items = _ductor(
        cluster,
        "start",
        "order",
        "--wait",
        "--timeout",
        "60",
        "--input",
        json.dumps({"order": {"id": 8, "total": 5, "items": []}}),
    )
    assert no_items.returncode == 2  # the run failed: reserve raised NonRetryableError
    failed = json.loads(no_items.stdout.splitlines()[1])
    assert failed["status"] == "failed" and failed["nodes"]["reserve"]["attempts"] == 1
