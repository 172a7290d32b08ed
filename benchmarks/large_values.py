"""Large values by reference, measured (issue 27, part 2; docs/large-values.md).

Usage (from the repo root)::

    .venv/bin/python benchmarks/large_values.py                  # ~3 min on a quiet machine
    .venv/bin/python benchmarks/large_values.py --items 10000    # a smaller scatter

Side by side, each scenario on a fresh database with fresh workers (a private PostgreSQL and
Redis, real ``celery worker`` processes of ``benchmarks/large_values_app.py``, both ``-P solo``
so the process measured is the one doing the work; eager ticks and inline steps off, so every
tick runs in the coordinator and every step in the step worker):

* ``two_step_small`` / ``two_step_5mib``: ``--runs`` runs of make -> measure, the value 100
  characters or 5 MiB (offloaded: the second step gets it by reference).
* ``scatter_inline`` / ``scatter_offloaded``: one scatter over ``--items`` items in batches
  of 100, the list in the run's input: inline (``ductor_offload_bytes`` raised to 64 MiB) or
  offloaded (the default 256 KiB; each tick reads the page it dispatches).

Figures per scenario: rows written per step (every ``eec_`` row of the runs, blob chunks
included, over attempt rows), bytes per tick (the JSON size of the values each tick of the
coordinator computed over and wrote: the run's state and input, the outputs, results, signal
payloads, gathers, large values and list pages it read, the arguments and output it wrote;
counted in the coordinator process by ``large_values_app.py``), the blob bytes the ticks read
and the chunk bytes they fetched, and the peak RSS (``VmHWM`` in ``/proc/<pid>/status``, read
when the work is done) of the step worker and the coordinator. Written to
``benchmarks/large_values_results.json`` with the ratios big/small.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path[:0] = [str(BENCH_DIR), str(ROOT / "tests"), str(ROOT)]

import sqlalchemy as sa  # noqa: E402
from celery import Celery  # noqa: E402
from cluster import Cluster  # noqa: E402
from common import log  # noqa: E402
from servers import PostgresServer, RedisServer  # noqa: E402

from ductor_celery import Ductor  # noqa: E402
from ductor_celery.store.migrate import upgrade  # noqa: E402

MIB = 1024 * 1024
#: Tables whose rows belong to one run, counted per scenario.
RUN_TABLES = (
    "eec_workflow_step_attempt",
    "eec_workflow_transition",
    "eec_workflow_signal",
    "eec_workflow_control",
    "eec_workflow_outbox",
    "eec_workflow_timer",
    "eec_blob",
)


def _hwm_mib(pid: int) -> float:
    """``VmHWM`` (peak resident set) of a process, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"no VmHWM for process {pid}")


def _report(trace: Path, pid: int) -> dict[str, Any]:
    """What a worker process wrote at its shutdown (large_values_app.py's counters)."""
    report: dict[str, Any] = json.loads((trace / f"{pid}.json").read_text())
    return report


def _client(url: str, broker: str, offload: int) -> Ductor:
    from large_values_app import build

    app = Celery(f"lv-client-{uuid.uuid4().hex[:6]}", broker=broker, set_as_current=False)
    app.conf.ductor_offload_bytes = offload
    d = Ductor(app, database_url=url)
    build(d)
    return d


def scenario(
    pg: PostgresServer, redis: RedisServer, name: str, offload: int, work: Any, workdir: Path
) -> dict[str, Any]:
    db = f"lv_{name}_{uuid.uuid4().hex[:6]}"
    pg.create_database(db)
    url = pg.url(db)
    upgrade(url)
    broker = redis.url(1)
    redis.client(1).flushdb()
    trace = workdir / name / "trace"
    trace.mkdir(parents=True)
    env = {"LV_OFFLOAD_BYTES": str(offload), "LV_TRACE_DIR": str(trace)}
    cluster = Cluster(url, broker, workdir / name, app="large_values_app", cwd=BENCH_DIR, **env)
    try:
        steps = cluster.start_steps(concurrency=1, pool="solo", name="steps")
        coord = cluster.start_steps(concurrency=1, pool="solo", name="coord", queues="ductor-coord")
        time.sleep(2.0)  # past start-up: what is measured below is the work
        client = _client(url, broker, offload)
        t0 = time.perf_counter()
        run_ids = work(client)
        wall = time.perf_counter() - t0
        # The kernel's peak resident set of each process, read before they stop (a process's
        # own ru_maxrss at shutdown includes what Celery's shutdown allocates).
        hwm = {"step_worker": _hwm_mib(steps.proc.pid), "coordinator": _hwm_mib(coord.proc.pid)}
        with sa.create_engine(url, poolclass=sa.pool.NullPool).connect() as conn:
            params = {"ids": run_ids}
            rows = {
                t: int(
                    conn.execute(
                        sa.text(f"SELECT count(*) FROM {t} WHERE run_id = ANY(:ids)"), params
                    ).scalar_one()
                )
                for t in RUN_TABLES
            }
            ticks = int(
                conn.execute(
                    sa.text(
                        "SELECT sum(record_version) FROM eec_workflow_run WHERE run_id = ANY(:ids)"
                    ),
                    params,
                ).scalar_one()
            )
            blob_bytes = int(
                conn.execute(
                    sa.text(
                        "SELECT coalesce(sum(length(data)), 0) FROM eec_blob "
                        "WHERE run_id = ANY(:ids)"
                    ),
                    params,
                ).scalar_one()
            )
    finally:
        cluster.stop()
    steps_report, coord_report = _report(trace, steps.proc.pid), _report(trace, coord.proc.pid)
    attempts = rows["eec_workflow_step_attempt"]
    return {
        "wall_s": round(wall, 2),
        "runs": len(run_ids),
        "attempt_rows": attempts,
        "ticks_committed": ticks,
        "ticks_computed": coord_report["ticks"],
        "computations": coord_report["computations"],
        "rows": rows,
        "rows_per_step": round(sum(rows.values()) / attempts, 2),
        "blob_bytes": blob_bytes,
        "tick_value_bytes_per_tick": round(
            coord_report["tick_value_bytes"] / max(coord_report["ticks"], 1)
        ),
        "blob_bytes_read_by_ticks": coord_report["blob_bytes_read_by_ticks"],
        "blob_chunk_bytes_fetched": {
            "step_worker": steps_report["blob_chunk_bytes_fetched"],
            "coordinator": coord_report["blob_chunk_bytes_fetched"],
        },
        "blob_bytes_written": {
            "step_worker": steps_report["blob_bytes_written"],
            "coordinator": coord_report["blob_bytes_written"],
        },
        "peak_rss_mib": hwm,
    }


def _two_step(size: int, runs: int) -> Any:
    def work(d: Ductor) -> list[str]:
        ids = []
        for _ in range(runs):
            handle = d.start("lv_two", input={"size": size})
            view = d.wait(handle.run_id, timeout=300)
            if view.status.value != "succeeded" or view.output != size:
                raise RuntimeError(f"lv_two {handle.run_id}: {view.status} {view.error}")
            ids.append(handle.run_id)
        return ids

    return work


def _scatter(items: int) -> Any:
    def work(d: Ductor) -> list[str]:
        handle = d.start("lv_scatter", input=[{"n": i, "pad": "p" * 8} for i in range(items)])
        view = d.wait(handle.run_id, timeout=1800)
        if view.status.value != "succeeded":
            raise RuntimeError(f"lv_scatter {handle.run_id}: {view.status} {view.error}")
        return [handle.run_id]

    return work


def _ratio(big: dict[str, Any], small: dict[str, Any]) -> dict[str, float]:
    return {
        "rows_per_step": round(big["rows_per_step"] / small["rows_per_step"], 2),
        "tick_value_bytes_per_tick": round(
            big["tick_value_bytes_per_tick"] / max(small["tick_value_bytes_per_tick"], 1), 2
        ),
        "peak_rss_step_worker": round(
            big["peak_rss_mib"]["step_worker"] / small["peak_rss_mib"]["step_worker"], 2
        ),
        "peak_rss_coordinator": round(
            big["peak_rss_mib"]["coordinator"] / small["peak_rss_mib"]["coordinator"], 2
        ),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="two-step runs per side")
    p.add_argument("--items", type=int, default=100_000, help="items of the scatter")
    p.add_argument("--output", default=str(BENCH_DIR / "large_values_results.json"))
    args = p.parse_args(argv)
    results: dict[str, Any] = {"args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="lv-bench-") as tmp, PostgresServer() as pg:
        with RedisServer() as redis:
            workdir = Path(tmp)
            default = 262_144
            plan = [
                ("two_step_small", default, _two_step(100, args.runs)),
                ("two_step_5mib", default, _two_step(5 * MIB, args.runs)),
                ("scatter_inline", 64 * MIB, _scatter(args.items)),
                ("scatter_offloaded", default, _scatter(args.items)),
            ]
            for name, offload, work in plan:
                log(f"{name} ...")
                results[name] = scenario(pg, redis, name, offload, work, workdir)
                log(json.dumps(results[name]))
    results["ratios"] = {
        "two_step_5mib_over_small": _ratio(results["two_step_5mib"], results["two_step_small"]),
        "scatter_offloaded_over_inline": _ratio(
            results["scatter_offloaded"], results["scatter_inline"]
        ),
    }
    Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    log(json.dumps(results["ratios"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
