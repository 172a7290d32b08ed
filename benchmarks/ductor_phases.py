"""ductor's figures for one eager-ticks mode: 10-step latency, throughput with one and two
coordinators, the no-op tick."""

from __future__ import annotations

import time
from typing import Any

import critical_path
from common import CARRY_WORKFLOW, STEPS, WORKFLOW, cpu_name, log, payload_items, summary_ms
from harness import Bench


def ductor_run(bench: Bench) -> tuple[float, str, float, float]:
    """One run, start -> wait. Returns (seconds, run_id, wall start, wall end)."""
    ductor = bench.app.ductor
    w0 = time.time()
    t0 = time.perf_counter()
    items = bench.args.payload_items
    if items:  # each step passes a document on (--payload-items)
        document = {"n": 0, "items": payload_items(items)}
        handle = ductor.start(CARRY_WORKFLOW, input={"value": document})
        expected: Any = {"n": STEPS, "items": document["items"]}
    else:
        handle = ductor.start(WORKFLOW, input={"value": 0})
        expected = STEPS
    view = ductor.wait(handle.run_id, timeout=60)
    elapsed = time.perf_counter() - t0
    w1 = time.time()
    if view.status.value != "succeeded" or view.output != expected:
        raise RuntimeError(f"run {handle.run_id}: {view.status} output={view.output!r}")
    return elapsed, handle.run_id, w0, w1


def ductor_latency(bench: Bench) -> tuple[dict[str, float], list[tuple[str, float, float]]]:
    for _ in range(bench.args.warmup):
        ductor_run(bench)
    samples, runs = [], []
    for _ in range(bench.args.runs):
        elapsed, run_id, w0, w1 = ductor_run(bench)
        samples.append(elapsed)
        runs.append((run_id, w0, w1))
    figures = summary_ms(samples)
    log(f"ductor 10-step latency (eager ticks {bench.mode}): {figures}")
    return figures, runs


def ductor_throughput(bench: Bench, label: str) -> dict[str, Any]:
    import psycopg

    ductor = bench.app.ductor
    n = bench.args.concurrent_runs
    with psycopg.connect(bench.pg.conninfo("bench"), autocommit=True) as conn:
        conn.execute("LISTEN ductor_run_finished")
        t0 = time.perf_counter()
        run_ids = {ductor.start(WORKFLOW, input={"value": 0}).run_id for _ in range(n)}
        t_started = time.perf_counter()
        done: set[str] = set()
        last_poll = time.perf_counter()
        deadline = t0 + bench.args.phase_timeout
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


def ductor_throughput_phase(bench: Bench, mode: str, coordinators: int) -> dict[str, Any]:
    label = f"eager ticks {mode}, {coordinators} coordinator{'s' if coordinators > 1 else ''}"
    since = time.time()
    with bench.cpu_phase(
        cpu_name("ductor_throughput", mode, coordinators),
        bench.args.concurrent_runs * STEPS,
        "step",
    ):
        figures = ductor_throughput(bench, label)
    finished = figures.pop("finished_at")
    figures.update(bench.drain_coordinator(finished))
    out: dict[str, Any] = {
        "throughput": figures,
        "phase_mean_ms": critical_path.throughput_phase_costs(bench.timers_dir, since, finished),
        "tick_stats": bench.tick_stats(since, time.time()),
    }
    log(f"ticks ({label}): {out['tick_stats']}")
    return out


def noop_ticks(bench: Bench, run_id: str, n: int = 300) -> dict[str, Any]:
    """A duplicate wake-up of a finished run: the coordinator's whole tick (one statement
    that clears the wake-up row and finds the run settled: nothing to load, compute or
    commit), run ``n`` times in this process with the production code; wall and CPU per
    tick, and what each tick returned."""
    from collections import Counter

    from ductor_celery.runtime.tick_task import run_tick

    rt = bench.app.ductor.runtime
    for _ in range(10):
        run_tick(rt, run_id)
    outcomes: Counter[str] = Counter()
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
    log(f"no-op ticks (eager ticks {bench.mode}): {figures}")
    return figures


def ductor_mode_phases(bench: Bench, mode: str) -> None:
    """Sequential latency and throughput with eager ticks on or off, then the throughput
    phase again with a second coordinator process."""
    res: dict[str, Any] = bench.results["modes"].setdefault(mode, {})
    with bench.cpu_phase(
        cpu_name("ductor_latency", mode), (bench.args.runs + bench.args.warmup) * STEPS, "step"
    ):
        res["latency"], runs = ductor_latency(bench)
    res["latency_breakdown"] = critical_path.latency_breakdown(bench.timers_dir, runs)
    res["noop_tick"] = noop_ticks(bench, runs[-1][0])
    res["one_coordinator"] = ductor_throughput_phase(bench, mode, 1)
    if mode in bench.args.two_coord_modes:
        coord2 = bench.start_coordinator(f"coord2-eager-{mode}", bench.worker_env)
        coord2.wait_ready()
        log(f"second coordinator ready: {coord2.command} -n {coord2.name}@%h")
        bench.results["workers"].setdefault("ductor_coordinator_2", coord2.command)
        try:
            res["two_coordinators"] = ductor_throughput_phase(bench, mode, 2)
        finally:
            bench.stop_workers([coord2])
