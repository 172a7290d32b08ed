"""The DBOS side of the peer comparison (``run.py --peers dbos``), run in DBOS's own venv.

Not imported by the driver: ``peers.py`` runs it as a subprocess of
``benchmarks/.venv-dbos/bin/python`` (DBOS pins its own SQLAlchemy, psycopg and friends,
which must not move the project venv's), pointed at a database of its own on the benchmark's
private PostgreSQL. It prints one JSON object on stdout, the last line of its output:

* ``latency``: a ``@DBOS.workflow`` of 10 sequential ``@DBOS.step`` no-op calls (``value +
  1``, each fed the previous output, as ``bench_chain10``), called in this process one at a
  time: ``--warmup`` unmeasured, then ``--runs`` timed from the call to its return (p50, p90);
  output checked (= 10). With ``cpu_ms_per_step`` of this process and PostgreSQL.
* ``queue``: ``--concurrent`` runs of the same workflow enqueued on a DBOS queue (declared
  with DBOS's defaults: no concurrency limit, polled every second), waited for through their
  handles: steps/s = 10 x runs / wall time from the first enqueue to the last result, and
  CPU per step of this process (every thread: the enqueues, the queue poller, the executor)
  plus PostgreSQL's process tree (postmaster and backends, exited ones included).

PostgreSQL's CPU includes whatever the ductor workers, idle meanwhile, ask of it (their
sweepers scan once a second): a few percent of a phase this size, counted against DBOS.
"""

# ruff: noqa: T201 - prints its JSON for the driver

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cpu  # noqa: E402 - stdlib only: importable from DBOS's venv
from common import STEPS, summary_ms  # noqa: E402

QUEUE = "bench-dbos"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url", required=True, help="postgresql://... of DBOS's system database")
    p.add_argument("--pg-pid", type=int, required=True, help="the postmaster's pid")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--concurrent", type=int, default=200)
    p.add_argument("--timeout", type=float, default=180.0)
    return p.parse_args(argv)


class _Cpu:
    """CPU seconds of this process (all threads) and of PostgreSQL's tree, between marks."""

    def __init__(self, pg_pid: int) -> None:
        self.roots = {"postgres": pg_pid, "dbos": os.getpid()}

    def read(self) -> dict[str, float]:
        return cpu.tree_seconds(self.roots)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("dbos").setLevel(logging.WARNING)
    from dbos import DBOS, DBOSConfig

    config: DBOSConfig = {
        "name": "ductor-bench-peer",
        "system_database_url": args.url,
        "log_level": "WARNING",
    }
    DBOS(config=config)

    @DBOS.step()
    def echo(value: int) -> int:
        return value + 1

    @DBOS.workflow()
    def chain10(value: int) -> int:
        for _ in range(STEPS):
            value = echo(value)
        return value

    t_launch = time.perf_counter()
    DBOS.launch()
    launch_s = time.perf_counter() - t_launch
    queue = DBOS.register_queue(QUEUE)
    meter = _Cpu(args.pg_pid)
    out: dict[str, Any] = {"dbos": _version(), "launch_s": round(launch_s, 3)}
    try:
        for _ in range(args.warmup):
            chain10(0)
        samples = []
        c0 = meter.read()
        for _ in range(args.runs):
            t0 = time.perf_counter()
            value = chain10(0)
            samples.append(time.perf_counter() - t0)
            if value != STEPS:
                raise RuntimeError(f"DBOS workflow returned {value!r}")
        out["latency"] = {**summary_ms(samples), **_cpu_per_step(c0, meter.read(), args.runs)}

        n = args.concurrent
        c0 = meter.read()
        t0 = time.perf_counter()
        handles = [queue.enqueue(chain10, 0) for _ in range(n)]
        t_enqueued = time.perf_counter()
        deadline = t0 + args.timeout
        for h in handles:
            if h.get_result() != STEPS:
                raise RuntimeError(f"DBOS queued workflow {h.get_workflow_id()} wrong result")
            if time.perf_counter() > deadline:
                raise RuntimeError("DBOS queue throughput: not done in time")
        wall = time.perf_counter() - t0
        out["queue"] = {
            "runs": n,
            "steps": n * STEPS,
            "wall_s": round(wall, 3),
            "enqueue_phase_s": round(t_enqueued - t0, 3),
            "steps_per_s": round(n * STEPS / wall, 1),
            **_cpu_per_step(c0, meter.read(), n, wall),
        }
    finally:
        DBOS.destroy()
    print(json.dumps(out), flush=True)
    return 0


def _cpu_per_step(
    c0: dict[str, float], c1: dict[str, float], runs: int, wall: float | None = None
) -> dict[str, Any]:
    steps = runs * STEPS
    spent = {k: c1.get(k, 0.0) - c0.get(k, 0.0) for k in c1}
    out: dict[str, Any] = {
        "cpu_ms_per_step": round(sum(spent.values()) / steps * 1000, 3),
        "by_process_ms_per_step": {k: round(v / steps * 1000, 3) for k, v in spent.items()},
    }
    if wall:
        out["cores_busy"] = round(sum(spent.values()) / wall, 2)
    return out


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dbos")
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
