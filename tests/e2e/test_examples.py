"""Every example runs, as a user would run it: the quickstart here, the shop example (real
workers, PostgreSQL, Redis) in test_examples_shop.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cluster import ROOT_DIR

# A whole program in a process of its own, as a user starts it (its workers are threads).
pytestmark = pytest.mark.e2e


def test_quickstart_runs_on_the_embedded_default(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "DUCTOR_DATABASE_URL": f"sqlite:///{tmp_path}/ductor.sqlite3",
        "COLUMNS": "120",
    }
    env.pop("E2E_BROKER_URL", None)
    result = subprocess.run(
        [sys.executable, "-m", "examples.quickstart"],
        cwd=ROOT_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "status: succeeded" in result.stdout
    assert "TRK-" in result.stdout
    assert "'packed': ['book', 'lamp', 'mug']" in result.stdout
    assert (tmp_path / "ductor.sqlite3").exists()
