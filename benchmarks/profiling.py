"""``--profile``: the ductor workers rerun under cProfile, and what a tick and a step spend,
by layer and by function."""

from __future__ import annotations

import glob
import json
import os
import pstats
from collections import defaultdict
from pathlib import Path
from typing import Any

from common import log, scatter_sizes
from ductor_phases import ductor_run
from harness import Bench
from scatters import ductor_scatter


def profile(bench: Bench) -> None:
    """Restart the ductor workers under cProfile, run sequential runs, stop them."""
    log("profile: restarting the ductor workers with cProfile around ticks and steps")
    prof_dir = bench.workdir / "profile"
    prof_dir.mkdir()
    bench.use_mode(bench.mode or "on", "-prof", {"BENCH_PROFILE_DIR": str(prof_dir)}, timers=False)
    if bench.args.profile_workload == "scatter":
        # One inline scatter of the smallest size: where a branch's tick and step spend.
        ductor_scatter(bench, min(scatter_sizes(bench.args) or [1000]), "bench_scatter")
    else:
        for _ in range(bench.args.warmup):
            ductor_run(bench)
        for _ in range(bench.args.runs):
            ductor_run(bench)
    bench.stop_workers(bench.ductor_workers)
    bench.ductor_workers = []
    report = profile_report(prof_dir, top=bench.args.profile_top)
    bench.results["profile"] = report
    if bench.args.profile_out:
        out = Path(bench.args.profile_out)
        out.mkdir(parents=True, exist_ok=True)
        for kind in ("tick", "step"):
            merged = merge_stats(prof_dir, kind)
            if merged is not None:
                merged.dump_stats(str(out / f"{kind}.prof"))
        log(f"profile: merged pstats written to {out}/tick.prof and step.prof")


def merge_stats(directory: Path, kind: str) -> pstats.Stats | None:
    files = sorted(glob.glob(str(directory / f"{kind}-*.prof")))
    if not files:
        return None
    stats = pstats.Stats(files[0], stream=open(os.devnull, "w"))  # noqa: SIM115
    for f in files[1:]:
        stats.add(f)
    return stats


def _short(func: tuple[str, int, str]) -> str:
    filename, line, name = func
    if filename == "~":
        return name  # a builtin, e.g. <method 'execute' of 'psycopg_binary...'>
    for marker in ("site-packages/", "lib/python3.11/", "/work/main/"):
        if marker in filename:
            filename = filename.split(marker, 1)[1]
            break
    return f"{filename}:{line}({name})"


def _bucket(func: tuple[str, int, str]) -> str:
    """Group self time by library, to say which layer a tick spends in."""
    filename, _, name = func
    if filename == "~":
        low = name.lower()
        if "psycopg" in low:
            return "psycopg (C)"
        if any(s in low for s in ("recv", "send", "poll", "select", "socket", "epoll")):
            return "socket I/O (C)"
        if "json" in low or "encode" in low or "decode" in low:
            return "json (C)"
        return "builtins (C)"
    for key, label in (
        ("ductor_celery/engine", "ductor engine (pure compute)"),
        ("ductor_celery/definition", "ductor definition"),
        ("ductor_celery/store", "ductor store"),
        ("ductor_celery/runtime", "ductor runtime"),
        ("ductor_celery", "ductor other"),
        ("sqlalchemy", "SQLAlchemy"),
        # Its self time includes blocking on the socket (psycopg's C wait is invisible to
        # cProfile), i.e. waiting for PostgreSQL and for a CPU to run on.
        ("psycopg", "psycopg (driver + waiting on PostgreSQL)"),
        ("kombu", "kombu"),
        ("celery", "celery"),
        ("redis", "redis-py"),
        ("json", "json"),
        ("pydantic", "pydantic"),
        ("uuid", "uuid"),
        ("bench_app", "benchmark instrumentation"),
    ):
        if key in filename:
            return label
    return "stdlib / other"


def profile_report(directory: Path, top: int = 15) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for kind, root in (("tick", "run_tick"), ("step", "execute_attempt")):
        stats = merge_stats(directory, kind)
        if stats is None:
            continue
        calls = sum(
            json.loads(Path(p).read_text())["calls"]
            for p in glob.glob(str(directory / f"{kind}-*.json"))
        )
        wall = sum(
            json.loads(Path(p).read_text())["wall"]
            for p in glob.glob(str(directory / f"{kind}-*.json"))
        )
        raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
        n = max(calls, 1)
        cum = sorted(raw.items(), key=lambda kv: kv[1][3], reverse=True)
        self_time = sorted(raw.items(), key=lambda kv: kv[1][2], reverse=True)
        buckets: dict[str, float] = defaultdict(float)
        for func, (_cc, _nc, tt, _ct, _callers) in raw.items():
            buckets[_bucket(func)] += tt
        total_tt = sum(buckets.values())
        report[kind] = {
            "calls": calls,
            "wall_per_call_ms_profiled": round(wall / n * 1000, 3),
            "by_layer_self_ms_per_call": {
                k: round(v / n * 1000, 3)
                for k, v in sorted(buckets.items(), key=lambda kv: kv[1], reverse=True)
            },
            "by_layer_share": {
                k: round(v / total_tt, 3)
                for k, v in sorted(buckets.items(), key=lambda kv: kv[1], reverse=True)
            },
            "top_cumulative": [
                {
                    "func": _short(f),
                    "ncalls_per_call": round(v[1] / n, 2),
                    "cum_ms_per_call": round(v[3] / n * 1000, 3),
                }
                for f, v in cum[:top]
            ],
            "top_self": [
                {
                    "func": _short(f),
                    "ncalls_per_call": round(v[1] / n, 2),
                    "self_ms_per_call": round(v[2] / n * 1000, 3),
                }
                for f, v in self_time[:top]
            ],
        }
        _ = root
    return report
