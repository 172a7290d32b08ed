"""Running ``scripts/chaos`` from a test: the harness as a subprocess, its JSON report back
(tests/e2e/test_chaos.py, tests/e2e/test_fleet_chaos.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAOS = ROOT / "chaos"


def chaos_report(out: Path, *args: str, timeout: float) -> dict[str, Any]:
    """Run ``chaos/run.py *args`` with its report and work dir under ``out``; the report, with
    the exit code (``_exit``) and the output (``_stdout``). Fails the test when no report was
    written (the harness broke before its checker ran)."""
    report = out / "report.json"
    proc = subprocess.run(
        [sys.executable, str(CHAOS / "run.py"), *args, "--report", str(report),
         "--workdir", str(out / "work")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )  # fmt: skip
    if not report.exists():
        pytest.fail(
            f"scripts/chaos {' '.join(args)} wrote no report (exit {proc.returncode}):\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    data: dict[str, Any] = json.loads(report.read_text())
    data["_exit"] = proc.returncode
    data["_stdout"] = proc.stdout
    return data


def violation_details(report: dict[str, Any], invariant: str, rows: int = 3) -> str:
    """The first ten violations of ``invariant``, each with up to ``rows`` of its rows."""
    found = [v for v in report["violation_details"] if v["invariant"] == invariant]
    return "\n".join(
        f"run {v['run_id']}: {v['message']}\n    "
        + "\n    ".join(json.dumps(r, default=str)[:300] for r in v["rows"][:rows])
        for v in found[:10]
    )
