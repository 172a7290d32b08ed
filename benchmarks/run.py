"""ductor vs raw Celery: latency of a 10-step chain and throughput, on private local servers.

Usage (from the repo root)::

    .venv/bin/python benchmarks/run.py             # the figures, ~2.5 minutes on 2 cores
    .venv/bin/python benchmarks/run.py --profile --pg-log   # plus cProfile, SQL per step

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
import time
from collections import defaultdict
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
TARGET_LATENCY_RATIO = 2.0
TARGET_THROUGHPUT_RATIO = 0.5


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


class Bench:
    def __init__(self, args: argparse.Namespace, stack: contextlib.ExitStack) -> None:
        self.args = args
        self.stack = stack
        self.workers: list[Worker] = []
        self.results: dict[str, Any] = {}

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
            "PYTHONPATH": os.pathsep.join(
                [str(BENCH_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
        if self.args.experiment:
            # Worker-command experiments are handled here; the rest by bench_app.
            self.env["BENCH_EXPERIMENTS"] = ",".join(
                e for e in self.args.experiment if not e.startswith("coord-")
            )
        for key in (
            "BENCH_TIMERS_DIR",
            "BENCH_PROFILE_DIR",
            *(() if self.args.experiment else ("BENCH_EXPERIMENTS",)),
        ):
            self.env.pop(key, None)
        os.environ.update(
            {k: v for k, v in self.env.items() if k.startswith(("BENCH_", "DUCTOR_"))}
        )

        import bench_app  # configured from the environment just set

        self.app = bench_app
        self.timers_dir: Path | None = None
        if not self.args.no_timers:
            self.timers_dir = self.workdir / "timers"
            self.timers_dir.mkdir()

        t0 = time.monotonic()
        timer_env = {"BENCH_TIMERS_DIR": str(self.timers_dir)} if self.timers_dir else {}
        self.steps_w, self.coord_w = self.start_ductor_workers("", timer_env)
        raw_w = self.start_worker(
            "raw", "bench_app:raw", ["-Q", bench_app.RAW_QUEUE, "-c", "2"], {}
        )
        for w in (self.steps_w, self.coord_w, raw_w):
            w.wait_ready()
        log(f"workers ready in {time.monotonic() - t0:.1f}s:")
        for w in (self.steps_w, self.coord_w, raw_w):
            log(f"    {w.command}")
        self.results["workers"] = {
            "ductor_steps": self.steps_w.command,
            "ductor_coordinator": self.coord_w.command,
            "raw": raw_w.command,
        }

    def start_worker(self, name: str, app: str, args: list[str], env: dict[str, str]) -> Worker:
        if not self.workers:
            self.stack.callback(self.stop_all_workers)
        worker = Worker(name, app, args, {**self.env, **env}, self.workdir)
        self.workers.append(worker)
        return worker

    def stop_worker(self, worker: Worker) -> None:
        if worker in self.workers:
            self.workers.remove(worker)
            worker.stop()

    def stop_all_workers(self) -> None:
        """Warm-stop every worker at once (each waits for its task in hand), then reap."""
        t0 = time.monotonic()
        workers, self.workers = list(self.workers), []
        for w in workers:
            w.terminate()
        for w in workers:
            w.stop()
        if workers:
            log(f"stopped {len(workers)} workers in {time.monotonic() - t0:.1f}s")

    def start_ductor_workers(self, suffix: str, env: dict[str, str]) -> tuple[Worker, Worker]:
        steps = self.start_worker(
            f"steps{suffix}", "bench_app", ["-Q", self.app.STEPS_QUEUE, "-c", "2"], env
        )
        coord_pool = ["-c", "1"]
        if "coord-solo" in self.args.experiment:
            coord_pool = ["-P", "solo"]
        elif "coord-c2" in self.args.experiment:
            coord_pool = ["-c", "2"]
        coord = self.start_worker(
            f"coord{suffix}", "bench_app", ["-Q", self.app.COORD_QUEUE, *coord_pool], env
        )
        return steps, coord

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
        self.results.setdefault("cpu", {})[name] = {
            "background_cores": round(background, 2),
            "steal_cores": round(steal, 2),
            "unit": unit,
            "units": units,
            "wall_s": round(wall, 3),
            "cpu_s": round(total, 2),
            "cores_busy": round(total / wall, 2),
            "cpu_ms_per_unit": round(total / units * 1000, 2),
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

    def ductor_latency(self) -> None:
        for _ in range(self.args.warmup):
            self.ductor_run()
        samples, runs = [], []
        for _ in range(self.args.runs):
            elapsed, run_id, w0, w1 = self.ductor_run()
            samples.append(elapsed)
            runs.append((run_id, w0, w1))
        self.results["ductor_latency"] = summary_ms(samples)
        self.latency_runs = runs
        log(f"ductor 10-step latency: {self.results['ductor_latency']}")

    def ductor_throughput(self) -> None:
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
        self.results["ductor_throughput"] = {
            "runs": n,
            "steps": n * STEPS,
            "wall_s": round(wall, 3),
            "start_phase_s": round(t_started - t0, 3),
            "steps_per_s": round(n * STEPS / wall, 1),
            "runs_per_s": round(n / wall, 2),
            "run_duration_p50_ms": round(run_p50 * 1000, 1),
            "run_duration_max_ms": round(run_max * 1000, 1),
        }
        log(f"ductor throughput: {self.results['ductor_throughput']}")
        self.throughput_finished = time.time()

    def drain_coordinator(self, finished_at: float) -> None:
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
        self.results["ductor_throughput"].update(
            coordinator_queue_at_finish=queued,
            drain_s=round(drain, 2),
            coordinator_queue_after_drain=left,
            ticks_after_finish=after,
        )
        log(
            f"coordinator queue when the last run finished: {queued} wake-ups; drained in "
            f"{drain:.1f}s; ticks after the finish: {after}"
        )

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

    def raw_latency(self) -> None:
        for _ in range(self.args.warmup):
            self.raw_chain_once()
        samples = [self.raw_chain_once() for _ in range(self.args.runs)]
        self.results["raw_chain_latency"] = summary_ms(samples)
        log(f"raw chain latency: {self.results['raw_chain_latency']}")

    def raw_throughput(self) -> None:
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
        self.results["raw_throughput"] = {
            "tasks": n,
            "wall_s": round(wall, 3),
            "send_phase_s": round(t_sent - t0, 3),
            "tasks_per_s": round(n / wall, 1),
        }
        log(f"raw throughput: {self.results['raw_throughput']}")

    # -- where a run's time goes (phase timers) -----------------------------------------------

    def read_timer_records(self, directory: Path) -> list[dict[str, Any]]:
        records = []
        for path in directory.glob("*.jsonl"):
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    records.append(json.loads(line))
        return records

    def latency_breakdown(self) -> None:
        """Critical path of the sequential runs, from the workers' phase timers (wall clock)."""
        if self.timers_dir is None:
            return
        try:
            self._latency_breakdown(self.timers_dir)
        except (KeyError, ValueError, statistics.StatisticsError) as exc:
            log(f"no latency breakdown (timer records incomplete: {exc!r})")

    def _latency_breakdown(self, timers_dir: Path) -> None:
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
        for run_id, w0, w1 in self.latency_runs:
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
                s_pub = step.get("first_publish_end", step["wake_end"])
                parts["tick: load + compute + commit + publish step"].append(t_pub - tick["start"])
                parts["hop: step message -> step task body starts"].append(step["start"] - t_pub)
                parts["step: claim + fn + finish + publish wake-up"].append(s_pub - step["start"])
                parts["hop: wake-up message -> next tick begins"].append(nxt["start"] - s_pub)
                off_path["tick after its publish (sent event, outbox delete)"].append(
                    tick["end"] - t_pub
                )
                off_path["step after its publish (sent event)"].append(step["end"] - s_pub)
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
                for ph in ("claim", "fn", "finish", "wake"):
                    step_phases[ph].append(s.get(ph, 0.0))
                step_phases["total"].append(s["total"])
        if not parts:
            return
        runs_used = len(parts["client start() -> first tick begins"])
        per_run = {name: round(sum(v) / runs_used * 1000, 2) for name, v in parts.items()}
        self.results["ductor_latency_breakdown"] = {
            "runs": runs_used,
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

    def throughput_phase_costs(self, since: float, until: float) -> None:
        """Mean tick and step phases during the throughput phase (CPU contention included)."""
        if self.timers_dir is None:
            return
        time.sleep(0.3)
        records = [
            r for r in self.read_timer_records(self.timers_dir) if since <= r["start"] <= until
        ]
        out: dict[str, dict[str, float]] = {}
        for kind, phases in (
            ("tick", ("load_tick", "compute_tick", "commit_tick", "send", "delete_outbox")),
            ("step", ("claim", "fn", "finish", "wake")),
        ):
            rs = [r for r in records if r["k"] == kind]
            if rs:
                out[kind] = {
                    "count": len(rs),
                    "total": statistics.fmean(r["total"] for r in rs) * 1000,
                }
                for ph in phases:
                    out[kind][ph] = statistics.fmean(r.get(ph, 0.0) for r in rs) * 1000
                out[kind] = {k: round(v, 3) for k, v in out[kind].items()}
        ticks = [r for r in records if r["k"] == "tick"]
        if ticks:
            span = max(r["end"] for r in ticks) - min(r["start"] for r in ticks)
            out["coordinator_busy_fraction"] = round(sum(r["total"] for r in ticks) / span, 3)
        results = [r.get("result") for r in records if r["k"] == "tick"]
        out["tick_results"] = {k: results.count(k) for k in set(results)}  # type: ignore[dict-item]
        self.results["ductor_throughput_phase_mean_ms"] = out

    # -- profile --------------------------------------------------------------------------------

    def profile(self) -> None:
        """Restart the ductor workers under cProfile, run sequential and concurrent runs."""
        log("profile: restarting the ductor workers with cProfile around ticks and steps")
        self.stop_worker(self.steps_w)
        self.stop_worker(self.coord_w)
        prof_dir = self.workdir / "profile"
        prof_dir.mkdir()
        steps_w, coord_w = self.start_ductor_workers("-prof", {"BENCH_PROFILE_DIR": str(prof_dir)})
        steps_w.wait_ready()
        coord_w.wait_ready()
        for _ in range(self.args.warmup):
            self.ductor_run()
        for _ in range(self.args.runs):
            self.ductor_run()
        self.stop_worker(steps_w)
        self.stop_worker(coord_w)
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
        steps = (self.args.runs + self.args.warmup) * STEPS
        with self.cpu_phase("ductor_latency", steps, "step"):
            self.ductor_latency()
        self.latency_breakdown()
        with self.cpu_phase("raw_chain_latency", steps, "task"):
            self.raw_latency()
        since = time.time()
        with self.cpu_phase("ductor_throughput", self.args.concurrent_runs * STEPS, "step"):
            self.ductor_throughput()
        self.drain_coordinator(self.throughput_finished)
        self.throughput_phase_costs(since, self.throughput_finished)
        with self.cpu_phase("raw_throughput", self.args.raw_tasks, "task"):
            self.raw_throughput()
        if self.args.pg_log:
            self.pg_statements()
        if self.args.profile:
            self.profile()
        return self.results


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


def print_table(res: dict[str, Any]) -> None:
    dl, rl = res["ductor_latency"], res["raw_chain_latency"]
    dt, rt = res["ductor_throughput"], res["raw_throughput"]
    ratios = res["ratios"]
    lines = [
        "",
        f"{'figure':<46}{'ductor':>12}{'raw Celery':>14}{'ratio':>9}{'target':>9}",
        "-" * 90,
        f"{'10-step sequential run, p50 latency (ms)':<46}{dl['p50_ms']:>12.1f}"
        f"{rl['p50_ms']:>14.1f}{ratios['latency_p50']:>8.2f}x{'<= 2x':>9}",
        f"{'10-step sequential run, p90 latency (ms)':<46}{dl['p90_ms']:>12.1f}"
        f"{rl['p90_ms']:>14.1f}{ratios['latency_p90']:>8.2f}x",
        f"{'per step at p50 (ms)':<46}{dl['p50_ms'] / STEPS:>12.2f}{rl['p50_ms'] / STEPS:>14.2f}",
        f"{'throughput (steps/s vs tasks/s)':<46}{dt['steps_per_s']:>12.1f}"
        f"{rt['tasks_per_s']:>14.1f}{ratios['throughput']:>8.2f}x{'>= 0.5':>9}",
        "-" * 90,
        f"latency: {dl['n']} runs each, one at a time; throughput: {dt['runs']} concurrent "
        f"10-step runs ({dt['steps']} steps, {dt['wall_s']:.2f}s) vs {rt['tasks']} plain tasks "
        f"({rt['wall_s']:.2f}s)",
        f"targets: latency {'MET' if ratios['latency_p50'] <= TARGET_LATENCY_RATIO else 'MISSED'}"
        f", throughput {'MET' if ratios['throughput'] >= TARGET_THROUGHPUT_RATIO else 'MISSED'}",
    ]
    if res["settings"].get("experiment"):
        lines.append(
            f"WHAT-IF RUN, not the default figures: --experiment "
            f"{' '.join(res['settings']['experiment'])}"
        )
    print("\n".join(lines))
    bd = res.get("ductor_latency_breakdown")
    if bd:
        print(f"\nwhere a sequential 10-step run's time goes (mean of {bd['runs']} runs, ms):")
        for name, ms in bd["per_run_ms"].items():
            print(f"    {name:<46}{ms:>9.2f}")
        print(f"    {'sum':<46}{bd['per_run_total_ms']:>9.2f}")
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
    tp = res.get("ductor_throughput_phase_mean_ms")
    if tp:
        for kind in ("tick", "step"):
            if kind in tp:
                print(
                    f"  under load, {kind} (mean ms): "
                    + ", ".join(f"{k} {v:g}" for k, v in tp[kind].items())
                )
        print(
            f"  under load, tick results: {tp.get('tick_results')}; the coordinator process "
            f"spent {tp.get('coordinator_busy_fraction', 0):.0%} of the phase inside ticks"
        )
    cpus = res.get("cpu")
    if cpus:
        print("\nCPU time of all processes per unit of work (ms; from /proc, 10 ms ticks):")
        for name, c in cpus.items():
            parts = ", ".join(
                f"{k} {v:g}" for k, v in c["by_process_ms_per_unit"].items() if v >= 0.05
            )
            print(
                f"  {name:<18} {c['cpu_ms_per_unit']:>6.2f} ms/{c['unit']} "
                f"({c['cores_busy']:.2f} cores busy): {parts}"
            )
        worst = max(c.get("background_cores", 0.0) for c in cpus.values())
        if worst > 0.15:
            print(
                f"  WARNING: up to {worst:.2f} cores were used by processes outside the "
                "benchmark ('other'): rerun on a quiet machine"
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
        help="no phase timers in the ductor workers (and no breakdown)",
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
        default=290.0,
        help="stop everything and fail after this many seconds",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
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
            dl, rl = res["ductor_latency"], res["raw_chain_latency"]
            dt, rt = res["ductor_throughput"], res["raw_throughput"]
            res["ratios"] = {
                "latency_p50": round(dl["p50_ms"] / rl["p50_ms"], 2),
                "latency_p90": round(dl["p90_ms"] / rl["p90_ms"], 2),
                "throughput": round(dt["steps_per_s"] / rt["tasks_per_s"], 3),
                "latency_target": f"<= {TARGET_LATENCY_RATIO}",
                "throughput_target": f">= {TARGET_THROUGHPUT_RATIO}",
                "latency_met": dl["p50_ms"] / rl["p50_ms"] <= TARGET_LATENCY_RATIO,
                "throughput_met": dt["steps_per_s"] / rt["tasks_per_s"] >= TARGET_THROUGHPUT_RATIO,
            }
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
