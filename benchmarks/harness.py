"""The driver's machinery: private servers, the worker processes, CPU accounting per phase.

``Bench`` holds everything a phase needs (the parsed arguments, the servers, the benchmark
app, the workers of the current eager-ticks mode, the results so far); the phases themselves
are functions of it in ``ductor_phases.py``, ``raw_phases.py``, ``scatters.py``, ``pg_log.py``
and ``profiling.py``, run in the order of ``plan.run_phases``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cpu
import critical_path
from common import BENCH_DIR, log
from servers import PostgresServer, RabbitMQServer, RedisServer, default_base_dir
from workers import Worker


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
        #: ``--broker rabbitmq``: ductor's and raw Celery's messages go through a private
        #: RabbitMQ node, a vhost each; Redis keeps raw Celery's results and its counter.
        self.rabbitmq: RabbitMQServer | None = None
        if self.args.broker == "rabbitmq":
            self.rabbitmq = RabbitMQServer()
            self.rabbitmq.start()
            self.stack.callback(self.rabbitmq.stop)
        log(
            f"servers up in {time.monotonic() - t0:.1f}s: PostgreSQL :{self.pg.port}, "
            f"Redis :{self.redis.port}"
            + (f", RabbitMQ :{self.rabbitmq.port}" if self.rabbitmq is not None else "")
        )

        from ductor_celery.store.db import dispose_all
        from ductor_celery.store.migrate import upgrade

        self.pg.create_database("bench")
        self.db_url = self.pg.url("bench")
        upgrade(self.db_url)
        dispose_all()

        # db 0: ductor's broker; 1: raw broker; 2: raw results; 3: raw throughput counter.
        self.broker_url, raw_broker_url = self.redis.url(0), self.redis.url(1)
        if self.rabbitmq is not None:
            self.broker_url = self.rabbitmq.url(self.rabbitmq.new_vhost())
            raw_broker_url = self.rabbitmq.url(self.rabbitmq.new_vhost())
        self.env = {
            **os.environ,
            "DUCTOR_DATABASE_URL": self.db_url,
            "BENCH_BROKER_URL": self.broker_url,
            "BENCH_RAW_BROKER_URL": raw_broker_url,
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

    # -- workers ------------------------------------------------------------------------------

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
            f"steps-{tag}",
            "bench_app",
            ["-Q", self.app.STEPS_QUEUE, "-c", str(self.args.step_concurrency)],
            extra,
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

    def rss(self) -> dict[str, dict[str, int]]:
        return {w.name: w.rss_kb() for w in self.ductor_workers}

    def roots(self) -> dict[str, int]:
        """The benchmark's process trees, for ``cpu.OtherLoad``: the driver (its workers,
        watchdogs and subprocesses descend from it) and the servers (started by it too)."""
        return {**self.server_roots(), "driver": os.getpid()}

    def server_roots(self) -> dict[str, int]:
        """The servers' process trees by name (``cpu.SERVERS``)."""
        roots = {
            "postgres": self.pg._proc.pid,  # type: ignore[union-attr]
            "redis": self.redis._proc.pid,  # type: ignore[union-attr]
        }
        if self.rabbitmq is not None:
            roots["rabbitmq"] = self.rabbitmq._proc.pid  # type: ignore[union-attr]
        return roots

    # -- what a phase cost --------------------------------------------------------------------

    @contextlib.contextmanager
    def cpu_phase(self, name: str, units: int, unit: str) -> Iterator[None]:
        """CPU time of every process during the phase, in ms per unit of work, by process."""
        # Workers are the driver's children: match them (and the servers) before the driver.
        roots = {
            **{w.name: w.proc.pid for w in self.workers},
            **self.server_roots(),
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

    def drain_coordinator(self, finished_at: float, quiet: bool = False) -> dict[str, Any]:
        """Wait until the coordinator has no queued wake-ups left, so the next phase runs on
        an idle machine, and report what was still queued when the last run had finished
        (wake-ups for finished runs: each one costs a no-op tick)."""
        queued = self.coordinator_queue()
        t0 = time.perf_counter()
        deadline = t0 + self.args.phase_timeout
        while self.coordinator_queue() and time.perf_counter() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the last prefetched ones
        drain = time.perf_counter() - t0
        left = self.coordinator_queue()
        after: dict[str, int] = {}
        if self.timers_dir is not None:
            after = critical_path.tick_results_since(self.timers_dir, finished_at)
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

    def coordinator_queue(self) -> int:
        """Wake-ups waiting on the coordinator's queue: the Redis list's length, or the
        RabbitMQ queue's ready messages (a passive declare, which changes nothing)."""
        if self.rabbitmq is None:
            import redis

            with contextlib.closing(redis.Redis.from_url(self.redis.url(0))) as client:
                return int(client.llen(self.app.COORD_QUEUE))
        from kombu import Connection
        from kombu.exceptions import ChannelError

        with Connection(self.broker_url) as conn:
            try:
                declared = conn.channel().queue_declare(self.app.COORD_QUEUE, passive=True)
            except ChannelError:  # not declared yet: nothing waits on it
                return 0
            return int(declared.message_count)

    def tick_stats(self, since: float, until: float) -> dict[str, Any] | None:
        """What the ticks that started in [since, until] did (``critical_path.tick_stats``)."""
        if self.timers_dir is None:
            return None
        return critical_path.tick_stats(self.timers_dir, since, until)


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
        info["broker"] = bench.args.broker
        if bench.rabbitmq is not None:
            with contextlib.suppress(Exception):
                status = bench.rabbitmq.ctl("version")
                info["rabbitmq"] = status.strip()
    return info
