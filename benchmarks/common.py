"""What every module of the benchmark shares: its paths, the workload, small helpers.

``run.py`` puts this directory and ``tests/`` (for ``servers.py``) on ``sys.path`` before it
imports the other modules, which import one another by their plain names.
"""

# ruff: noqa: T201 - a command-line report

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

#: ``run.py --experiment`` what-ifs that ``bench_app`` applies to the ductor app, and those the
#: harness applies to the coordinator's worker command instead.
APP_EXPERIMENTS = (
    "no-events",
    "no-sent-events",
    "no-pre-ping",
    "no-prepare",
    "no-sweeper",
    "classic-queues",
)
WORKER_EXPERIMENTS = ("coord-solo", "coord-c2")

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
TESTS_DIR = ROOT / "tests"

WORKFLOW = "bench_chain10"
STEPS = 10
#: ``--payload-items``: the sequential runs' workflow, each step passing on a document.
CARRY_WORKFLOW = "bench_chain10_carry"


def payload_items(n: int) -> list[dict[str, Any]]:
    """``n`` items of about 65 bytes of JSON each (an int, a string, a float, a list): 40 make
    2.6 kB, the document ``--payload-items`` has each step of a chain pass on."""
    return [{"id": i, "name": f"item-{i}", "price": i * 1.25, "tags": ["a", "b"]} for i in range(n)]


class BenchTimeout(Exception):
    """The whole benchmark ran past --time-limit."""


def pct(values: list[float], q: float) -> float:
    """Percentile with linear interpolation (q in 0..100)."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary_ms(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "p50_ms": round(pct(ms, 50), 2),
        "p90_ms": round(pct(ms, 90), 2),
        "mean_ms": round(statistics.fmean(ms), 2),
        "min_ms": round(min(ms), 2),
        "max_ms": round(max(ms), 2),
    }


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def git_describe() -> str | None:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    return None


def dig(d: dict[str, Any] | None, *keys: str) -> Any:
    """``d[k1][k2]...``, or None as soon as a level is missing."""
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def cpu_name(kind: str, mode: str, coordinators: int = 1) -> str:
    """The CPU phase's name: one per figure, mode and coordinator count."""
    return f"{kind} eager {mode}" + (f" {coordinators} coords" if coordinators > 1 else "")


def scatter_sizes(args: argparse.Namespace) -> list[int]:
    return sorted({n for n in args.scatter_sizes if n > 0})
