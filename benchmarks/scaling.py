"""Capacity, measured: ductor and raw Celery on 1, 2 and 4 step-worker hosts (docs/scaling.md).

Usage (root, from the repo root; needs ``ip netns``, like ``scripts/chaos --fleet``)::

    .venv/bin/python benchmarks/scaling.py                  # hosts 1,2,4; about 4 minutes
    .venv/bin/python benchmarks/scaling.py --hosts 1,2 --runs 100 --raw-tasks 2000

Every server and worker runs on a host of its own (a network namespace on a private bridge,
chaos/fleet.py): PostgreSQL on ``pg``, Redis on ``broker``, the step workers on ``steps0``..,
the coordinators on ``coord0``.., and this process on ``driver``. For each count of step-worker
hosts, side by side in one run:

* raw Celery: one ``celery -A bench_app:raw worker -Q bench-raw -c 2`` per host, and
  ``--raw-tasks`` plain tasks sent at once (each INCRs a counter; no result backend read);
* ductor: one ``celery -A bench_app worker -Q ductor-steps -c 2`` per host plus
  ``--coordinators`` ``celery -A bench_app worker -Q ductor-coord -c 1``, and ``--runs`` runs
  of ``bench_chain10`` (10 sequential steps) started at once.

Per phase it records the wall time, units per second, CPU seconds per unit by process group
(from /proc: processes in a network namespace are ordinary processes of this machine), and
for ductor what one step costs the servers: PostgreSQL transactions, rows written and WAL
bytes (``pg_stat_database``, ``pg_current_wal_lsn()``), Redis commands and messages pushed
(``INFO commandstats``). It prints a table and writes ``benchmarks/scaling_results.json``.

All hosts share this machine's cores: once the phase keeps every core busy, more hosts add
processes, not capacity. The per-unit CPU figures are what carries to bigger hardware
(docs/scaling.md, "Reading the curve").
"""

# ruff: noqa: T201 - a command-line report

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path[:0] = [str(BENCH_DIR), str(ROOT / "chaos"), str(ROOT / "tests")]

import cpu  # noqa: E402
from common import STEPS, WORKFLOW, git_describe, log  # noqa: E402
from workers import Worker  # noqa: E402

DBNAME = "bench"
RESULTS = BENCH_DIR / "scaling_results.json"
# Redis dbs, as in benchmarks/run.py: 0 ductor's broker, 1 raw broker, 2 raw results, 3 counter.
DUCTOR_DB, RAW_BROKER_DB, RAW_BACKEND_DB, COUNTER_DB = 0, 1, 2, 3


def host_counts(text: str) -> list[int]:
    """``--hosts``: a comma-separated list of step-worker host counts, each 1..8."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--hosts {text!r}: not a list of integers") from None
    if not counts or any(not 1 <= n <= 8 for n in counts):
        raise argparse.ArgumentTypeError(f"--hosts {text!r}: each count must be 1..8")
    return counts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=host_counts, default=[1, 2, 4])
    parser.add_argument("--runs", type=int, default=400, help="ductor runs per phase")
    parser.add_argument("--raw-tasks", type=int, default=6000, help="raw tasks per phase")
    parser.add_argument("--coordinators", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=2, help="-c of each step worker")
    parser.add_argument("--phase-timeout", type=float, default=300.0)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--keep", action="store_true", help="keep the work dir (worker logs)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.raw_tasks < 1 or args.coordinators < 1 or args.concurrency < 1:
        parser.error("--runs, --raw-tasks, --coordinators and --concurrency must be positive")
    return args


# --- what the servers did ----------------------------------------------------------------------


def db_counters(conn: Any) -> dict[str, int]:
    """The database's cumulative counters: transactions, rows written, WAL position (bytes)."""
    row = conn.execute(
        "SELECT xact_commit, xact_rollback, tup_inserted, tup_updated, tup_deleted, "
        "pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint "
        "FROM pg_stat_database WHERE datname = current_database()"
    ).fetchone()
    keys = ("commits", "rollbacks", "inserted", "updated", "deleted", "wal_bytes")
    return dict(zip(keys, (int(v) for v in row), strict=True))


def table_counters(conn: Any) -> dict[str, int]:
    """Rows inserted, updated (HOT or not) and deleted, per ductor table (``eec_*``):
    ``<table>.ins``, ``.upd``, ``.del``."""
    out: dict[str, int] = {}
    rows = conn.execute(
        "SELECT relname, n_tup_ins, n_tup_upd, n_tup_del FROM pg_stat_user_tables "
        "WHERE relname LIKE 'eec\\_%'"
    ).fetchall()
    for name, ins, upd, dele in rows:
        out.update({f"{name}.ins": ins, f"{name}.upd": upd, f"{name}.del": dele})
    return out


def redis_counters(client: Any) -> dict[str, int]:
    """Redis's cumulative command counts: all commands, and the pushes (a kombu publish is one
    LPUSH onto the queue's list)."""
    stats = client.info("commandstats")
    calls = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
    return {"commands": sum(calls.values()), "pushes": calls.get("lpush", 0)}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before.get(key, 0) for key in after}


def group_of(label: str) -> str:
    """ "steps3 pool" -> "step workers"; the CPU groups a phase reports."""
    name = label.split()[0].rstrip("0123456789")
    return {
        "steps": "step workers",
        "raw": "raw workers",
        "coord": "coordinators",
        "postgres": "postgres",
        "redis": "redis",
        "driver": "driver",
    }.get(name, "other")


def per_unit(values: dict[str, float], units: int, scale: float = 1.0, digits: int = 3) -> dict:
    return {key: round(scale * value / units, digits) for key, value in sorted(values.items())}


# --- the bench ---------------------------------------------------------------------------------


class ScalingBench:
    def __init__(self, args: argparse.Namespace, stack: contextlib.ExitStack) -> None:
        self.args = args
        self.stack = stack
        self.max_hosts = max(args.hosts)

    def setup(self) -> None:
        from fleet import Fleet, unavailable_reason
        from fleet_servers import FleetPostgres, FleetRedis

        if reason := unavailable_reason():
            raise SystemExit(f"benchmarks/scaling.py needs network namespaces: {reason}")
        self.workdir = Path(tempfile.mkdtemp(prefix="ductor-scaling-", dir="/dev/shm"))
        if not self.args.keep:
            self.stack.push(self._remove_workdir)
        (self.workdir / "ready").mkdir()
        self.fleet = Fleet()
        self.fleet.install_signal_handlers()
        self.stack.callback(self.fleet.teardown)  # first in, last out: after the servers
        steps = [f"steps{i}" for i in range(self.max_hosts)]
        coords = [f"coord{i}" for i in range(self.args.coordinators)]
        self.fleet.create(["pg", "broker", *steps, *coords, "driver"])
        self.fleet.enter("driver")
        log(f"fleet {self.fleet.tag}: {len(self.fleet.hosts)} hosts, work dir {self.workdir}")

        self.pg = FleetPostgres(self.fleet, "pg")
        self.pg.start()
        self.stack.callback(self.pg.stop)
        self.redis = FleetRedis(self.fleet, "broker")
        self.redis.start()
        self.stack.callback(self.redis.stop)
        self.pg.create_database(DBNAME)

        from ductor_celery.store.db import dispose_all
        from ductor_celery.store.migrate import upgrade

        upgrade(self.pg.url(DBNAME))
        dispose_all()
        self.env = {
            **os.environ,
            "DUCTOR_DATABASE_URL": self.pg.url(DBNAME),
            "BENCH_BROKER_URL": self.redis.url(DUCTOR_DB),
            "BENCH_RAW_BROKER_URL": self.redis.url(RAW_BROKER_DB),
            "BENCH_RAW_BACKEND_URL": self.redis.url(RAW_BACKEND_DB),
            "BENCH_COUNTER_URL": self.redis.url(COUNTER_DB),
            "BENCH_READY_DIR": str(self.workdir / "ready"),
            "PYTHONPATH": os.pathsep.join(
                [str(BENCH_DIR), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
        # The package's defaults (eager ticks, inline steps), never the caller's shell.
        for key in (
            "BENCH_TIMERS_DIR",
            "BENCH_PROFILE_DIR",
            "BENCH_EXPERIMENTS",
            "BENCH_EAGER",
            "BENCH_INLINE",
        ):
            self.env.pop(key, None)
            os.environ.pop(key, None)
        os.environ.update(
            {k: v for k, v in self.env.items() if k.startswith(("BENCH_", "DUCTOR_"))}
        )

        import bench_app  # configured from the environment just set

        self.app = bench_app

    def _remove_workdir(self, exc_type: Any, *_: Any) -> None:
        """On success only: after a failure the workers' logs stay for reading."""
        if exc_type is None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        else:
            log(f"kept the work dir (the workers' logs): {self.workdir}")

    # -- workers ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def workers(self, specs: list[tuple[str, str, str, list[str]]]) -> Iterator[list[Worker]]:
        """Start ``(name, host, app, args)`` workers, each on its host; stop them all after.
        The name's letters say the CPU group (``group_of``): raw0, steps0, coord0."""
        started: list[Worker] = []
        try:
            for name, host, app, args in specs:
                prefix = self.fleet.exec_prefix(host)
                started.append(Worker(name, app, args, self.env, self.workdir, prefix=prefix))
            for worker in started:
                worker.wait_ready(timeout=120)
            yield started
        finally:
            for worker in started:
                worker.stop()

    def step_hosts(self, n: int) -> list[str]:
        return [f"steps{i}" for i in range(n)]

    # -- measuring ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def measured(self, workers: list[Worker], units: int, unit: str) -> Iterator[dict[str, Any]]:
        """Wall time, CPU by process group and Redis's commands around the body, and the
        database's counters from its start; ``settle()`` reads their end once the workers
        have stopped."""
        roots = {w.name: w.proc.pid for w in workers}
        assert self.pg._proc is not None and self.redis._proc is not None
        roots.update(postgres=self.pg._proc.pid, redis=self.redis._proc.pid, driver=os.getpid())
        label = cpu.classify_by_roots(roots)
        redis_client = self.redis.client()
        out: dict[str, Any] = {"units": units, "unit": unit}
        try:
            self.driver_queries = 0
            db0, r0 = self.db_counters(), redis_counters(redis_client)
            snap0, steal0 = cpu.snapshot(), cpu.steal_seconds()
            t0 = time.perf_counter()
            yield out
            wall = time.perf_counter() - t0
            snap1, steal1 = cpu.snapshot(), cpu.steal_seconds()
            r1 = redis_counters(redis_client)
        finally:
            redis_client.close()
        by_label = cpu.delta(snap0, snap1, label)
        by_group: dict[str, float] = {}
        for name, seconds in by_label.items():
            by_group[group_of(name)] = by_group.get(group_of(name), 0.0) + seconds
        total = sum(v for k, v in by_group.items() if k != "other")
        out.update(
            wall_s=round(wall, 3),
            per_s=round(units / wall, 1),
            cpu_ms_per_unit=per_unit(by_group, units, 1000.0),
            # Each worker's main process (the consumer) and its pool children apart.
            cpu_ms_per_unit_by_process=per_unit(by_label, units, 1000.0),
            cpu_ms_per_unit_total=round(1000.0 * total / units, 3),
            # How busy the machine was: all its cores, every process (ours and the rest).
            machine_busy=round(sum(by_group.values()) / wall / (os.cpu_count() or 1), 2),
            steal_s=round(steal1 - steal0, 2),
            broker=per_unit(delta(r1, r0), units, digits=2),
        )
        out["_db0"] = db0

    def settle(self, out: dict[str, Any]) -> None:
        """The database's share of a phase, read after its workers stopped: a PostgreSQL
        backend reports its transactions and rows to pg_stat_database when it is idle for a
        while or exits, so a reading at the phase's end would miss some. The driver's own
        queries (readings, polls for the end) are not the workload's and are taken out."""
        from ductor_celery.store.db import dispose_all

        dispose_all()  # the driver's own pooled connections (ductor.start) exit too
        time.sleep(1.0)  # the backends of the stopped workers finish exiting
        db0 = out.pop("_db0")
        db1 = self.db_counters()
        spent = delta(db1, db0)
        # Every reading and poll but this last reading, whose own queries are not in db1.
        spent["commits"] -= self.driver_queries - 2
        tables = {k: v for k, v in spent.items() if "." in k and v}
        out["database"] = per_unit(
            {k: v for k, v in spent.items() if "." not in k}, out["units"], digits=2
        )
        out["rows_by_table"] = per_unit(tables, out["units"], digits=2)

    def db_counters(self) -> dict[str, int]:
        import psycopg

        with psycopg.connect(self.pg.conninfo(DBNAME), autocommit=True) as conn:
            # A backend sends its statistics at exit: this reading's two queries count then.
            self.driver_queries += 2
            return {**db_counters(conn), **table_counters(conn)}

    def raw_phase(self, hosts: int) -> dict[str, Any]:
        import redis

        n = self.args.raw_tasks
        c = str(self.args.concurrency)
        specs = [
            (f"raw{i}", host, "bench_app:raw", ["-Q", self.app.RAW_QUEUE, "-c", c])
            for i, host in enumerate(self.step_hosts(hosts))
        ]
        counter = redis.Redis.from_url(self.redis.url(COUNTER_DB))
        with self.workers(specs) as started:
            self.raw_warm_up(counter, 100 * hosts, hosts)
            counter.set(self.app.COUNTER_KEY, 0)
            with self.measured(started, n, "task") as out:
                with self.app.raw.producer_or_acquire() as producer:
                    for i in range(n):
                        self.app.raw_count.apply_async(args=[i], producer=producer)
                deadline = time.monotonic() + self.args.phase_timeout
                while int(counter.get(self.app.COUNTER_KEY) or 0) < n:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"raw, {hosts} hosts: tasks not done in time")
                    time.sleep(0.005)
        counter.close()
        self.settle(out)
        log(f"raw, {hosts} host(s): {out['per_s']} tasks/s, {out['cpu_ms_per_unit']} ms/task")
        return out

    def idle_cpu(self, workers: list[Worker], seconds: float) -> dict[str, float]:
        """CPU milliseconds per second each process group spends with nothing to do: the
        price of a worker host that merely waits (heartbeats, pool maintenance, polling)."""
        roots = {w.name: w.proc.pid for w in workers}
        label = cpu.classify_by_roots(roots)
        snap0 = cpu.snapshot()
        time.sleep(seconds)
        spent = cpu.delta(snap0, cpu.snapshot(), label)
        return {k: round(1000.0 * v / seconds, 1) for k, v in sorted(spent.items()) if k != "other"}

    def raw_warm_up(self, counter: Any, n: int, hosts: int) -> None:
        """As ductor's: every pool child runs some tasks before the measured ones."""
        counter.set(self.app.COUNTER_KEY, 0)
        for i in range(n):
            self.app.raw_count.apply_async(args=[i])
        deadline = time.monotonic() + self.args.phase_timeout
        while int(counter.get(self.app.COUNTER_KEY) or 0) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"raw, {hosts} hosts: warm-up tasks not done in time")
            time.sleep(0.01)

    def ductor_phase(self, hosts: int) -> dict[str, Any]:
        n = self.args.runs
        c = str(self.args.concurrency)
        specs = [
            (host, host, "bench_app", ["-Q", "ductor-steps", "-c", c])
            for host in self.step_hosts(hosts)
        ]
        specs += [
            (f"coord{i}", f"coord{i}", "bench_app", ["-Q", "ductor-coord", "-c", "1"])
            for i in range(self.args.coordinators)
        ]
        ductor = self.app.ductor
        with self.workers(specs) as started:
            # Warm-up: a process's first steps and ticks pay for imports, connections, compiled
            # and prepared statements; enough runs that every pool child of every host gets some.
            warm = [ductor.start(WORKFLOW, input={"value": 0}).run_id for _ in range(20 * hosts)]
            self.wait_all(warm, hosts)
            # Quiet for 11 s: the idle cost, and time for every backend to report the warm-up's
            # transactions and rows to pg_stat_database (an idle one does within 10 s), so
            # that none of them lands in the measured phase's counters.
            idle = self.idle_cpu(started, 11.0)
            with self.measured(started, n * STEPS, "step") as out:
                run_ids = [ductor.start(WORKFLOW, input={"value": 0}).run_id for _ in range(n)]
                self.wait_all(run_ids, hosts)
        self.settle(out)
        out["idle_cpu_ms_per_s"] = idle
        log(f"ductor, {hosts} host(s): {out['per_s']} steps/s, {out['cpu_ms_per_unit']} ms/step")
        return out

    def wait_all(self, run_ids: list[str], hosts: int) -> None:
        """Until every run is terminal; each must have succeeded with the chain's output."""
        import psycopg

        deadline = time.monotonic() + self.args.phase_timeout
        with psycopg.connect(self.pg.conninfo(DBNAME), autocommit=True) as conn:
            while True:
                self.driver_queries += 1
                rows = conn.execute(
                    "SELECT status, output, count(*) FROM eec_workflow_run "
                    "WHERE run_id = ANY(%s) AND status NOT IN ('pending', 'running') "
                    "GROUP BY status, output",
                    (run_ids,),
                ).fetchall()
                if sum(count for _, _, count in rows) == len(run_ids):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ductor, {hosts} hosts: runs not done in time: {rows}")
                time.sleep(0.1)
        wrong = [(status, output, count) for status, output, count in rows]
        if wrong != [("succeeded", STEPS, len(run_ids))]:
            raise RuntimeError(f"ductor, {hosts} hosts: runs ended {wrong}")

    def run(self) -> dict[str, Any]:
        results: dict[str, Any] = {
            "when": datetime.now(UTC).isoformat(timespec="seconds"),
            "git": git_describe(),
            "cpus": os.cpu_count(),
            "args": {
                "hosts": self.args.hosts,
                "runs": self.args.runs,
                "steps_per_run": STEPS,
                "raw_tasks": self.args.raw_tasks,
                "coordinators": self.args.coordinators,
                "concurrency": self.args.concurrency,
            },
            "phases": [],
        }
        for hosts in self.args.hosts:
            raw = self.raw_phase(hosts)
            duct = self.ductor_phase(hosts)
            results["phases"].append(
                {
                    "step_hosts": hosts,
                    "raw": raw,
                    "ductor": duct,
                    "ratios": {
                        "rate": round(duct["per_s"] / raw["per_s"], 3),
                        "cpu_per_unit": round(
                            duct["cpu_ms_per_unit_total"] / raw["cpu_ms_per_unit_total"], 3
                        ),
                    },
                }
            )
        return results


def print_table(results: dict[str, Any]) -> None:
    groups = ("step workers", "coordinators", "postgres", "redis", "driver")
    print()
    print(f"{'hosts':>5} {'raw tasks/s':>11} {'ductor steps/s':>14} {'ratio':>6}   "
          f"{'CPU ms/task':>11} {'CPU ms/step':>11} {'ratio':>6} {'busy':>5}")  # fmt: skip
    for phase in results["phases"]:
        raw, duct = phase["raw"], phase["ductor"]
        print(
            f"{phase['step_hosts']:>5} {raw['per_s']:>11} {duct['per_s']:>14} "
            f"{phase['ratios']['rate']:>6}   {raw['cpu_ms_per_unit_total']:>11} "
            f"{duct['cpu_ms_per_unit_total']:>11} {phase['ratios']['cpu_per_unit']:>6} "
            f"{duct['machine_busy']:>5}"
        )
    print()
    print("ductor, CPU ms per step by process group; what one step costs the servers:")
    for phase in results["phases"]:
        duct = phase["ductor"]
        cpu_row = ", ".join(f"{g} {duct['cpu_ms_per_unit'].get(g, 0.0)}" for g in groups)
        db, br = duct["database"], duct["broker"]
        print(
            f"  {phase['step_hosts']} host(s): {cpu_row}; PostgreSQL {db['commits']} commits, "
            f"{db['inserted']} rows inserted, {db['updated']} updated, {db['deleted']} deleted, "
            f"{db['wal_bytes']:.0f} WAL bytes; Redis {br['commands']} commands, "
            f"{br['pushes']} messages"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.ExitStack() as stack:
        bench = ScalingBench(args, stack)
        bench.setup()
        results = bench.run()
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    log(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
