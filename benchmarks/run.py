"""ductor vs raw Celery, side by side in one run, on private local servers.

Usage (from the repo root)::

    .venv/bin/python benchmarks/run.py             # every figure, ~15-18 minutes on 2 cores
    .venv/bin/python benchmarks/run.py --scatter-sizes 0 --batched-items 0   # no scatters
    .venv/bin/python benchmarks/run.py --memory-scatters 10   # + memory over 10 scatters
    .venv/bin/python benchmarks/run.py --profile --pg-log   # plus cProfile, SQL per step

Measures a 10-step run's latency and throughput with eager ticks off and on (and with a
second coordinator), tick recomputes, CPU per unit of work of every process, inline scatters
against raw Celery groups, the batched scatter, and optionally memory across scatters; every
ductor figure is printed beside raw Celery's from the same run, as a ratio against its target.

One invocation starts a private PostgreSQL and Redis on 127.0.0.1 (tests/servers.py), migrates
a database, starts the workers with the production commands, measures, prints a table, writes
benchmarks/results.json, and stops everything it started, also on Ctrl-C, on error, and when
the whole run exceeds --time-limit. See benchmarks/README.md for what each figure means.
"""

# ruff: noqa: T201 - a command-line report

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
import operator
import os
import platform
import pstats
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
TESTS_DIR = ROOT / "tests"
sys.path[:0] = [str(BENCH_DIR), str(TESTS_DIR)]

import cpu  # noqa: E402
from servers import PostgresServer, RedisServer, default_base_dir  # noqa: E402
from workers import Worker  # noqa: E402

WORKFLOW = "bench_chain10"
STEPS = 10
# Issue 10's targets, all ratios against raw Celery from the same run (except the last three).
TARGET_LATENCY_RATIO = 2.0  # 10-step p50 vs a raw 10-task chain
TARGET_THROUGHPUT_RATIO = 0.5  # steps/s vs plain tasks/s
TARGET_CPU_RATIO = 2.0  # CPU ms per step vs per raw task, all processes
TARGET_SCATTER_RATIO = 1.2  # inline scatter wall time vs a raw group of as many tasks
TARGET_GROWTH_SLACK = 1.1  # 1,000 -> 10,000 items: at most 11x the wall time
TARGET_RECOMPUTE_PCT = 1.0  # tick recomputes with two coordinators, % of ticks
TARGET_BATCHED_S = 5.0  # 10,000 items with batch_size=100
TARGET_NOOP_TICK_MS = 1.0  # a duplicate wake-up's whole tick


class BenchTimeout(Exception):
    """The whole benchmark ran past --time-limit."""


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# the benchmark
# --------------------------------------------------------------------------------------------


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


class Bench:
    def __init__(self, args: argparse.Namespace, stack: contextlib.ExitStack) -> None:
        self.args = args
        self.stack = stack
        self.workers: list[Worker] = []
        self.ductor_workers: list[Worker] = []
        self.results: dict[str, Any] = {"modes": {}}
        self.mode: str | None = None
        self.worker_env: dict[str, str] = {}
        self.timers_dir: Path | None = None

    # -- set-up -------------------------------------------------------------------------------

    def setup(self) -> None:
        base = default_base_dir()
        self.workdir = Path(tempfile.mkdtemp(prefix="ductor-bench-", dir=base))
        if not self.args.keep:
            self.stack.callback(shutil.rmtree, self.workdir, ignore_errors=True)
        (self.workdir / "ready").mkdir()
        log(f"work dir {self.workdir}")

        t0 = time.monotonic()
        self.pg = PostgresServer()
        self.pg.start()
        self.stack.callback(self.pg.stop)
        self.redis = RedisServer()
        self.redis.start()
        self.stack.callback(self.redis.stop)
        log(
            f"servers up in {time.monotonic() - t0:.1f}s: PostgreSQL :{self.pg.port}, "
            f"Redis :{self.redis.port}"
        )

        from ductor_celery.store.db import dispose_all
        from ductor_celery.store.migrate import upgrade

        self.pg.create_database("bench")
        self.db_url = self.pg.url("bench")
        upgrade(self.db_url)
        dispose_all()

        # db 0: ductor's broker; 1: raw broker; 2: raw results; 3: raw throughput counter.
        self.env = {
            **os.environ,
            "DUCTOR_DATABASE_URL": self.db_url,
            "BENCH_BROKER_URL": self.redis.url(0),
            "BENCH_RAW_BROKER_URL": self.redis.url(1),
            "BENCH_RAW_BACKEND_URL": self.redis.url(2),
            "BENCH_COUNTER_URL": self.redis.url(3),
            "BENCH_READY_DIR": str(self.workdir / "ready"),
            # The driver and the workers must register the same batched definition.
            "BENCH_BATCH_SIZE": str(self.args.batch_size if self.args.batch_size > 0 else 100),
            "PYTHONPATH": os.pathsep.join(
                [str(BENCH_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
        if self.args.experiment:
            # Worker-command experiments are handled here; the rest by bench_app.
            self.env["BENCH_EXPERIMENTS"] = ",".join(
                e for e in self.args.experiment if not e.startswith("coord-")
            )
        # Per worker (use_mode), never inherited from the caller's shell.
        for key in (
            "BENCH_TIMERS_DIR",
            "BENCH_PROFILE_DIR",
            "BENCH_EAGER",
            *(() if self.args.experiment else ("BENCH_EXPERIMENTS",)),
        ):
            self.env.pop(key, None)
            os.environ.pop(key, None)
        os.environ.update(
            {k: v for k, v in self.env.items() if k.startswith(("BENCH_", "DUCTOR_"))}
        )

        import bench_app  # configured from the environment just set

        self.app = bench_app
        t0 = time.monotonic()
        self.raw_w = self.start_worker(
            "raw", "bench_app:raw", ["-Q", bench_app.RAW_QUEUE, "-c", "2"], {}
        )
        self.raw_w.wait_ready()
        log(f"raw worker ready in {time.monotonic() - t0:.1f}s: {self.raw_w.command}")
        self.results["workers"] = {"raw": self.raw_w.command}

    def start_worker(self, name: str, app: str, args: list[str], env: dict[str, str]) -> Worker:
        if not self.workers:
            self.stack.callback(self.stop_all_workers)
        worker = Worker(name, app, args, {**self.env, **env}, self.workdir)
        self.workers.append(worker)
        return worker

    def stop_workers(self, workers: list[Worker]) -> None:
        """Warm-stop the given workers at once (each waits for its task in hand), then reap."""
        workers = [w for w in workers if w in self.workers]
        for w in workers:
            self.workers.remove(w)
            w.terminate()
        for w in workers:
            w.stop()

    def stop_all_workers(self) -> None:
        t0 = time.monotonic()
        workers = list(self.workers)
        self.stop_workers(workers)
        if workers:
            log(f"stopped {len(workers)} workers in {time.monotonic() - t0:.1f}s")

    def start_coordinator(self, name: str, env: dict[str, str]) -> Worker:
        pool = ["-c", "1"]
        if "coord-solo" in self.args.experiment:
            pool = ["-P", "solo"]
        elif "coord-c2" in self.args.experiment:
            pool = ["-c", "2"]
        return self.start_worker(name, "bench_app", ["-Q", self.app.COORD_QUEUE, *pool], env)

    def use_mode(
        self, mode: str, suffix: str = "", env: dict[str, str] | None = None, timers: bool = True
    ) -> None:
        """(Re)start the ductor step worker and coordinator with eager ticks on or off."""
        t0 = time.monotonic()
        self.stop_workers(self.ductor_workers)
        self.ductor_workers = []
        self.mode = mode
        tag = f"eager-{mode}{suffix}"
        extra = {
            "BENCH_EAGER": "0" if mode == "off" else "1",
            # "on": eager ticks without inline steps; "inline": both (the package default).
            "BENCH_INLINE": "50" if mode == "inline" else "0",
            **(env or {}),
        }
        self.timers_dir = None
        if timers and not self.args.no_timers:
            # One directory per mode: a phase reads only its own workers' records.
            self.timers_dir = self.workdir / "timers" / tag
            self.timers_dir.mkdir(parents=True, exist_ok=True)
            extra["BENCH_TIMERS_DIR"] = str(self.timers_dir)
        self.worker_env = extra
        self.steps_w = self.start_worker(
            f"steps-{tag}", "bench_app", ["-Q", self.app.STEPS_QUEUE, "-c", "2"], extra
        )
        self.coord_w = self.start_coordinator(f"coord-{tag}", extra)
        self.ductor_workers = [self.steps_w, self.coord_w]
        for w in self.ductor_workers:
            w.wait_ready()
        log(f"ductor workers (eager ticks {mode}) ready in {time.monotonic() - t0:.1f}s:")
        for w in self.ductor_workers:
            log(
                f"    {w.command}  [BENCH_EAGER={extra['BENCH_EAGER']}"
                f" BENCH_INLINE={extra['BENCH_INLINE']}]"
            )
        self.results["workers"].setdefault("ductor_steps", self.steps_w.command)
        self.results["workers"].setdefault("ductor_coordinator", self.coord_w.command)

    @contextlib.contextmanager
    def cpu_phase(self, name: str, units: int, unit: str) -> Iterator[None]:
        """CPU time of every process during the phase, in ms per unit of work, by process."""
        # Workers are the driver's children: match them (and the servers) before the driver.
        roots = {
            **{w.name: w.proc.pid for w in self.workers},
            "postgres": self.pg._proc.pid,  # type: ignore[union-attr]
            "redis": self.redis._proc.pid,  # type: ignore[union-attr]
            "driver": os.getpid(),
        }
        before = cpu.snapshot()
        steal0 = cpu.steal_seconds()
        t0 = time.perf_counter()
        yield
        wall = time.perf_counter() - t0
        steal = (cpu.steal_seconds() - steal0) / wall
        spent = cpu.delta(before, cpu.snapshot(), cpu.classify_by_roots(roots))
        total = sum(spent.values())
        background = spent.get("other", 0.0) / wall
        if steal > 0.1:
            log(f"WARNING: the hypervisor stole {steal:.2f} cores during {name}")
        if background > 0.15:
            log(
                f"WARNING: processes outside the benchmark used {background:.2f} cores during "
                f"{name}: the machine is not quiet, figures are pessimistic"
            )
        # 'other' is not ours: CPU per unit counts the benchmark's processes only.
        ours = total - spent.get("other", 0.0)
        self.results.setdefault("cpu", {})[name] = {
            "background_cores": round(background, 2),
            "steal_cores": round(steal, 2),
            "unit": unit,
            "units": units,
            "wall_s": round(wall, 3),
            "cpu_s": round(ours, 2),
            "cores_busy": round(ours / wall, 2),
            "cpu_ms_per_unit": round(ours / units * 1000, 2),
            "by_process_ms_per_unit": {
                k: round(v / units * 1000, 2)
                for k, v in sorted(spent.items(), key=lambda kv: -kv[1])
            },
        }

    # -- ductor -------------------------------------------------------------------------------

    def ductor_run(self) -> tuple[float, str, float, float]:
        """One run, start -> wait. Returns (seconds, run_id, wall start, wall end)."""
        ductor = self.app.ductor
        w0 = time.time()
        t0 = time.perf_counter()
        handle = ductor.start(WORKFLOW, input={"value": 0})
        view = ductor.wait(handle.run_id, timeout=60)
        elapsed = time.perf_counter() - t0
        w1 = time.time()
        if view.status.value != "succeeded" or view.output != STEPS:
            raise RuntimeError(f"run {handle.run_id}: {view.status} output={view.output!r}")
        return elapsed, handle.run_id, w0, w1

    def ductor_latency(self) -> tuple[dict[str, float], list[tuple[str, float, float]]]:
        for _ in range(self.args.warmup):
            self.ductor_run()
        samples, runs = [], []
        for _ in range(self.args.runs):
            elapsed, run_id, w0, w1 = self.ductor_run()
            samples.append(elapsed)
            runs.append((run_id, w0, w1))
        figures = summary_ms(samples)
        log(f"ductor 10-step latency (eager ticks {self.mode}): {figures}")
        return figures, runs

    def ductor_throughput(self, label: str) -> dict[str, Any]:
        import psycopg

        ductor = self.app.ductor
        n = self.args.concurrent_runs
        with psycopg.connect(self.pg.conninfo("bench"), autocommit=True) as conn:
            conn.execute("LISTEN ductor_run_finished")
            t0 = time.perf_counter()
            run_ids = {ductor.start(WORKFLOW, input={"value": 0}).run_id for _ in range(n)}
            t_started = time.perf_counter()
            done: set[str] = set()
            last_poll = time.perf_counter()
            deadline = t0 + self.args.phase_timeout
            while len(done) < n:
                for note in conn.notifies(timeout=0.2):
                    if note.payload in run_ids:
                        done.add(note.payload)
                        if len(done) == n:
                            break
                now = time.perf_counter()
                if len(done) < n and now - last_poll > 2.0:  # safety net: a missed notify
                    last_poll = now
                    rows = conn.execute(
                        "SELECT run_id FROM eec_workflow_run WHERE run_id = ANY(%s) "
                        "AND status NOT IN ('pending', 'running')",
                        (list(run_ids),),
                    ).fetchall()
                    done |= {r[0] for r in rows}
                if now > deadline:
                    raise RuntimeError(f"ductor throughput: {len(done)}/{n} runs done in time")
            wall = time.perf_counter() - t0
            stats = conn.execute(
                "SELECT status, count(*), "
                "percentile_cont(0.5) WITHIN GROUP (ORDER BY finished_at - created_at), "
                "max(finished_at - created_at) "
                "FROM eec_workflow_run WHERE run_id = ANY(%s) GROUP BY status",
                (list(run_ids),),
            ).fetchall()
        by_status = {s: c for s, c, _, _ in stats}
        if by_status.get("succeeded") != n:
            raise RuntimeError(f"ductor throughput: statuses {by_status}")
        run_p50, run_max = stats[0][2].total_seconds(), stats[0][3].total_seconds()
        figures = {
            "runs": n,
            "steps": n * STEPS,
            "wall_s": round(wall, 3),
            "start_phase_s": round(t_started - t0, 3),
            "steps_per_s": round(n * STEPS / wall, 1),
            "runs_per_s": round(n / wall, 2),
            "run_duration_p50_ms": round(run_p50 * 1000, 1),
            "run_duration_max_ms": round(run_max * 1000, 1),
            "finished_at": time.time(),
        }
        log(f"ductor throughput ({label}): {figures}")
        return figures

    def drain_coordinator(self, finished_at: float, quiet: bool = False) -> dict[str, Any]:
        """Wait until the coordinator has no queued wake-ups left, so the next phase runs on
        an idle machine, and report what was still queued when the last run had finished
        (wake-ups for finished runs: each one costs a no-op tick)."""
        import redis

        client = redis.Redis.from_url(self.redis.url(0))
        queued = int(client.llen(self.app.COORD_QUEUE))
        t0 = time.perf_counter()
        deadline = t0 + self.args.phase_timeout
        while client.llen(self.app.COORD_QUEUE) and time.perf_counter() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the last prefetched ones
        drain = time.perf_counter() - t0
        left = int(client.llen(self.app.COORD_QUEUE))
        client.close()
        after: dict[str, int] = {}
        if self.timers_dir is not None:
            for r in self.read_timer_records(self.timers_dir):
                if r["k"] == "tick" and r["start"] >= finished_at:
                    after[str(r.get("result"))] = after.get(str(r.get("result")), 0) + 1
        out = {
            "coordinator_queue_at_finish": queued,
            "drain_s": round(drain, 2),
            "coordinator_queue_after_drain": left,
            "ticks_after_finish": after,
        }
        if not quiet:
            log(
                f"coordinator queue when the last run finished: {queued} wake-ups; drained in "
                f"{drain:.1f}s; ticks after the finish: {after}"
            )
        return out

    def tick_stats(self, since: float, until: float) -> dict[str, Any] | None:
        """What the ticks that started in [since, until] did, from every worker's timer lines
        (coordinators and, for eager ticks, step workers): outcomes and recomputes."""
        if self.timers_dir is None:
            return None
        time.sleep(0.3)  # the last records are written as the tasks return
        ticks = [
            r
            for r in self.read_timer_records(self.timers_dir)
            if r["k"] == "tick" and since <= r["start"] <= until
        ]
        outcomes = Counter(str(r.get("result")) for r in ticks)
        eager = [r for r in ticks if r.get("eager")]
        computed = len(ticks) - outcomes.get("busy", 0)  # a busy tick computed nothing
        recomputes = sum(int(r.get("conflicts", 0)) for r in ticks)
        return {
            "ticks": len(ticks),
            "coordinator_ticks": len(ticks) - len(eager),
            "eager_ticks": len(eager),
            "busy_eager_ticks": sum(1 for r in eager if r.get("result") == "busy"),
            "outcomes": dict(outcomes.most_common()),
            "recomputes": recomputes,
            "recompute_pct": round(100.0 * recomputes / computed, 3) if computed else None,
        }

    def ductor_throughput_phase(self, mode: str, coordinators: int) -> dict[str, Any]:
        label = f"eager ticks {mode}, {coordinators} coordinator{'s' if coordinators > 1 else ''}"
        since = time.time()
        with self.cpu_phase(
            cpu_name("ductor_throughput", mode, coordinators),
            self.args.concurrent_runs * STEPS,
            "step",
        ):
            figures = self.ductor_throughput(label)
        finished = figures.pop("finished_at")
        figures.update(self.drain_coordinator(finished))
        out: dict[str, Any] = {
            "throughput": figures,
            "phase_mean_ms": self.throughput_phase_costs(since, finished),
            "tick_stats": self.tick_stats(since, time.time()),
        }
        log(f"ticks ({label}): {out['tick_stats']}")
        return out

    def ductor_mode_phases(self, mode: str) -> None:
        """Sequential latency and throughput with eager ticks on or off, then the throughput
        phase again with a second coordinator process."""
        res: dict[str, Any] = self.results["modes"].setdefault(mode, {})
        with self.cpu_phase(
            cpu_name("ductor_latency", mode), (self.args.runs + self.args.warmup) * STEPS, "step"
        ):
            res["latency"], runs = self.ductor_latency()
        res["latency_breakdown"] = self.latency_breakdown(runs)
        res["noop_tick"] = self.noop_ticks(runs[-1][0])
        res["one_coordinator"] = self.ductor_throughput_phase(mode, 1)
        if mode in self.args.two_coord_modes:
            coord2 = self.start_coordinator(f"coord2-eager-{mode}", self.worker_env)
            coord2.wait_ready()
            log(f"second coordinator ready: {coord2.command} -n {coord2.name}@%h")
            self.results["workers"].setdefault("ductor_coordinator_2", coord2.command)
            try:
                res["two_coordinators"] = self.ductor_throughput_phase(mode, 2)
            finally:
                self.stop_workers([coord2])

    def noop_ticks(self, run_id: str, n: int = 300) -> dict[str, Any]:
        """A duplicate wake-up of a finished run: the coordinator's whole tick (clear the
        wake-up row, load, compute, nothing to commit), run ``n`` times in this process with
        the production code; wall and CPU per tick, and what each tick returned."""
        from collections import Counter as _Counter

        from ductor_celery.runtime.coordinator import run_tick

        rt = self.app.ductor.runtime
        for _ in range(10):
            run_tick(rt, run_id)
        outcomes: _Counter[str] = _Counter()
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            outcomes[run_tick(rt, run_id)] += 1
        c1, w1 = time.process_time(), time.perf_counter()
        figures = {
            "ticks": n,
            "wall_ms_per_tick": round(1000 * (w1 - w0) / n, 3),
            "driver_cpu_ms_per_tick": round(1000 * (c1 - c0) / n, 3),
            "outcomes": dict(outcomes),
        }
        log(f"no-op ticks (eager ticks {self.mode}): {figures}")
        return figures

    # -- raw Celery ---------------------------------------------------------------------------

    def raw_chain_once(self) -> float:
        from celery import chain

        echo = self.app.raw_echo
        t0 = time.perf_counter()
        result = chain(echo.s(0), *(echo.s() for _ in range(STEPS - 1))).apply_async()
        value = result.get(timeout=60)
        elapsed = time.perf_counter() - t0
        if value != STEPS:
            raise RuntimeError(f"raw chain returned {value!r}")
        result.forget()
        return elapsed

    def raw_latency(self) -> dict[str, float]:
        for _ in range(self.args.warmup):
            self.raw_chain_once()
        samples = [self.raw_chain_once() for _ in range(self.args.runs)]
        figures = summary_ms(samples)
        log(f"raw chain latency: {figures}")
        return figures

    def raw_throughput(self) -> dict[str, Any]:
        import redis

        n = self.args.raw_tasks
        counter = redis.Redis.from_url(self.redis.url(3))
        counter.set(self.app.COUNTER_KEY, 0)
        task = self.app.raw_count
        t0 = time.perf_counter()
        with self.app.raw.producer_or_acquire() as producer:
            for i in range(n):
                task.apply_async(args=[i], producer=producer)
        t_sent = time.perf_counter()
        deadline = t0 + self.args.phase_timeout
        while int(counter.get(self.app.COUNTER_KEY) or 0) < n:
            if time.perf_counter() > deadline:
                raise RuntimeError("raw throughput: tasks not done in time")
            time.sleep(0.005)
        wall = time.perf_counter() - t0
        counter.close()
        figures = {
            "tasks": n,
            "wall_s": round(wall, 3),
            "send_phase_s": round(t_sent - t0, 3),
            "tasks_per_s": round(n / wall, 1),
        }
        log(f"raw throughput: {figures}")
        return figures

    def raw_phases(self) -> None:
        with self.cpu_phase(
            "raw_chain_latency", (self.args.runs + self.args.warmup) * STEPS, "task"
        ):
            self.results["raw_chain_latency"] = self.raw_latency()
        with self.cpu_phase("raw_throughput", self.args.raw_tasks, "task"):
            self.results["raw_throughput"] = self.raw_throughput()

    # -- scatter ------------------------------------------------------------------------------

    def ductor_scatter(self, n: int, workflow: str) -> dict[str, Any]:
        """One run of a scatter workflow over ``n`` items, start -> wait; output checked."""
        ductor = self.app.ductor
        coord_pid = self.coord_w.proc.pid
        before = cpu.snapshot()
        t0 = time.perf_counter()
        handle = ductor.start(workflow, input={"items": list(range(n)), "count": n})
        watcher = _RowSizeWatcher(self.pg.conninfo("bench"), handle.run_id)
        watcher.start()
        try:
            view = ductor.wait(handle.run_id, timeout=self.args.scatter_timeout)
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
        with self.pg.connect("bench") as conn:
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

    def raw_group(self, n: int) -> dict[str, Any]:
        """A raw Celery group of ``n`` no-op tasks with results (Redis result backend)."""
        from celery import group
        from celery.exceptions import TimeoutError as CeleryTimeout

        echo = self.app.raw_echo
        t0 = time.perf_counter()
        result = group(echo.s(i) for i in range(n)).apply_async()
        try:
            values = result.get(timeout=self.args.scatter_timeout)
        except CeleryTimeout:
            log(f"raw group {n}: no results within {self.args.scatter_timeout:g}s; purging")
            self.app.raw.control.purge()
            return {"items": n, "wall_s": None, "timed_out_after_s": self.args.scatter_timeout}
        wall = time.perf_counter() - t0
        if values != [i + 1 for i in range(n)]:
            raise RuntimeError(f"raw group of {n}: wrong results")
        with contextlib.suppress(Exception):
            result.forget()
        return {"items": n, "wall_s": round(wall, 3), "items_per_s": round(n / wall, 1)}

    def scatter_phases(self) -> None:
        sizes = scatter_sizes(self.args)
        if not sizes:
            return
        out: dict[str, Any] = {"eager_ticks": self.mode, "ductor": [], "raw_group": []}
        self.results["scatter"] = out
        for n in sizes:
            since = time.time()
            with self.cpu_phase(f"scatter {n} ductor", n, "item"):
                d = self.ductor_scatter(n, "bench_scatter")
            d["tick_stats"] = self.tick_stats(since, time.time())
            log(f"ductor scatter {n}: {d}")
            out["ductor"].append(d)
            self.drain_coordinator(time.time(), quiet=True)
            if not self.args.no_raw_group:
                with self.cpu_phase(f"scatter {n} raw group", n, "item"):
                    g = self.raw_group(n)
                log(f"raw group {n}: {g}")
                out["raw_group"].append(g)

    def batched_scatter(self) -> None:
        n, size = self.args.batched_items, self.args.batch_size
        if n <= 0 or size <= 0:
            return
        workflow = self.app.BATCHED_SCATTER
        if workflow is None:
            print(f"batched scatter: not available ({self.app.BATCHED_UNAVAILABLE})", flush=True)
            self.results["batched_scatter"] = {
                "available": False,
                "why": self.app.BATCHED_UNAVAILABLE,
            }
            return
        since = time.time()
        with self.cpu_phase(f"scatter {n} batched", n, "item"):
            d = self.ductor_scatter(n, workflow)
        d.update(available=True, batch_size=self.app.BATCH_SIZE, eager_ticks=self.mode)
        d["tick_stats"] = self.tick_stats(since, time.time())
        log(f"batched scatter {n} (batch_size {self.app.BATCH_SIZE}): {d}")
        self.results["batched_scatter"] = d
        self.drain_coordinator(time.time(), quiet=True)

    def rss(self) -> dict[str, dict[str, int]]:
        return {w.name: w.rss_kb() for w in self.ductor_workers}

    def memory_phase(self) -> None:
        """N scatters of the largest size in a row: the ductor workers' RSS before and after."""
        k, sizes = self.args.memory_scatters, scatter_sizes(self.args)
        if k <= 0:
            return
        n = max(sizes) if sizes else 10000
        time.sleep(1.0)
        before = self.rss()
        walls, totals = [], []
        for i in range(k):
            d = self.ductor_scatter(n, "bench_scatter")
            self.drain_coordinator(time.time(), quiet=True)
            walls.append(d["wall_s"])
            totals.append({name: r["total_kb"] for name, r in self.rss().items()})
            log(f"memory: scatter {i + 1}/{k} of {n} items in {d['wall_s']:.1f}s; RSS {totals[-1]}")
        time.sleep(1.0)
        after = self.rss()
        self.results["memory"] = {
            "scatters": k,
            "items": n,
            "eager_ticks": self.mode,
            "wall_s": walls,
            "rss_before_kb": before,
            "rss_after_kb": after,
            "rss_total_kb_after_each": totals,
        }

    # -- where a run's time goes (phase timers) -----------------------------------------------

    def read_timer_records(self, directory: Path) -> list[dict[str, Any]]:
        records = []
        for path in directory.glob("*.jsonl"):
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    records.append(json.loads(line))
        return records

    def latency_breakdown(self, runs: list[tuple[str, float, float]]) -> dict[str, Any] | None:
        """Critical path of the sequential runs, from the workers' phase timers (wall clock)."""
        if self.timers_dir is None:
            return None
        try:
            return self._latency_breakdown(self.timers_dir, runs)
        except (KeyError, ValueError, statistics.StatisticsError) as exc:
            log(f"no latency breakdown (timer records incomplete: {exc!r})")
            return None

    def _latency_breakdown(
        self, timers_dir: Path, runs: list[tuple[str, float, float]]
    ) -> dict[str, Any] | None:
        time.sleep(0.3)  # the last records are written as the tasks return
        records = self.read_timer_records(timers_dir)
        ticks: dict[str, list[dict[str, Any]]] = defaultdict(list)
        steps: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in records:
            if r["k"] == "tick":
                ticks[r["run"]].append(r)
            elif r["k"] == "step":
                steps[r["token"].split(":")[0]].append(r)
        parts: dict[str, list[float]] = defaultdict(list)
        off_path: dict[str, list[float]] = defaultdict(list)
        publishes: dict[str, list[int]] = defaultdict(list)
        tick_phases: dict[str, list[float]] = defaultdict(list)
        step_phases: dict[str, list[float]] = defaultdict(list)
        eager_ticks = 0
        for run_id, w0, w1 in runs:
            rt = sorted(
                (t for t in ticks[run_id] if t.get("result") == "committed"),
                key=lambda t: t["start"],
            )
            rs = sorted(steps[run_id], key=lambda s: s["start"])
            if len(rt) != STEPS + 1 or len(rs) != STEPS:
                continue  # an extra (sweeper) tick or a lost record: skip this run
            parts["client start() -> first tick begins"].append(rt[0]["start"] - w0)
            for k in range(STEPS):
                tick, step, nxt = rt[k], rs[k], rt[k + 1]
                t_pub = tick.get("first_publish_end", tick["send_end"])
                parts["tick: load + compute + commit + publish step"].append(t_pub - tick["start"])
                parts["hop: step message -> step task body starts"].append(step["start"] - t_pub)
                if nxt.get("eager"):
                    # The next tick ran inside this step, in the step worker: no hop.
                    eager_ticks += 1
                    parts["step: claim + fn + finish, up to its eager tick"].append(
                        nxt["start"] - step["start"]
                    )
                    parts["hop: wake-up message -> next tick begins"].append(0.0)
                    off_path["step after its eager tick"].append(step["end"] - nxt["end"])
                else:
                    s_pub = step.get("first_publish_end", step["wake_end"])
                    parts["step: claim + fn + finish + publish wake-up"].append(
                        s_pub - step["start"]
                    )
                    parts["hop: wake-up message -> next tick begins"].append(nxt["start"] - s_pub)
                    off_path["step after its publish (sent event)"].append(step["end"] - s_pub)
                off_path["tick after its publish (sent event, outbox delete)"].append(
                    tick["end"] - t_pub
                )
            last = rt[-1]
            parts["last tick: load + compute + commit"].append(
                last["commit_tick_end"] - last["start"]
            )
            parts["commit (NOTIFY) -> wait() returns"].append(w1 - last["commit_tick_end"])
            publishes["tick"].extend(t.get("publishes", 0) for t in rt[:-1])
            publishes["step"].extend(x.get("publishes", 0) for x in rs)
            for t in rt:
                for ph in ("load_tick", "compute_tick", "commit_tick", "send", "delete_outbox"):
                    tick_phases[ph].append(t.get(ph, 0.0))
                tick_phases["total"].append(t["total"])
            for s in rs:
                for ph in ("claim", "fn", "finish", "wake", "nested_tick"):
                    step_phases[ph].append(s.get(ph, 0.0))
                step_phases["total"].append(s["total"])
        if not parts:
            return None
        # Phases the package no longer has (their wrapper was skipped) are left out.
        for phases in (tick_phases, step_phases):
            for name in [k for k, v in phases.items() if k != "total" and not any(v)]:
                del phases[name]
        runs_used = len(parts["client start() -> first tick begins"])
        # A segment seen in only some steps (eager in some, not others) counts as 0 elsewhere.
        per_run = {name: round(sum(v) / runs_used * 1000, 2) for name, v in parts.items()}
        return {
            "runs": runs_used,
            "eager_ticks_per_run": round(eager_ticks / runs_used, 2),
            "per_run_ms": per_run,
            "per_run_total_ms": round(sum(per_run.values()), 2),
            "off_critical_path_mean_ms": {
                name: round(statistics.fmean(v) * 1000, 2) for name, v in off_path.items()
            },
            "broker_publishes_per_call": {
                k: round(statistics.fmean(v), 2) for k, v in publishes.items() if v
            },
            "tick_phase_mean_ms": {
                k: round(statistics.fmean(v) * 1000, 3) for k, v in tick_phases.items()
            },
            "step_phase_mean_ms": {
                k: round(statistics.fmean(v) * 1000, 3) for k, v in step_phases.items()
            },
        }

    def throughput_phase_costs(self, since: float, until: float) -> dict[str, Any] | None:
        """Mean tick and step phases during the throughput phase (CPU contention included)."""
        if self.timers_dir is None:
            return None
        time.sleep(0.3)
        records = [
            r for r in self.read_timer_records(self.timers_dir) if since <= r["start"] <= until
        ]
        out: dict[str, Any] = {}
        for kind, phases in (
            ("tick", ("load_tick", "compute_tick", "commit_tick", "send", "delete_outbox")),
            ("step", ("claim", "fn", "finish", "wake", "nested_tick")),
        ):
            rs = [r for r in records if r["k"] == kind]
            if rs:
                figures = {
                    "count": len(rs),
                    "total": statistics.fmean(r["total"] for r in rs) * 1000,
                }
                for ph in phases:
                    if any(ph in r for r in rs):  # not a phase the package still has
                        figures[ph] = statistics.fmean(r.get(ph, 0.0) for r in rs) * 1000
                out[kind] = {k: round(v, 3) for k, v in figures.items()}
        # Only the coordinator's own ticks: eager ones run in the step workers, in parallel.
        coord_ticks = [r for r in records if r["k"] == "tick" and not r.get("eager")]
        if coord_ticks:
            span = max(r["end"] for r in coord_ticks) - min(r["start"] for r in coord_ticks)
            out["coordinator_busy_fraction"] = round(
                sum(r["total"] for r in coord_ticks) / max(span, 1e-9), 3
            )
        return out

    # -- profile --------------------------------------------------------------------------------

    def profile(self) -> None:
        """Restart the ductor workers under cProfile, run sequential runs, stop them."""
        log("profile: restarting the ductor workers with cProfile around ticks and steps")
        prof_dir = self.workdir / "profile"
        prof_dir.mkdir()
        self.use_mode(
            self.mode or "on", "-prof", {"BENCH_PROFILE_DIR": str(prof_dir)}, timers=False
        )
        for _ in range(self.args.warmup):
            self.ductor_run()
        for _ in range(self.args.runs):
            self.ductor_run()
        self.stop_workers(self.ductor_workers)
        self.ductor_workers = []
        report = profile_report(prof_dir, top=self.args.profile_top)
        self.results["profile"] = report
        if self.args.profile_out:
            out = Path(self.args.profile_out)
            out.mkdir(parents=True, exist_ok=True)
            for kind in ("tick", "step"):
                merged = merge_stats(prof_dir, kind)
                if merged is not None:
                    merged.dump_stats(str(out / f"{kind}.prof"))
            log(f"profile: merged pstats written to {out}/tick.prof and step.prof")

    # -- what one run asks of PostgreSQL --------------------------------------------------------

    def pg_statements(self) -> None:
        """One extra run with log_statement=all: every statement each process sends, per step."""
        with self.pg.connect() as conn:
            conn.execute("ALTER SYSTEM SET log_statement = 'all'")
            conn.execute("ALTER SYSTEM SET log_line_prefix = '%m [%p] '")
            conn.execute("SELECT pg_reload_conf()")
        time.sleep(0.3)
        offset = self.pg.log_path.stat().st_size
        try:
            _, run_id, _, _ = self.ductor_run()
            time.sleep(0.3)
        finally:
            with self.pg.connect() as conn:
                conn.execute("ALTER SYSTEM RESET log_statement")
                conn.execute("ALTER SYSTEM RESET log_line_prefix")
                conn.execute("SELECT pg_reload_conf()")
        with open(self.pg.log_path, "rb") as fh:
            fh.seek(offset)
            text = fh.read().decode("utf-8", "replace")
        by_backend: dict[str, list[str]] = defaultdict(list)
        for line in text.splitlines():
            m = re.match(r"\S+ \S+ \S+ \[(\d+)\] LOG:  (?:statement|execute [^:]*): (.*)", line)
            if m:
                by_backend[m.group(1)].append(re.sub(r"\s+", " ", m.group(2)).strip())

        def role(stmts: list[str]) -> str:
            joined = " ".join(stmts)
            if "claimed_at=now()" in joined.replace(" ", "") or "SET claimed_at" in joined:
                return "step worker"
            if "UPDATE eec_workflow_run" in joined:
                return "coordinator"
            if "INSERT INTO eec_workflow_run" in joined or "LISTEN" in joined:
                return "client"
            return "other (sweeper, ...)"

        roles: dict[str, list[str]] = defaultdict(list)
        for stmts in by_backend.values():
            roles[role(stmts)].extend(stmts)
        out: dict[str, Any] = {"run_id": run_id, "statements": {}}
        for name, stmts in sorted(roles.items()):
            shapes: dict[str, int] = defaultdict(int)
            for st in stmts:
                shapes[st[:90]] += 1
            out["statements"][name] = {
                "total": len(stmts),
                "per_step": round(len(stmts) / STEPS, 1),
                "shapes": dict(sorted(shapes.items(), key=lambda kv: -kv[1])),
            }
        self.results["pg_statements_one_run"] = out

    # -- the whole thing ------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.setup()
        if not self.args.scatter_only:
            for mode in self.args.eager_modes:
                self.use_mode(mode)
                self.ductor_mode_phases(mode)
            self.raw_phases()
        else:
            self.use_mode(self.args.eager_modes[-1])
        self.scatter_phases()
        self.batched_scatter()
        self.memory_phase()
        if self.args.pg_log:
            self.pg_statements()
        if self.args.profile:
            self.profile()
        return self.results


def cpu_name(kind: str, mode: str, coordinators: int = 1) -> str:
    """The CPU phase's name: one per figure, mode and coordinator count."""
    return f"{kind} eager {mode}" + (f" {coordinators} coords" if coordinators > 1 else "")


def scatter_sizes(args: argparse.Namespace) -> list[int]:
    return sorted({n for n in args.scatter_sizes if n > 0})


# --------------------------------------------------------------------------------------------
# phase plan and time budget
# --------------------------------------------------------------------------------------------

#: Seconds budgeted per unit of work, on 2 busy cores, about 1.5x what the package measured
#: before issue 10 (a sequential step ~35 ms, a concurrent step ~25-35 ms, a scatter item
#: ~17 ms): the default --time-limit is their sum, so a run that is much slower than that
#: stops instead of hanging.
BUDGET_SEQ_STEP_S = 0.06
BUDGET_CONCURRENT_STEP_S = 0.045
BUDGET_SCATTER_ITEM_S = 0.025
BUDGET_RAW_ITEM_S = 0.005


def phase_plan(args: argparse.Namespace) -> list[tuple[str, float]]:
    """(phase, budget in seconds), in order; printed at the start of a run."""
    seq = args.runs + args.warmup
    conc = args.concurrent_runs * STEPS
    plan: list[tuple[str, float]] = [("start PostgreSQL, Redis, the raw worker", 30.0)]
    if args.scatter_only:
        plan.append((f"start ductor workers, eager ticks {args.eager_modes[-1]}", 20.0))
    else:
        for mode in args.eager_modes:
            plan.append((f"eager ticks {mode}: (re)start the ductor workers", 20.0))
            plan.append(
                (
                    f"eager ticks {mode}: {seq} sequential 10-step runs ({args.warmup} warm-up)",
                    seq * STEPS * BUDGET_SEQ_STEP_S,
                )
            )
            plan.append(
                (
                    f"eager ticks {mode}: {args.concurrent_runs} concurrent runs, 1 coordinator",
                    conc * BUDGET_CONCURRENT_STEP_S + 15.0,
                )
            )
            if mode in args.two_coord_modes:
                plan.append(
                    (
                        f"eager ticks {mode}: {args.concurrent_runs} concurrent runs, "
                        "2 coordinators",
                        conc * BUDGET_CONCURRENT_STEP_S + 25.0,
                    )
                )
        plan.append((f"raw Celery: {seq} 10-task chains", seq * STEPS * 0.015 + 5.0))
        plan.append((f"raw Celery: {args.raw_tasks} tasks", args.raw_tasks * BUDGET_RAW_ITEM_S))
    for n in scatter_sizes(args):
        plan.append((f"scatter {n}: ductor", n * BUDGET_SCATTER_ITEM_S + 10.0))
        if not args.no_raw_group:
            plan.append((f"scatter {n}: raw Celery group", n * BUDGET_RAW_ITEM_S + 5.0))
    if args.batched_items > 0 and args.batch_size > 0:
        plan.append(
            (
                f"batched scatter {args.batched_items} (batch_size {args.batch_size})",
                args.batched_items * BUDGET_SCATTER_ITEM_S + 10.0,
            )
        )
    if args.memory_scatters > 0:
        n = max(scatter_sizes(args) or [10000])
        plan.append(
            (
                f"memory: {args.memory_scatters} scatters of {n} in a row",
                args.memory_scatters * (n * BUDGET_SCATTER_ITEM_S + 10.0),
            )
        )
    if args.pg_log:
        plan.append(("pg-log: one run with log_statement=all", 15.0))
    if args.profile:
        plan.append((f"profile: restart workers, {seq} runs", 20.0 + seq * STEPS * 0.1))
    plan.append(("stop workers and servers", 20.0))
    return plan


def default_time_limit(args: argparse.Namespace) -> float:
    return float(math.ceil(sum(budget for _, budget in phase_plan(args)) / 10.0) * 10)


def print_plan(args: argparse.Namespace) -> None:
    plan = phase_plan(args)
    mode = "default: the sum of the budgets" if args.time_limit_default else "--time-limit"
    log(f"{len(plan)} phases; time limit {args.time_limit:g}s ({mode}):")
    for name, budget in plan:
        log(f"    {name:<70} budget {budget:>6.0f}s")


# --------------------------------------------------------------------------------------------
# profile report
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------


def machine_info(bench: Bench | None) -> dict[str, Any]:
    import celery
    import kombu
    import psycopg
    import sqlalchemy

    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "celery": celery.__version__,
        "kombu": kombu.__version__,
        "sqlalchemy": sqlalchemy.__version__,
        "psycopg": psycopg.__version__,
    }
    if bench is not None:
        with contextlib.suppress(Exception), bench.pg.connect() as conn:
            row = conn.execute("SHOW server_version").fetchone()
            info["postgresql"] = row[0] if row else None
        with contextlib.suppress(Exception):
            client = bench.redis.client()
            info["redis"] = client.info("server")["redis_version"]
            client.close()
    return info


# --------------------------------------------------------------------------------------------
# the summary: every figure beside raw Celery's from the same run, as ratios against targets
# --------------------------------------------------------------------------------------------

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
}


def _row(
    figure: str,
    ductor: float | None,
    raw: float | None,
    *,
    ratio: float | None | bool = True,
    target: tuple[str, float, str] | None = None,
    on: str = "ratio",
) -> dict[str, Any]:
    """One line of the summary. ``ratio=True``: ductor / raw. The target applies to the ratio
    (``on="ratio"``) or to ductor's own figure (``on="ductor"``: growth, seconds, percent)."""
    if ratio is True:
        ratio = ductor / raw if ductor is not None and raw else None
    elif ratio is False:
        ratio = None
    met, target_text = None, ""
    if target is not None:
        op, bound, unit = target
        target_text = f"{op} {bound:g}{unit}"
        value = ratio if on == "ratio" else ductor
        met = None if value is None else _OPS[op](value, bound)
    return {
        "figure": figure,
        "ductor": ductor,
        "raw": raw,
        "ratio": None if ratio is None else round(ratio, 3),
        "target": target_text,
        "met": met,
    }


def _get(d: dict[str, Any] | None, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def summarize(res: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    cpus = res.get("cpu", {})
    raw_p50 = _get(res, "raw_chain_latency", "p50_ms")
    raw_p90 = _get(res, "raw_chain_latency", "p90_ms")
    raw_tps = _get(res, "raw_throughput", "tasks_per_s")
    raw_cpu = _get(cpus, "raw_throughput", "cpu_ms_per_unit")
    raw_chain_cpu = _get(cpus, "raw_chain_latency", "cpu_ms_per_unit")
    for mode, m in res.get("modes", {}).items():
        rows.append(
            _row(
                f"10-step run p50 ms, eager {mode}",
                _get(m, "latency", "p50_ms"),
                raw_p50,
                target=("<=", TARGET_LATENCY_RATIO, "x"),
            )
        )
        rows.append(
            _row(f"10-step run p90 ms, eager {mode}", _get(m, "latency", "p90_ms"), raw_p90)
        )
        rows.append(
            _row(
                f"no-op tick (duplicate wake-up) ms, eager {mode}",
                _get(m, "noop_tick", "wall_ms_per_tick"),
                None,
                ratio=False,
                target=("<", TARGET_NOOP_TICK_MS, " ms"),
                on="ductor",
            )
        )
        rows.append(
            _row(
                f"CPU ms/step, sequential runs, eager {mode}",
                _get(cpus, cpu_name("ductor_latency", mode), "cpu_ms_per_unit"),
                raw_chain_cpu,
                target=("<=", TARGET_CPU_RATIO, "x"),
            )
        )
        for key, n in (("one_coordinator", 1), ("two_coordinators", 2)):
            phase = m.get(key)
            if not phase:
                continue
            tag = f"eager {mode}, {n} coord{'s' if n > 1 else ''}"
            rows.append(
                _row(
                    f"steps/s vs tasks/s, {tag}",
                    _get(phase, "throughput", "steps_per_s"),
                    raw_tps,
                    target=(">=", TARGET_THROUGHPUT_RATIO, "x"),
                )
            )
            rows.append(
                _row(
                    f"CPU ms/step vs ms/task, {tag}",
                    _get(cpus, cpu_name("ductor_throughput", mode, n), "cpu_ms_per_unit"),
                    raw_cpu,
                    target=("<=", TARGET_CPU_RATIO, "x"),
                )
            )
            rows.append(
                _row(
                    f"tick recomputes, % of ticks, {tag}",
                    _get(phase, "tick_stats", "recompute_pct"),
                    None,
                    ratio=False,
                    target=("<", TARGET_RECOMPUTE_PCT, "%") if n > 1 else None,
                    on="ductor",
                )
            )
    sc = res.get("scatter") or {}
    raw_by_n = {g["items"]: g for g in sc.get("raw_group", [])}
    for d in sc.get("ductor", []):
        rows.append(
            _row(
                f"scatter {d['items']:,} items, wall s (eager {sc['eager_ticks']})",
                d["wall_s"],
                _get(raw_by_n.get(d["items"]), "wall_s"),
                target=("<=", TARGET_SCATTER_RATIO, "x"),
            )
        )
    ds = sc.get("ductor", [])
    if len(ds) >= 2:
        small, big = ds[0], ds[-1]
        scale = big["items"] / small["items"]
        raw_small = _get(raw_by_n.get(small["items"]), "wall_s")
        raw_big = _get(raw_by_n.get(big["items"]), "wall_s")
        rows.append(
            _row(
                f"scatter growth {small['items']:,} -> {big['items']:,} items (x)",
                big["wall_s"] / small["wall_s"],
                raw_big / raw_small if raw_small and raw_big else None,
                ratio=False,
                # 10x the items in at most 11x the time: linear plus 10%.
                target=("<=", round(scale * TARGET_GROWTH_SLACK, 2), "x"),
                on="ductor",
            )
        )
    b = res.get("batched_scatter")
    if b and b.get("available"):
        rows.append(
            _row(
                f"batched scatter {b['items']:,} items (batch {b['batch_size']}), wall s",
                b["wall_s"],
                _get(raw_by_n.get(b["items"]), "wall_s"),
                # The target is for 10,000 items; smaller test sizes get no verdict.
                target=("<", TARGET_BATCHED_S, " s") if b["items"] >= 10000 else None,
                on="ductor",
            )
        )
    return rows


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"


def print_summary(res: dict[str, Any]) -> None:
    rows = res["summary"]
    width = 50
    lines = [
        "",
        f"{'figure (raw Celery from the same run)':<{width}}{'ductor':>10}{'raw':>10}"
        f"{'ratio':>9}{'target':>10}{'':>8}",
        "-" * (width + 47),
    ]
    for r in rows:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        verdict = {True: "MET", False: "MISSED", None: ""}[r["met"]]
        if r["target"] and r["met"] is None:
            verdict = "n/a"
        lines.append(
            f"{r['figure']:<{width}}{_num(r['ductor']):>10}{_num(r['raw']):>10}"
            f"{ratio:>9}{r['target']:>10}{verdict:>8}"
        )
    lines.append("-" * (width + 47))
    judged = [r for r in rows if r["met"] is not None]
    lines.append(
        f"targets met: {sum(1 for r in judged if r['met'])} of {len(judged)}; ratio = ductor / "
        "raw; growth, seconds and % are ductor's own figure"
    )
    rl, rt = res.get("raw_chain_latency"), res.get("raw_throughput")
    for mode, m in res.get("modes", {}).items():
        one = _get(m, "one_coordinator", "throughput") or {}
        lines.append(
            f"eager {mode}: {_get(m, 'latency', 'n')} sequential runs; {one.get('runs')} "
            f"concurrent 10-step runs in {one.get('wall_s')} s (1 coordinator)"
            + (
                f", {_get(m, 'two_coordinators', 'throughput', 'wall_s')} s (2 coordinators)"
                if m.get("two_coordinators")
                else ""
            )
        )
    if rl and rt:
        lines.append(
            f"raw Celery: {rl['n']} chains one at a time; {rt['tasks']} plain tasks in "
            f"{rt['wall_s']:.2f} s; CPU per task/step: all benchmark processes (/proc)"
        )
    b = res.get("batched_scatter")
    if b and not b.get("available"):
        lines.append(f"batched scatter: not available ({b.get('why')})")
    if res["settings"].get("experiment"):
        lines.append(
            f"WHAT-IF RUN, not the default figures: --experiment "
            f"{' '.join(res['settings']['experiment'])}"
        )
    print("\n".join(lines))


def print_ticks(res: dict[str, Any]) -> None:
    entries: list[tuple[str, dict[str, Any]]] = []
    for mode, m in res.get("modes", {}).items():
        for key, n in (("one_coordinator", 1), ("two_coordinators", 2)):
            ts = _get(m, key, "tick_stats")
            if ts:
                entries.append((f"throughput, eager {mode}, {n} coordinator(s)", ts))
    sc = res.get("scatter") or {}
    for d in sc.get("ductor", []):
        if d.get("tick_stats"):
            entries.append((f"scatter {d['items']:,}, eager {sc['eager_ticks']}", d["tick_stats"]))
    b = res.get("batched_scatter") or {}
    if b.get("tick_stats"):
        entries.append(
            (f"batched scatter {b['items']:,}, eager {b['eager_ticks']}", b["tick_stats"])
        )
    if not entries:
        return
    print(
        f"\n{'ticks (every worker process, timer lines)':<44}{'ticks':>8}{'coord':>8}"
        f"{'eager':>8}{'busy eager':>12}{'recomputes':>12}{'recompute %':>13}"
    )
    for name, ts in entries:
        pct_text = "-" if ts["recompute_pct"] is None else f"{ts['recompute_pct']:.2f}"
        print(
            f"  {name:<42}{ts['ticks']:>8}{ts['coordinator_ticks']:>8}{ts['eager_ticks']:>8}"
            f"{ts['busy_eager_ticks']:>12}{ts['recomputes']:>12}{pct_text:>13}"
        )
        print(f"  {'':<42}outcomes: {ts['outcomes']}")
    eager_on = [ts for name, ts in entries if "eager on" in name or "eager inline" in name]
    if eager_on and not any(ts["eager_ticks"] for ts in eager_on):
        print(
            "  NOTE: eager ticks were on, yet no tick ran in a step worker: the step-worker "
            "hook is not in the package yet (or calls an uninstrumented run_tick)"
        )
    print(
        f"  recompute % = recomputes / ticks that computed (not busy); target under "
        f"{TARGET_RECOMPUTE_PCT:g}% with two coordinators"
    )


def print_memory(res: dict[str, Any]) -> None:
    mem = res.get("memory")
    if not mem:
        return
    print(
        f"\nmemory: VmRSS (MB) of every process of each ductor worker, before -> after "
        f"{mem['scatters']} scatters of {mem['items']:,} items in a row "
        f"(eager {mem['eager_ticks']})"
    )
    for name, before in mem["rss_before_kb"].items():
        after = mem["rss_after_kb"].get(name, {})

        def mb(d: dict[str, int], key: str) -> str:
            return f"{d.get(key, 0) / 1024:7.1f}"

        growth = (after.get("total_kb", 0) / before["total_kb"] - 1) if before["total_kb"] else 0
        print(
            f"  {name:<20} main {mb(before, 'main_kb')} -> {mb(after, 'main_kb')}"
            f"   pool ({before['children']}) {mb(before, 'children_kb')} -> "
            f"{mb(after, 'children_kb')}   total {mb(before, 'total_kb')} -> "
            f"{mb(after, 'total_kb')} ({growth:+.1%})"
        )
    print(f"  wall per scatter (s): {', '.join(f'{w:.1f}' for w in mem['wall_s'])}")


def print_breakdowns(res: dict[str, Any]) -> None:
    for mode, m in res.get("modes", {}).items():
        bd = m.get("latency_breakdown")
        if bd:
            print(
                f"\nwhere a sequential 10-step run's time goes, eager ticks {mode} (mean of "
                f"{bd['runs']} runs, ms; {bd['eager_ticks_per_run']} eager ticks per run):"
            )
            for name, ms in bd["per_run_ms"].items():
                print(f"    {name:<52}{ms:>9.2f}")
            print(f"    {'sum':<52}{bd['per_run_total_ms']:>9.2f}")
            print(
                "  not on the critical path (mean ms per call): "
                + ", ".join(f"{k} {v:.2f}" for k, v in bd["off_critical_path_mean_ms"].items())
            )
            print(
                "  broker publishes per call (task messages + task-sent events): "
                + ", ".join(f"{k} {v:g}" for k, v in bd["broker_publishes_per_call"].items())
            )
            print(
                "  tick phases (mean ms): "
                + ", ".join(f"{k} {v:.2f}" for k, v in bd["tick_phase_mean_ms"].items())
            )
            print(
                "  step phases (mean ms): "
                + ", ".join(f"{k} {v:.2f}" for k, v in bd["step_phase_mean_ms"].items())
            )
        for key, n in (("one_coordinator", 1), ("two_coordinators", 2)):
            phase = m.get(key) or {}
            tp = phase.get("phase_mean_ms")
            if tp:
                for kind in ("tick", "step"):
                    if kind in tp:
                        print(
                            f"  under load (eager {mode}, {n} coord), {kind} (mean ms): "
                            + ", ".join(f"{k} {v:g}" for k, v in tp[kind].items())
                        )
                if "coordinator_busy_fraction" in tp:
                    print(
                        f"  under load (eager {mode}, {n} coord): the coordinator process(es) "
                        f"spent {tp['coordinator_busy_fraction']:.0%} of the phase inside ticks "
                        "(summed over processes)"
                    )
            th = phase.get("throughput")
            if th:
                print(
                    f"  coordinator queue when the last run finished (eager {mode}, {n} coord): "
                    f"{th['coordinator_queue_at_finish']} wake-ups, drained in {th['drain_s']} s"
                )


def print_scatter_details(res: dict[str, Any]) -> None:
    sc = res.get("scatter") or {}
    ds = list(sc.get("ductor", []))
    if (res.get("batched_scatter") or {}).get("available"):
        ds.append(res["batched_scatter"])
    if not ds:
        return
    print("\nscatter runs:")
    for d in ds:
        print(
            f"  {d['workflow']:<22}{d['items']:>7,} items  {d['wall_s']:>8.2f} s  "
            f"{d['items_per_s']:>7.1f} items/s  coordinator CPU "
            f"{d['coordinator_cpu_ms_per_item']:.2f} ms/item  {d['ticks_committed']} ticks "
            f"committed  run-row state peak "
            f"{d['run_row_state_bytes_peak']} bytes"
        )
    for g in sc.get("raw_group", []):
        wall = "no results in time" if g["wall_s"] is None else f"{g['wall_s']:>8.2f} s"
        print(f"  {'raw Celery group':<22}{g['items']:>7,} items  {wall}")


def print_table(res: dict[str, Any]) -> None:
    print_summary(res)
    print_ticks(res)
    print_memory(res)
    print_scatter_details(res)
    print_breakdowns(res)
    cpus = res.get("cpu")
    if cpus:
        print("\nCPU time of all processes per unit of work (ms; from /proc, 10 ms ticks):")
        for name, c in cpus.items():
            parts = ", ".join(
                f"{k} {v:g}" for k, v in c["by_process_ms_per_unit"].items() if v >= 0.05
            )
            print(
                f"  {name:<30} {c['cpu_ms_per_unit']:>6.2f} ms/{c['unit']} "
                f"({c['cores_busy']:.2f} cores busy): {parts}"
            )
        worst = max(c.get("background_cores", 0.0) for c in cpus.values())
        if worst > 0.15:
            print(
                f"  WARNING: up to {worst:.2f} cores were used by processes outside the "
                "benchmark ('other', not counted per unit): rerun on a quiet machine"
            )
    pgs = res.get("pg_statements_one_run")
    if pgs:
        print("\nPostgreSQL statements of one 10-step run (log_statement=all):")
        for name, rep in pgs["statements"].items():
            print(f"  {name}: {rep['total']} statements ({rep['per_step']} per step)")
            for shape, count in list(rep["shapes"].items())[:20]:
                print(f"    {count:>4}  {shape}")
    prof = res.get("profile")
    if prof:
        for kind, rep in prof.items():
            print(
                f"\ncProfile, {kind}: {rep['calls']} calls, "
                f"{rep['wall_per_call_ms_profiled']:.2f} ms/call under the profiler"
            )
            print(
                "  self time by layer (ms per call): "
                + ", ".join(
                    f"{k} {v:.2f}" for k, v in list(rep["by_layer_self_ms_per_call"].items())[:8]
                )
            )
            print("  top cumulative (ms per call):")
            for row in rep["top_cumulative"]:
                print(
                    f"    {row['cum_ms_per_call']:>8.3f}  x{row['ncalls_per_call']:<6g} "
                    f"{row['func']}"
                )
            print("  top self (ms per call):")
            for row in rep["top_self"]:
                print(
                    f"    {row['self_ms_per_call']:>8.3f}  x{row['ncalls_per_call']:<6g} "
                    f"{row['func']}"
                )


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def signals_as_exceptions(time_limit: float) -> Iterator[None]:
    """SIGTERM/SIGHUP behave like Ctrl-C; the time limit raises BenchTimeout. Both unwind the
    ExitStack, which stops every worker and server."""

    def interrupted(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    def timed_out(_signum: int, _frame: Any) -> None:
        raise BenchTimeout(f"benchmark exceeded --time-limit={time_limit:g}s")

    old: dict[int, Callable[..., Any] | int | None] = {}
    for sig, handler in (
        (signal.SIGTERM, interrupted),
        (signal.SIGHUP, interrupted),
        (signal.SIGALRM, timed_out),
    ):
        old[sig] = signal.signal(sig, handler)
    signal.setitimer(signal.ITIMER_REAL, time_limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in old.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=30, help="sequential runs per latency figure")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured runs before each")
    p.add_argument("--concurrent-runs", type=int, default=200, help="ductor throughput runs")
    p.add_argument("--raw-tasks", type=int, default=2000, help="raw throughput tasks")
    p.add_argument(
        "--eager-modes",
        nargs="+",
        choices=["off", "on", "inline"],
        default=["off", "on", "inline"],
        help="off: ductor_eager_ticks off; on: eager ticks, ductor_inline_steps=0; inline: both\n"
        "on (the package default). Measured in order (the ductor workers restart between\n"
        "modes; the scatter phases run in the last)",
    )
    p.add_argument(
        "--two-coord-modes",
        nargs="*",
        choices=["off", "on", "inline"],
        default=["off", "inline"],
        help="modes whose throughput phase also runs with a second coordinator process\n"
        "(none given: never)",
    )
    p.add_argument(
        "--scatter-sizes",
        type=int,
        nargs="+",
        default=[1000, 10000],
        help="inline scatter sizes, each vs a raw Celery group of as many tasks (0 skips)",
    )
    p.add_argument("--no-raw-group", action="store_true", help="skip the raw Celery groups")
    p.add_argument("--scatter-timeout", type=float, default=300.0, help="per scatter, seconds")
    p.add_argument(
        "--batched-items",
        type=int,
        default=10000,
        help="items of the batched scatter (0 skips; needs Workflow.scatter(batch_size=))",
    )
    p.add_argument("--batch-size", type=int, default=100, help="its batch_size (0 skips)")
    p.add_argument(
        "--memory-scatters",
        type=int,
        default=0,
        help="N scatters of the largest size in a row; ductor workers' RSS before/after",
    )
    p.add_argument(
        "--scatter-only",
        action="store_true",
        help="only the scatter, batched scatter and memory phases (benchmarks/scatter.py)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="afterwards, rerun the ductor latency workload with cProfile in workers",
    )
    p.add_argument("--profile-top", type=int, default=15, help="rows per profile table")
    p.add_argument("--profile-out", help="directory for the merged tick.prof / step.prof")
    p.add_argument(
        "--pg-log",
        action="store_true",
        help="one extra run with log_statement=all: count statements per step",
    )
    p.add_argument(
        "--no-timers",
        action="store_true",
        help="no phase timers in the ductor workers (no breakdown, no tick counts)",
    )
    p.add_argument(
        "--experiment",
        action="append",
        default=[],
        choices=["no-events", "no-pre-ping", "no-prepare", "no-sweeper", "coord-solo", "coord-c2"],
        help="what-if, for the report (repeatable): no-events = Celery task events\n"
        "off in the ductor app (ductor turns them on); no-pre-ping = ductor's\n"
        "engine without pool_pre_ping; no-prepare = psycopg\n"
        "prepare_threshold=None;\n"
        "no-sweeper = ductor_sweep_interval=3600 (no re-sent wake-ups);\n"
        "coord-solo / coord-c2 = coordinator with -P solo / -c 2",
    )
    p.add_argument(
        "--output",
        default=str(BENCH_DIR / "results.json"),
        help="where to write the JSON results ('-' for none)",
    )
    p.add_argument("--keep", action="store_true", help="keep the work dir (logs, timers)")
    p.add_argument("--phase-timeout", type=float, default=180.0, help="per phase, seconds")
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="stop everything and fail after this many seconds (default: the sum of the\n"
        "phase budgets printed at the start, ~18 min with the default sizes)",
    )
    args = p.parse_args(argv)
    args.time_limit_default = args.time_limit is None
    if args.time_limit is None:
        args.time_limit = default_time_limit(args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    print_plan(args)
    bench: Bench | None = None
    with signals_as_exceptions(args.time_limit), contextlib.ExitStack() as stack:
        try:
            bench = Bench(args, stack)
            res = bench.run()
            res = {
                "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
                "git": git_describe(),
                "machine": machine_info(bench),
                "settings": {
                    k: v
                    for k, v in vars(args).items()
                    if k not in ("output", "keep", "profile_out")
                },
                **res,
            }
            res["summary"] = summarize(res)
            res["elapsed_s"] = round(time.monotonic() - started, 1)
            print_table(res)
            if args.output != "-":
                Path(args.output).write_text(json.dumps(res, indent=2) + "\n")
                log(f"results written to {args.output}")
        except BaseException as exc:
            if bench is not None:
                for w in bench.workers:
                    if w.proc.poll() is not None:
                        print(f"--- worker {w.name} exited early; log tail:\n{w.log_tail()}")
            if isinstance(exc, KeyboardInterrupt):
                log("interrupted: stopping workers and servers")
                return 130
            raise
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)  # never cut the clean-up short
            log("stopping workers and servers")
    log(f"done in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
