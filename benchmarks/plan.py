"""The phases of a run, in order, and the time budget of each (their sum is the default
``--time-limit``)."""

from __future__ import annotations

import argparse
import math
from typing import Any

import cpu
import pg_log
import profiling
from common import STEPS, scatter_sizes
from ductor_phases import ductor_mode_phases
from harness import Bench
from peers import DbosPeer
from raw_phases import raw_phases
from scatters import batched_scatter, memory_phase, scatter_phases

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
    servers = "PostgreSQL, Redis" + (", RabbitMQ" if args.broker == "rabbitmq" else "")
    plan: list[tuple[str, float]] = [(f"start {servers}, the raw worker", 30.0)]
    if args.repeat:
        mode = args.eager_modes[-1]
        plan.append((f"start ductor workers, eager ticks {mode}", 20.0))
        if "dbos" in args.peers:
            plan.append(("DBOS peer: its venv (created once, pip install dbos)", 180.0))
        rnd = _mode_phases(args, mode) + _raw_phases(args) + _scatter_phases(args)
        rnd += _peer_phases(args)
        plan += [(f"round 1..{args.repeat}: {name}", budget * args.repeat) for name, budget in rnd]
        plan.append(("stop workers and servers", 20.0))
        return plan
    if args.scatter_only:
        plan.append((f"start ductor workers, eager ticks {args.eager_modes[-1]}", 20.0))
    else:
        for mode in args.eager_modes:
            plan.append((f"eager ticks {mode}: (re)start the ductor workers", 20.0))
            plan += _mode_phases(args, mode)
        plan += _raw_phases(args)
        if "dbos" in args.peers:
            plan.append(("DBOS peer: its venv (created once, pip install dbos)", 180.0))
            plan += _peer_phases(args)
    plan += _scatter_phases(args)
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
        seq = args.runs + args.warmup
        plan.append((f"profile: restart workers, {seq} runs", 20.0 + seq * STEPS * 0.1))
    plan.append(("stop workers and servers", 20.0))
    return plan


def _mode_phases(args: argparse.Namespace, mode: str) -> list[tuple[str, float]]:
    seq = args.runs + args.warmup
    conc = args.concurrent_runs * STEPS
    plan = [
        (
            f"eager ticks {mode}: {seq} sequential 10-step runs ({args.warmup} warm-up)",
            seq * STEPS * BUDGET_SEQ_STEP_S,
        ),
        (
            f"eager ticks {mode}: {args.concurrent_runs} concurrent runs, 1 coordinator",
            conc * BUDGET_CONCURRENT_STEP_S + 15.0,
        ),
    ]
    if mode in args.two_coord_modes:
        plan.append(
            (
                f"eager ticks {mode}: {args.concurrent_runs} concurrent runs, 2 coordinators",
                conc * BUDGET_CONCURRENT_STEP_S + 25.0,
            )
        )
    return plan


def _raw_phases(args: argparse.Namespace) -> list[tuple[str, float]]:
    seq = args.runs + args.warmup
    return [
        (f"raw Celery: {seq} 10-task chains", seq * STEPS * 0.015 + 5.0),
        (f"raw Celery: {args.raw_tasks} tasks", args.raw_tasks * BUDGET_RAW_ITEM_S),
    ]


def _scatter_phases(args: argparse.Namespace) -> list[tuple[str, float]]:
    plan: list[tuple[str, float]] = []
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
    return plan


def _peer_phases(args: argparse.Namespace) -> list[tuple[str, float]]:
    if "dbos" not in args.peers:
        return []
    seq = args.runs + args.warmup
    conc = args.concurrent_runs * STEPS
    # DBOS's start-up, its sequential runs and its queue (polled once a second).
    return [
        (
            f"DBOS peer: {seq} sequential 10-step workflows, {args.concurrent_runs} queued",
            10.0 + seq * STEPS * BUDGET_SEQ_STEP_S + conc * BUDGET_CONCURRENT_STEP_S,
        )
    ]


def default_time_limit(args: argparse.Namespace) -> float:
    return float(math.ceil(sum(budget for _, budget in phase_plan(args)) / 10.0) * 10)


def run_phases(bench: Bench) -> dict[str, Any]:
    """Set up, then every phase of ``phase_plan`` in its order; the results so far."""
    bench.setup()
    load = cpu.OtherLoad(bench.roots())
    if not bench.args.scatter_only:
        for mode in bench.args.eager_modes:
            bench.use_mode(mode)
            ductor_mode_phases(bench, mode)
        raw_phases(bench)
        if "dbos" in bench.args.peers:
            peer = DbosPeer.start(bench)
            result = peer.measure() if isinstance(peer, DbosPeer) else peer
            bench.results.setdefault("peers", {})["dbos"] = result
    else:
        bench.use_mode(bench.args.eager_modes[-1])
    scatter_phases(bench)
    batched_scatter(bench)
    memory_phase(bench)
    if bench.args.pg_log:
        pg_log.pg_statements(bench)
    if bench.args.profile:
        profiling.profile(bench)
    bench.results["other_load"] = load.result()
    return bench.results
