"""Scatters: inline scatters against raw Celery groups, the batched scatter, and the ductor
workers' memory across scatters in a row. (``scatter.py`` is the old command line.)"""

# ruff: noqa: T201 - a command-line report

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import cpu
from common import log, scatter_sizes
from harness import Bench


class _RowSizeWatcher(threading.Thread):
    """Samples a run row's stored state size (bytes, as PostgreSQL stores it) while it runs."""

    def __init__(self, conninfo: str, run_id: str) -> None:
        super().__init__(daemon=True)
        self.conninfo = conninfo
        self.run_id = run_id
        self.peak = 0
        self.samples = 0
        self.done = threading.Event()

    def run(self) -> None:
        import psycopg

        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            while not self.done.is_set():
                row = conn.execute(
                    "SELECT pg_column_size(state) FROM eec_workflow_run WHERE run_id = %s",
                    (self.run_id,),
                ).fetchone()
                self.peak = max(self.peak, int(row[0] or 0) if row else 0)
                self.samples += 1
                self.done.wait(0.1)


def ductor_scatter(bench: Bench, n: int, workflow: str) -> dict[str, Any]:
    """One run of a scatter workflow over ``n`` items, start -> wait; output checked."""
    ductor = bench.app.ductor
    coord_pid = bench.coord_w.proc.pid
    before = cpu.snapshot()
    t0 = time.perf_counter()
    handle = ductor.start(workflow, input={"items": list(range(n)), "count": n})
    watcher = _RowSizeWatcher(bench.pg.conninfo("bench"), handle.run_id)
    watcher.start()
    try:
        view = ductor.wait(handle.run_id, timeout=bench.args.scatter_timeout)
    finally:
        wall = time.perf_counter() - t0
        watcher.done.set()
        watcher.join()
    if view.status.value != "succeeded":
        raise RuntimeError(f"{workflow} of {n}: {view.status} {view.error}")
    if view.nodes["each"].output != [i + 1 for i in range(n)]:
        raise RuntimeError(f"{workflow} of {n}: wrong gathered output")
    spent = cpu.delta(before, cpu.snapshot(), cpu.classify_by_roots({"coord": coord_pid}))
    coord_cpu = spent.get("coord main", 0.0) + spent.get("coord pool", 0.0)
    with bench.pg.connect("bench") as conn:
        row = conn.execute(
            "SELECT record_version, transition_count, pg_column_size(state) "
            "FROM eec_workflow_run WHERE run_id = %s",
            (handle.run_id,),
        ).fetchone()
    assert row is not None
    return {
        "workflow": workflow,
        "items": n,
        "wall_s": round(wall, 3),
        "items_per_s": round(n / wall, 1),
        "coordinator_cpu_s": round(coord_cpu, 2),
        "coordinator_cpu_ms_per_item": round(coord_cpu / n * 1000, 3),
        "ticks_committed": row[0],
        "results_per_tick": round(n / max(row[0], 1), 1),
        "transitions": row[1],
        "run_row_state_bytes_peak": watcher.peak,
        "run_row_state_bytes_final": row[2],
    }


def raw_group(bench: Bench, n: int) -> dict[str, Any]:
    """A raw Celery group of ``n`` no-op tasks with results (Redis result backend)."""
    from celery import group
    from celery.exceptions import TimeoutError as CeleryTimeout

    echo = bench.app.raw_echo
    t0 = time.perf_counter()
    result = group(echo.s(i) for i in range(n)).apply_async()
    try:
        values = result.get(timeout=bench.args.scatter_timeout)
    except CeleryTimeout:
        log(f"raw group {n}: no results within {bench.args.scatter_timeout:g}s; purging")
        bench.app.raw.control.purge()
        return {"items": n, "wall_s": None, "timed_out_after_s": bench.args.scatter_timeout}
    wall = time.perf_counter() - t0
    if values != [i + 1 for i in range(n)]:
        raise RuntimeError(f"raw group of {n}: wrong results")
    with contextlib.suppress(Exception):
        result.forget()
    return {"items": n, "wall_s": round(wall, 3), "items_per_s": round(n / wall, 1)}


def scatter_phases(bench: Bench) -> None:
    sizes = scatter_sizes(bench.args)
    if not sizes:
        return
    out: dict[str, Any] = {"eager_ticks": bench.mode, "ductor": [], "raw_group": []}
    bench.results["scatter"] = out
    for n in sizes:
        since = time.time()
        with bench.cpu_phase(f"scatter {n} ductor", n, "item"):
            d = ductor_scatter(bench, n, "bench_scatter")
        d["tick_stats"] = bench.tick_stats(since, time.time())
        log(f"ductor scatter {n}: {d}")
        out["ductor"].append(d)
        bench.drain_coordinator(time.time(), quiet=True)
        if not bench.args.no_raw_group:
            with bench.cpu_phase(f"scatter {n} raw group", n, "item"):
                g = raw_group(bench, n)
            log(f"raw group {n}: {g}")
            out["raw_group"].append(g)


def batched_scatter(bench: Bench) -> None:
    n, size = bench.args.batched_items, bench.args.batch_size
    if n <= 0 or size <= 0:
        return
    workflow = bench.app.BATCHED_SCATTER
    if workflow is None:
        print(f"batched scatter: not available ({bench.app.BATCHED_UNAVAILABLE})", flush=True)
        bench.results["batched_scatter"] = {
            "available": False,
            "why": bench.app.BATCHED_UNAVAILABLE,
        }
        return
    since = time.time()
    with bench.cpu_phase(f"scatter {n} batched", n, "item"):
        d = ductor_scatter(bench, n, workflow)
    d.update(available=True, batch_size=bench.app.BATCH_SIZE, eager_ticks=bench.mode)
    d["tick_stats"] = bench.tick_stats(since, time.time())
    log(f"batched scatter {n} (batch_size {bench.app.BATCH_SIZE}): {d}")
    bench.results["batched_scatter"] = d
    bench.drain_coordinator(time.time(), quiet=True)


def memory_phase(bench: Bench) -> None:
    """N scatters of the largest size in a row: the ductor workers' RSS before and after."""
    k, sizes = bench.args.memory_scatters, scatter_sizes(bench.args)
    if k <= 0:
        return
    n = max(sizes) if sizes else 10000
    time.sleep(1.0)
    before = bench.rss()
    walls, totals = [], []
    for i in range(k):
        d = ductor_scatter(bench, n, "bench_scatter")
        bench.drain_coordinator(time.time(), quiet=True)
        walls.append(d["wall_s"])
        totals.append({name: r["total_kb"] for name, r in bench.rss().items()})
        log(f"memory: scatter {i + 1}/{k} of {n} items in {d['wall_s']:.1f}s; RSS {totals[-1]}")
    time.sleep(1.0)
    after = bench.rss()
    bench.results["memory"] = {
        "scatters": k,
        "items": n,
        "eager_ticks": bench.mode,
        "wall_s": walls,
        "rss_before_kb": before,
        "rss_after_kb": after,
        "rss_total_kb_after_each": totals,
    }
