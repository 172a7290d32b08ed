"""Scatter/gather at 1,000 and 10,000 items: ductor vs a raw Celery chord, on local servers.

Usage (from the repo root)::

    .venv/bin/python benchmarks/scatter.py                 # 1,000 and 10,000 items, ~2 min
    .venv/bin/python benchmarks/scatter.py --sizes 1000 --no-chord

For each size it runs one ductor scatter of no-op steps (``max_parallel`` 64, the default) and,
unless ``--no-chord``, one raw Celery ``chord`` of the same no-op tasks with a Redis result
backend, on the same servers and worker commands as ``benchmarks/run.py``. It reports wall
time, the coordinator's CPU time, ticks, and the largest run-row state seen while the scatter
ran (sampled every 20 ms), and writes benchmarks/scatter_results.json.
"""

# ruff: noqa: T201 - a command-line report

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import run  # benchmarks/run.py: servers, workers, CPU accounting
from run import Bench, cpu, log

import sqlalchemy as sa


class _RowSizeWatcher(threading.Thread):
    """Samples the run row's stored state size (bytes, as PostgreSQL stores it)."""

    def __init__(self, db_url: str, run_id: str) -> None:
        super().__init__(daemon=True)
        self.engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
        self.run_id = run_id
        self.peak = 0
        self.samples = 0
        self.done = threading.Event()

    def run(self) -> None:
        query = sa.text(
            "SELECT pg_column_size(state) FROM eec_workflow_run WHERE run_id = :r"
        )
        with self.engine.connect() as conn:
            while not self.done.is_set():
                size = conn.execute(query, {"r": self.run_id}).scalar()
                conn.rollback()
                self.peak = max(self.peak, int(size or 0))
                self.samples += 1
                time.sleep(0.02)
        self.engine.dispose()


def ductor_scatter(bench: Bench, n: int, timeout: float) -> dict[str, Any]:
    ductor = bench.app.ductor
    coord_pid = bench.coord_w.proc.pid
    before = cpu.snapshot()
    t0 = time.perf_counter()
    handle = ductor.start("bench_scatter", input={"items": list(range(n)), "count": n})
    watcher = _RowSizeWatcher(bench.db_url, handle.run_id)
    watcher.start()
    view = ductor.wait(handle.run_id, timeout=timeout)
    wall = time.perf_counter() - t0
    watcher.done.set()
    watcher.join()
    if view.status.value != "succeeded":
        raise RuntimeError(f"scatter of {n}: {view.status} {view.error}")
    output = view.nodes["each"].output
    if output != [i + 1 for i in range(n)]:
        raise RuntimeError(f"scatter of {n}: wrong gathered output")
    spent = cpu.delta(before, cpu.snapshot(), cpu.classify_by_roots({"coord": coord_pid}))
    coord_cpu = spent.get("coord main", 0.0) + spent.get("coord pool", 0.0)
    with sa.create_engine(bench.db_url, poolclass=sa.pool.NullPool).connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT record_version, transition_count, pg_column_size(state) AS size "
                "FROM eec_workflow_run WHERE run_id = :r"
            ),
            {"r": handle.run_id},
        ).one()
    return {
        "items": n,
        "wall_s": round(wall, 2),
        "items_per_s": round(n / wall, 1),
        "coordinator_cpu_s": round(coord_cpu, 2),
        "coordinator_cpu_ms_per_item": round(coord_cpu / n * 1000, 2),
        "ticks_committed": row.record_version,
        "results_per_tick": round(n / max(row.record_version, 1), 1),
        "transitions": row.transition_count,
        "run_row_state_bytes_peak": watcher.peak,
        "run_row_state_bytes_final": row.size,
        "row_size_samples": watcher.samples,
    }


def raw_chord(bench: Bench, n: int, timeout: float) -> dict[str, Any]:
    from celery import chord

    from celery.exceptions import TimeoutError as CeleryTimeout

    app = bench.app
    t0 = time.perf_counter()
    result = chord(app.raw_noop.s(i) for i in range(n))(app.raw_count_results.s())
    try:
        count = result.get(timeout=timeout)
    except CeleryTimeout:
        log(f"raw chord {n}: no callback within {timeout:g}s; purging its queue")
        app.raw.control.purge()
        return {"items": n, "wall_s": None, "timed_out_after_s": timeout}
    wall = time.perf_counter() - t0
    if count != n:
        raise RuntimeError(f"chord of {n}: callback saw {count} results")
    return {"items": n, "wall_s": round(wall, 2), "items_per_s": round(n / wall, 1)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    p.add_argument("--no-chord", action="store_true", help="skip the raw Celery chord")
    p.add_argument("--timeout", type=float, default=300.0, help="per run, seconds")
    p.add_argument("--output", default=str(run.BENCH_DIR / "scatter_results.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench_args = run.parse_args(["--no-timers", "--time-limit", "3600"])
    with contextlib.ExitStack() as stack:
        bench = Bench(bench_args, stack)
        bench.setup()
        res: dict[str, Any] = {
            "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
            "git": run.git_describe(),
            "machine": run.machine_info(bench),
            "workers": bench.results.get("workers"),
            "ductor": [],
            "raw_chord": [],
        }
        for n in args.sizes:
            r = ductor_scatter(bench, n, args.timeout)
            log(f"ductor scatter {n}: {r}")
            res["ductor"].append(r)
            if not args.no_chord:
                c = raw_chord(bench, n, args.timeout)
                log(f"raw chord {n}: {c}")
                res["raw_chord"].append(c)
        d = res["ductor"]
        if len(d) >= 2:
            small, big = d[0], d[-1]
            scale = big["items"] / small["items"]
            res["growth"] = {
                "items_x": scale,
                "wall_x": round(big["wall_s"] / small["wall_s"], 2),
                "coordinator_cpu_x": round(
                    big["coordinator_cpu_s"] / max(small["coordinator_cpu_s"], 1e-9), 2
                ),
            }
        print(json.dumps(res, indent=2))
        Path(args.output).write_text(json.dumps(res, indent=2) + "\n")
        log(f"results written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
