"""Prove it under fire: the chaos harness's driver (``scripts/chaos`` runs it).

Usage (from the repo root)::

    scripts/chaos                          # 5 minutes of faults, seed 1
    scripts/chaos --minutes 1 --seed 7     # the short run the test suite makes
    scripts/chaos --minutes 60 --seed 42 --report chaos-report.json
    scripts/chaos --fleet --minutes 2      # every process group on a host of its own
                                           # (network namespaces), partitions among the faults

One invocation:

1. starts a private PostgreSQL and Redis on 127.0.0.1 (tests/servers.py), migrates a database,
   creates the ledger table next to ductor's;
2. starts the workers with the production commands, from chaos/: three step workers
   (``celery -A app worker -Q ductor-steps -c 2``; one with eager ticks off) and two
   coordinators (``celery -A app worker -Q ductor-coord -c 1``), some with an armable
   failpoint;
3. runs the mixed workload (chaos/workload.py) for ``--minutes`` while the nemesis
   (chaos/nemesis.py) injects the faults of the seeded schedule;
4. heals everything, lets the workload finish its scripts, and waits at most
   ``--recovery-timeout`` (60 s) for every run to be terminal;
5. stops the workers and runs the checker (chaos/checker.py) over the tables and the ledger;
6. prints a table, writes the JSON report, and exits 1 on any violation or stuck run.

Everything it started is stopped on exit, also on Ctrl-C and on error. See docs/reliability.md.
With ``--fleet`` (chaos/fleet_run.py, docs/fleet.md) the servers, each worker and the driver
run in network namespaces of their own on a private bridge, and the nemesis adds partitions.
"""

# ruff: noqa: T201 - a command-line report

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

CHAOS_DIR = Path(__file__).resolve().parent
ROOT = CHAOS_DIR.parent
sys.path[:0] = [str(CHAOS_DIR), str(ROOT / "tests")]

from nemesis import KINDS, Nemesis, make_schedule  # noqa: E402
from procs import Worker  # noqa: E402
from servers import PostgresServer, RedisServer, default_base_dir  # noqa: E402

DBNAME = "chaos"
STEPS_QUEUE, COORD_QUEUE = "ductor-steps", "ductor-coord"
#: Failpoints given to workers by index (a worker with none: None). Step workers reach
#: before_commit and eager_after_commit_before_dispatch in their eager ticks; coordinators
#: reach after_commit_before_dispatch and mid_dispatch (some of a tick's messages sent).
STEP_FAILPOINTS = ["eager_after_commit_before_dispatch", "before_commit", None]
COORD_FAILPOINTS = ["after_commit_before_dispatch", "mid_dispatch"]

log = logging.getLogger("chaos")


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def code_fingerprint() -> dict[str, Any]:
    """Which ductor_celery was under test: git's HEAD and a hash of the package's files as
    they are in the working tree (it may carry uncommitted changes)."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted((ROOT / "ductor_celery").rglob("*.py")):
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    head = None
    with contextlib.suppress(Exception):
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    return {"head": head, "ductor_celery_sha256": digest.hexdigest()[:16]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=5.0, help="fault window (default 5)")
    p.add_argument("--seed", type=int, default=1, help="seeds the fault schedule (and workload)")
    p.add_argument("--step-workers", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=2, help="-c of each step worker")
    p.add_argument("--coordinators", type=int, default=2)
    p.add_argument(
        "--open-runs", type=int, default=30, help="top-level runs the workload keeps open at once"
    )
    p.add_argument(
        "--mean-gap",
        type=float,
        default=None,
        help="mean seconds between faults (default: 2.2 for runs under 3 minutes, else 4)",
    )
    p.add_argument("--step-timeout", type=float, default=6.0, help="the steps' timeout (s)")
    p.add_argument(
        "--max-transitions",
        type=int,
        default=30,
        help="ductor_max_transitions (automatic continue-as-new)",
    )
    p.add_argument(
        "--recovery-timeout",
        type=float,
        default=60.0,
        help="every run must be terminal this long after the last fault",
    )
    p.add_argument("--no-faults", action="store_true", help="the workload alone (a baseline)")
    p.add_argument(
        "--report",
        type=Path,
        default=None,
        help="JSON report path (default: $TMPDIR/ductor-chaos-seed<SEED>.json)",
    )
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep the work dir (logs, report, a pg_dump when something broke)",
    )
    p.add_argument(
        "--schedule-only", action="store_true", help="print the fault schedule for --seed and exit"
    )
    fleet = p.add_argument_group("fleet (docs/fleet.md)")
    fleet.add_argument(
        "--fleet",
        action="store_true",
        help="every server, worker and the driver on a host of its own (a network namespace, "
        "needs root), with partitions and flapping links among the faults",
    )
    fleet.add_argument("--broker", choices=["redis", "rabbitmq"], default="redis")
    fleet.add_argument("--pooler", choices=["none", "pgbouncer"], default="none")
    fleet.add_argument(
        "--replication",
        choices=["sync", "async"],
        default="sync",
        help="how the standby on pg1 streams from the primary (the failover fault swaps them)",
    )
    fleet.add_argument(
        "--failover-lag",
        type=float,
        default=0.0,
        help="async only: stop streaming this many seconds before half the failovers' kill, "
        "so that acknowledged commits are lost (default 0; see docs/fleet.md)",
    )
    return p.parse_args(argv)


def worker_plan(args: argparse.Namespace) -> list[tuple[str, str, list[str], str | None, str]]:
    """(name, role, celery args, failpoint, eager) for every worker."""
    plan = []
    for i in range(args.step_workers):
        fp = STEP_FAILPOINTS[i] if i < len(STEP_FAILPOINTS) else None
        eager = "0" if i == 2 else "1"  # one step worker ticks through the coordinator only
        plan.append(
            (f"steps{i}", "steps", ["-Q", STEPS_QUEUE, "-c", str(args.concurrency)], fp, eager)
        )
    for i in range(args.coordinators):
        fp = COORD_FAILPOINTS[i] if i < len(COORD_FAILPOINTS) else None
        plan.append((f"coord{i}", "coord", ["-Q", COORD_QUEUE, "-c", "1"], fp, "1"))
    return plan


def schedule_for(args: argparse.Namespace) -> list[Any]:
    plan = worker_plan(args)
    gap = args.mean_gap or (2.2 if args.minutes < 3 else 4.0)
    return make_schedule(
        args.seed,
        args.minutes * 60.0,
        {name: role for name, role, _, _, _ in plan},
        [name for name, _, _, fp, _ in plan if fp],
        mean_gap_s=gap,
        step_timeout=args.step_timeout,
    )


class Harness:
    #: Every fault kind the report counts (``faults_by_kind``), injected or not.
    kinds: dict[str, Any] = KINDS

    def __init__(self, args: argparse.Namespace, stack: contextlib.ExitStack) -> None:
        self.args = args
        self.stack = stack
        self.workers: dict[str, Worker] = {}
        self.supervising = threading.Event()
        self.overdue: list[int] = []
        self.report: dict[str, Any] = {
            "seed": args.seed,
            "minutes": args.minutes,
            "code": code_fingerprint(),
        }

    # -- set-up -----------------------------------------------------------------------------------

    def setup(self) -> None:
        args = self.args
        base = args.workdir or Path(
            tempfile.mkdtemp(prefix="ductor-chaos-", dir=default_base_dir())
        )
        base.mkdir(parents=True, exist_ok=True)
        self.workdir = base
        if not args.keep and args.workdir is None:
            self.stack.callback(shutil.rmtree, base, ignore_errors=True)
        (base / "ready").mkdir(exist_ok=True)
        logging.basicConfig(
            filename=base / "driver.log",
            level=logging.INFO,
            format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s",
        )
        say(f"work dir {base}")
        self.start_servers()
        self.env = {
            **os.environ,
            "DUCTOR_DATABASE_URL": self.db_url,
            "CHAOS_BROKER_URL": self.broker_url,
            "CHAOS_LEDGER_DSN": self.pg.conninfo(DBNAME),
            "CHAOS_MAX_TRANSITIONS": str(args.max_transitions),
            "CHAOS_STEP_TIMEOUT": str(args.step_timeout),
            "PYTHONPATH": os.pathsep.join(
                [str(CHAOS_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            **self.extra_env(),
        }
        for key in ("DUCTOR_FAILPOINT", "DUCTOR_FAILPOINT_MARKER"):
            self.env.pop(key, None)
        # The driver is a client of the same app: same environment, imported after it is set.
        os.environ.update(
            {
                k: self.env[k]
                for k in (
                    "DUCTOR_DATABASE_URL",
                    "CHAOS_BROKER_URL",
                    "CHAOS_LEDGER_DSN",
                    "CHAOS_MAX_TRANSITIONS",
                    "CHAOS_STEP_TIMEOUT",
                    *self.extra_env(),
                )
            }
        )
        from ductor_celery.store.db import dispose_all
        from ductor_celery.store.migrate import upgrade

        upgrade(self.migrate_url)
        dispose_all()
        import ledger
        import psycopg

        with psycopg.connect(self.pg.conninfo(DBNAME), autocommit=True) as conn:
            conn.execute(ledger.DDL)
        import app as chaos_app  # noqa: PLC0415

        self.app = chaos_app
        import sqlalchemy as sa

        self.engine = sa.create_engine(
            self.migrate_url, pool_size=12, max_overflow=8, pool_pre_ping=True
        )
        self.stack.callback(self.engine.dispose)
        t = time.monotonic()
        for name, role, wargs, fp, eager in worker_plan(args):
            worker = self.make_worker(
                name,
                role,
                wargs,
                {**self.env, "CHAOS_EAGER": eager},
                base,
                base / "ready",
                failpoint=fp,
            )
            self.workers[name] = worker
            worker.start()
        self.stack.callback(self.stop_workers)
        for worker in self.workers.values():
            if not worker.wait_ready(120):
                raise SystemExit(f"worker {worker.name} did not start:\n{worker.log_tail()}")
        say(
            f"{len(self.workers)} workers ready in {time.monotonic() - t:.1f}s: "
            + ", ".join(f"{w.name}({w.failpoint or '-'})" for w in self.workers.values())
        )
        self.report["commands"] = sorted(
            {" ".join(["celery", "-A", "app", "worker", *w.args]) for w in self.workers.values()}
        )

    def start_servers(self) -> None:
        """PostgreSQL and Redis on 127.0.0.1; sets ``pg``, ``redis``, ``db_url`` (what the
        workers use), ``migrate_url`` (a direct connection: migrations, the driver's reads),
        ``broker_url``."""
        t = time.monotonic()
        self.pg = PostgresServer()
        self.pg.start()
        self.stack.callback(self.pg.stop)
        self.redis = RedisServer()
        self.redis.start()
        self.stack.callback(self.redis.stop)
        self.pg.create_database(DBNAME)
        self.db_url = self.migrate_url = self.pg.url(DBNAME)
        self.broker_url = self.redis.url(0)
        say(
            f"PostgreSQL 127.0.0.1:{self.pg.port}, Redis 127.0.0.1:{self.redis.port} "
            f"({time.monotonic() - t:.1f}s)"
        )

    def extra_env(self) -> dict[str, str]:
        """More environment for the workers and the driver's client."""
        return {}

    def make_worker(self, *args: Any, **kwargs: Any) -> Worker:
        return Worker(*args, **kwargs)

    def make_schedule(self) -> list[Any]:
        return schedule_for(self.args)

    def make_nemesis(self, schedule: list[Any]) -> Nemesis:
        return Nemesis(
            schedule,
            self.workers,
            self.pg,
            self.redis,
            DBNAME,
            self.app.app.send_task,
            STEPS_QUEUE,
            COORD_QUEUE,
            self.args.seed,
            publish=self.publish_raw,
        )

    def before_check(self) -> None:
        """Called once the workers are stopped, before the checker reads the tables."""

    def extra_report(self) -> dict[str, Any]:
        return {}

    def publish_raw(
        self, queue: str, body: str | bytes, content_type: str, headers: dict[str, Any] | None
    ) -> None:
        """A message as it is, straight on a queue (the nemesis's forged ones)."""
        with self.app.app.producer_or_acquire() as producer:
            producer.publish(
                body,
                exchange="",  # the default exchange: the routing key names the queue
                routing_key=queue,
                content_type=content_type,
                content_encoding="binary" if isinstance(body, bytes) else "utf-8",
                headers=headers,
                serializer=None,
                retry=False,
            )

    def supervise(self, t0: float) -> None:
        """Restart workers that exited on their own, as systemd or Kubernetes would (the
        nemesis restarts the ones it kills itself)."""
        while not self.supervising.wait(0.5):
            for worker in self.workers.values():
                if worker.restart_if_crashed(time.monotonic() - t0):
                    say(
                        f"{worker.name} exited on its own ({worker.crashes[-1]['why'][:120]}); "
                        "restarted"
                    )

    def sample_timers(self) -> None:
        """Every 5 s: timer rows of open runs more than 10 s overdue (the sweeper should have
        woken them and their tick moved the row)."""
        while not self.supervising.wait(5.0):
            n = self.scalar(
                "SELECT count(*) FROM eec_workflow_timer t JOIN eec_workflow_run r USING "
                "(run_id) WHERE r.status IN ('pending', 'running', 'paused') AND t.fire_at < "
                "now() - interval '10 seconds'"
            )
            if n is not None:
                self.overdue.append(int(n))

    def stop_workers(self) -> None:
        self.supervising.set()
        threads = [threading.Thread(target=w.stop) for w in self.workers.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    # -- measuring --------------------------------------------------------------------------------

    def scalar(self, query: str, **params: Any) -> Any:
        import sqlalchemy as sa

        for _ in range(30):
            try:
                with self.engine.connect() as conn:
                    return conn.execute(sa.text(query), params).scalar_one()
            except Exception:  # noqa: BLE001 - PostgreSQL may be restarting
                time.sleep(1)
        return None

    def open_runs(self) -> int:
        return int(
            self.scalar(
                "SELECT count(*) FROM eec_workflow_run WHERE status IN "
                "('pending', 'running', 'paused')"
            )
            or 0
        )

    def leftovers(self) -> dict[str, int]:
        return {
            "open_attempts": int(
                self.scalar(
                    "SELECT count(*) FROM eec_workflow_step_attempt WHERE finished_at IS NULL"
                )
                or 0
            ),
            "unfolded": int(
                self.scalar("SELECT count(*) FROM eec_workflow_step_attempt WHERE unfolded") or 0
            ),
            "outbox": int(self.scalar("SELECT count(*) FROM eec_workflow_outbox") or 0),
            "leases": int(self.scalar("SELECT count(*) FROM eec_concurrency_lease") or 0),
            "controls": int(
                self.scalar("SELECT count(*) FROM eec_workflow_control WHERE handled_at IS NULL")
                or 0
            ),
            "timers": int(self.scalar("SELECT count(*) FROM eec_workflow_timer") or 0),
        }

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> int:
        args = self.args
        from workload import Workload

        schedule = [] if args.no_faults else self.make_schedule()
        self.schedule = schedule
        window = args.minutes * 60.0
        say(
            f"fault window {window:.0f}s, {len(schedule)} faults scheduled (seed {args.seed}): "
            + ", ".join(f"{k} {v}" for k, v in sorted(Counter(f.kind for f in schedule).items()))
        )
        workload = Workload(self.app.ductor, self.engine, args.seed, target_open=args.open_runs)
        self.workload = workload
        nemesis = self.make_nemesis(schedule)
        t0 = time.monotonic()
        t0_wall = time.time()
        workload.t0 = t0
        threading.Thread(target=workload.run, name="workload", daemon=True).start()
        nem_thread = threading.Thread(target=nemesis.run, args=(t0,), name="nemesis", daemon=True)
        nem_thread.start()
        threading.Thread(target=self.supervise, args=(t0,), name="supervisor", daemon=True).start()
        threading.Thread(target=self.sample_timers, name="timers", daemon=True).start()
        next_note = 10.0
        while time.monotonic() - t0 < window:
            time.sleep(0.5)
            elapsed = time.monotonic() - t0
            if elapsed >= next_note:
                next_note += 10.0 if window <= 120 else 30.0
                done = sum(1 for f in schedule if f.started is not None)
                say(
                    f"t={elapsed:5.0f}s runs started {len(workload.scripts)}, open "
                    f"{len(workload.open_scripts())}, faults {done}/{len(schedule)}"
                )
        workload.finish()
        say("fault window over: healing")
        last_fault = nemesis.heal()
        healed = time.monotonic()
        say(
            f"healed {healed - t0 - window:+.1f}s after the window (last fault ended at "
            f"t={last_fault:.1f}s); waiting for every run to finish"
        )
        deadline = healed + args.recovery_timeout
        all_terminal_at = None
        while time.monotonic() < deadline:
            if not workload.open_scripts() and self.open_runs() == 0:
                all_terminal_at = time.monotonic()
                break
            time.sleep(0.25)
        recovery = None if all_terminal_at is None else all_terminal_at - healed
        if recovery is None:
            say(
                f"NOT all terminal {args.recovery_timeout:.0f}s after the last fault: "
                f"{self.open_runs()} runs open, {len(workload.open_scripts())} scripts open"
            )
        else:
            say(f"every run terminal {recovery:.1f}s after the last fault")
        # Leftovers (sent outbox rows are deleted in batches, off the critical path) settle.
        settle_deadline = time.monotonic() + 45.0
        left = self.leftovers()
        while any(left.values()) and time.monotonic() < settle_deadline:
            time.sleep(0.5)
            left = self.leftovers()
        workload.stop()
        self.stop_workers()
        self.before_check()
        t_end = time.monotonic()

        from checker import Checker, print_violations

        say("checking")
        faults = [f.to_json() for f in schedule]
        checker = Checker(
            self.engine,
            view=self.app.ductor.get,
            signals_sent=workload.signals_sent,
            decisions=workload.decisions,
            faults=faults,
            t0_wall=t0_wall,
        )
        checker.run()
        result = checker.report()
        attempts_in_window = int(
            self.scalar(
                "SELECT count(*) FROM eec_workflow_step_attempt"
                " WHERE created_at >= to_timestamp(:a) AND created_at < to_timestamp(:b)",
                a=t0_wall,
                b=t0_wall + window,
            )
            or 0
        )
        executions_in_window = int(
            self.scalar(
                "SELECT count(*) FROM chaos_ledger WHERE ok AND ended_at >= to_timestamp(:a) AND "
                "ended_at < to_timestamp(:b)",
                a=t0_wall,
                b=t0_wall + window,
            )
            or 0
        )
        runs_in_window = int(
            self.scalar(
                "SELECT count(*) FROM eec_workflow_run WHERE finished_at >= to_timestamp(:a) AND "
                "finished_at < to_timestamp(:b)",
                a=t0_wall,
                b=t0_wall + window,
            )
            or 0
        )
        injected = Counter(f["kind"] for f in faults if f["result"] == "done")
        self.report.update(
            {
                "workers": {
                    n: {
                        "role": w.role,
                        "failpoint": w.failpoint,
                        "starts": w.starts,
                        "crashes": w.crashes,
                    }
                    for n, w in self.workers.items()
                },
                "unplanned_worker_exits": sum(len(w.crashes) for w in self.workers.values()),
                "window_s": window,
                "faults_scheduled": len(schedule),
                "faults_injected": sum(injected.values()),
                "faults_by_kind": {k: injected.get(k, 0) for k in sorted(self.kinds)},
                "fault_schedule": faults,
                "last_fault_end_s": round(last_fault, 2),
                "time_to_all_terminal_s": None if recovery is None else round(recovery, 2),
                "stuck_runs": 0 if recovery is not None else self.open_runs(),
                "leftovers_at_check": left,
                "overdue_timers_max": max(self.overdue, default=0),
                "overdue_timers_mean": round(sum(self.overdue) / max(1, len(self.overdue)), 2),
                "throughput_under_fire": {
                    "step_attempts_per_s": round(attempts_in_window / window, 2),
                    "successful_executions_per_s": round(executions_in_window / window, 2),
                    "runs_finished_per_s": round(runs_in_window / window, 2),
                },
                "workload": {
                    "scripts": len(workload.scripts),
                    "ops": dict(sorted(workload.stats.items())),
                    "client_exceptions": dict(workload.client_exceptions),
                    "signals_sent": len(workload.signals_sent),
                    "decisions": len(workload.decisions),
                },
                "wall_s": round(t_end - t0, 1),
                # Workers restarted mid-run import the package as it is then.
                "code_at_end": code_fingerprint(),
                **result,
                **self.extra_report(),
            }
        )
        print_violations(checker.violations)
        self.print_table()
        path = args.report or Path(tempfile.gettempdir()) / f"ductor-chaos-seed{args.seed}.json"
        path.write_text(json.dumps(self.report, indent=2, default=str))
        say(f"report: {path}")
        bad = result["violations"] > 0 or recovery is None
        if bad and args.keep:
            self.dump()
        return 1 if bad else 0

    pg_host = "127.0.0.1"

    def dump(self) -> None:
        out = self.workdir / "chaos.sql"
        pg_dump = self.pg.bindir / "pg_dump"
        with contextlib.suppress(Exception):
            subprocess.run(
                [
                    str(pg_dump),
                    "-h",
                    self.pg_host,
                    "-p",
                    str(self.pg.port),
                    "-U",
                    "postgres",
                    "-f",
                    str(out),
                    DBNAME,
                ],
                check=True,
                timeout=120,
            )
            say(f"database dumped to {out}")

    def print_table(self) -> None:
        r, f = self.report, self.report["figures"]
        rows = [
            ("runs (all: top-level, children, successors)", f["runs"]),
            ("  top-level", f["top_level_runs"]),
            ("  by status", ", ".join(f"{k} {v}" for k, v in sorted(f["runs_by_status"].items()))),
            ("step attempts", f["step_attempts"]),
            (
                "  by outcome",
                ", ".join(f"{k} {v}" for k, v in sorted(f["attempts_by_outcome"].items())),
            ),
            (
                "ledger executions (ok / failed / interrupted)",
                f"{f['executions']} ({f['executions_ok']} / {f['executions_failed']} / "
                f"{f['executions_interrupted']})",
            ),
            ("faults injected", f"{r['faults_injected']} of {r['faults_scheduled']} scheduled"),
        ]
        rows += [(f"  {k}", v) for k, v in r["faults_by_kind"].items()]
        rows += [
            (f"  {k}", f"not scheduled: {why}")
            for k, why in r.get("faults_not_scheduled", {}).items()
        ]
        if r.get("hosts"):
            rows.append(("hosts (network namespaces)", ", ".join(r["hosts"])))
        rows += [
            ("violations", r["violations"]),
            *[(f"  {k}", v) for k, v in r["violations_by_invariant"].items() if v],
            ("duplicate executions", f["duplicate_executions"]),
            *[(f"  {k}", v) for k, v in f["duplicates_by_cause"].items()],
            ("executions that ran on after their attempt was closed", f["zombie_executions"]),
            ("timer rows overdue > 10 s (most at once, open runs)", r["overdue_timers_max"]),
            ("stale results ignored", f["stale_results_ignored"]),
            (
                "continued runs / child runs / redrives applied",
                f"{f['continued_runs']} / {f['child_runs']} / {f['redrives_applied']}",
            ),
            ("signals stored / applied", f"{f['signals_stored']} / {f['signals_applied']}"),
            (
                "time to all-terminal after the last fault",
                "STUCK"
                if r["time_to_all_terminal_s"] is None
                else f"{r['time_to_all_terminal_s']} s",
            ),
            (
                "throughput under fire (attempts/s, ok executions/s, runs/s)",
                " / ".join(str(v) for v in r["throughput_under_fire"].values()),
            ),
            (
                "client exceptions (not DuctorError)",
                sum(r["workload"]["client_exceptions"].values()),
            ),
            ("worker exits nobody asked for (restarted)", r["unplanned_worker_exits"]),
        ]
        width = max(len(k) for k, _ in rows)
        print()
        print(f"chaos report, seed {r['seed']}, {r['minutes']} min of faults")
        for k, v in rows:
            print(f"  {k.ljust(width)}  {v}")
        print()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    harness_class: type[Harness] = Harness
    if args.fleet:
        from fleet_run import FleetHarness, fleet_schedule

        harness_class = FleetHarness
    if args.schedule_only:
        for fault in fleet_schedule(args) if args.fleet else schedule_for(args):
            print(json.dumps(fault.to_json()))
        return 0
    with contextlib.ExitStack() as stack:
        harness = harness_class(args, stack)
        harness.setup()
        return harness.run()


if __name__ == "__main__":
    sys.exit(main())
