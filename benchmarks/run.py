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

One invocation starts a private PostgreSQL and Redis on 127.0.0.1 (tests/servers.py; with
``--broker rabbitmq`` a RabbitMQ node too, the broker of both sides), migrates
a database, starts the workers with the production commands, measures, prints a table, writes
benchmarks/results.json, and stops everything it started, also on Ctrl-C, on error, and when
the whole run exceeds --time-limit. See benchmarks/README.md for what each figure means.
"""

# The entry point: the command line, the time limit, and the clean-up on every way out. The
# rest lives beside it (benchmarks/README.md, "Files"): harness.py (servers, workers, CPU),
# the phases (ductor_phases.py, raw_phases.py, scatters.py, pg_log.py, profiling.py) in the
# order of plan.py, critical_path.py (the timer join), targets.py (the summary rows) and
# report.py (the printed tables).

# ruff: noqa: T201 - a command-line report

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH_DIR), str(BENCH_DIR.parent / "tests")]

from common import (  # noqa: E402
    APP_EXPERIMENTS,
    WORKER_EXPERIMENTS,
    BenchTimeout,
    git_describe,
    log,
)
from harness import Bench, machine_info  # noqa: E402
from plan import default_time_limit, phase_plan, run_phases  # noqa: E402
from repeat import run_rounds  # noqa: E402
from report import print_plan, print_repeat, print_table  # noqa: E402
from targets import summarize  # noqa: E402


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
        for signum, previous in old.items():
            signal.signal(signum, previous)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=30, help="sequential runs per latency figure")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured runs before each")
    p.add_argument("--concurrent-runs", type=int, default=200, help="ductor throughput runs")
    p.add_argument("--raw-tasks", type=int, default=2000, help="raw throughput tasks")
    p.add_argument(
        "--repeat",
        type=int,
        default=0,
        help="N rounds of the figures, ductor and raw Celery (and --peers) interleaved\n"
        "round by round on the same servers and workers; each ratio's median over the\n"
        "rounds, its min..max and every round's value, and each round's other load\n"
        "(0: one run of every figure, as without it)",
    )
    p.add_argument(
        "--broker",
        choices=["redis", "rabbitmq"],
        default="redis",
        help="the broker of ductor and raw Celery alike: redis (default), or rabbitmq = a\n"
        "private RabbitMQ node, a vhost each (raw Celery's results stay in Redis)",
    )
    p.add_argument(
        "--peers",
        nargs="*",
        choices=["dbos"],
        default=[],
        help="peers measured beside raw Celery: dbos = a 10-step DBOS workflow's latency and\n"
        "its queue's throughput on the same PostgreSQL (DBOS in benchmarks/.venv-dbos,\n"
        "created on demand; left out with a reason when it cannot be installed)",
    )
    p.add_argument(
        "--eager-modes",
        nargs="+",
        choices=["off", "on", "inline"],
        default=None,
        help="off: ductor_eager_ticks off; on: eager ticks, ductor_inline_steps=0; inline: both\n"
        "on (the package default). Measured in order (the ductor workers restart between\n"
        "modes; the scatter phases run in the last). Default: all three; with --repeat,\n"
        "inline only (a round measures the last one given)",
    )
    p.add_argument(
        "--two-coord-modes",
        nargs="*",
        choices=["off", "on", "inline"],
        default=None,
        help="modes whose throughput phase also runs with a second coordinator process\n"
        "(none given: never). Default: off and inline; with --repeat: never",
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
        "--payload-items",
        type=int,
        default=0,
        metavar="N",
        help="the sequential runs (ductor's and raw Celery's chains of 10) pass on a document of "
        "N items of ~65 bytes of JSON (40: 2.6 kB) from step to step; the throughput and "
        "scatter phases are unchanged (0: a small int, as always)",
    )
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
    p.add_argument(
        "--step-concurrency",
        type=int,
        default=2,
        help="-c of the ductor step worker (1: no two processes tick one run at once)",
    )
    p.add_argument(
        "--profile-workload",
        choices=["chain", "scatter"],
        default="chain",
        help="what --profile runs: the sequential 10-step runs, or one scatter of the smallest"
        " --scatter-sizes (1,000 if none)",
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
        help="no phase timers in the ductor workers (no breakdown, no tick counts);\n"
        "the default with --repeat",
    )
    p.add_argument(
        "--timers",
        action="store_true",
        help="with --repeat: phase timers in the ductor workers after all (each round's\n"
        "breakdown and tick counts, at about 0.06 ms of the step pool's CPU per step\n"
        "that raw Celery does not pay)",
    )
    p.add_argument(
        "--experiment",
        action="append",
        default=[],
        choices=[*APP_EXPERIMENTS, *WORKER_EXPERIMENTS],
        help="what-if, for the report (repeatable): no-events = Celery task events\n"
        "off in the ductor app (ductor turns them on); no-sent-events = only\n"
        "task_send_sent_event off there (workers still send theirs); no-pre-ping = ductor's\n"
        "engine without pool_pre_ping; no-prepare = psycopg\n"
        "prepare_threshold=None;\n"
        "no-sweeper = ductor_sweep_interval=3600 (no re-sent wake-ups);\n"
        "classic-queues = ductor_classic_queues=True (RabbitMQ: classic queues, as raw\n"
        "Celery's, instead of quorum queues);\n"
        "coord-solo / coord-c2 = coordinator with -P solo / -c 2",
    )
    p.add_argument(
        "--output",
        default=None,
        help="where to write the JSON results ('-' for none; default: results.json, with\n"
        "--repeat repeat_results.json, every round in it)",
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
    if args.output is None:
        args.output = str(BENCH_DIR / ("repeat_results.json" if args.repeat else "results.json"))
    if args.eager_modes is None:
        args.eager_modes = ["inline"] if args.repeat else ["off", "on", "inline"]
    if args.repeat and not args.timers:
        # The rounds compare ductor as users run it with raw Celery, which carries no
        # instrumentation: the timers cost the step pool about 0.06 ms per step (benchmarks/
        # README.md, tenth round). A run without --repeat keeps them for the breakdown.
        args.no_timers = True
    if args.two_coord_modes is None or args.repeat:
        args.two_coord_modes = [] if args.repeat else ["off", "inline"]
    if args.repeat and (args.scatter_only or args.profile or args.pg_log or args.memory_scatters):
        p.error(
            "--repeat measures the rounds' figures only (no --scatter-only, --profile,\n"
            "--pg-log or --memory-scatters)"
        )
    args.time_limit_default = args.time_limit is None
    if args.time_limit is None:
        args.time_limit = default_time_limit(args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    print_plan(args, phase_plan(args))
    bench: Bench | None = None
    with signals_as_exceptions(args.time_limit), contextlib.ExitStack() as stack:
        try:
            bench = Bench(args, stack)
            res = run_rounds(bench) if args.repeat else run_phases(bench)
            key = "repeat" if args.repeat else None
            res = {
                "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
                "git": git_describe(),
                "machine": machine_info(bench),
                "settings": {
                    k: v
                    for k, v in vars(args).items()
                    if k not in ("output", "keep", "profile_out")
                },
                **({key: res} if key else res),
            }
            if not args.repeat:
                res["summary"] = summarize(res)
            res["elapsed_s"] = round(time.monotonic() - started, 1)
            if args.repeat:
                print_repeat(res)
            else:
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
