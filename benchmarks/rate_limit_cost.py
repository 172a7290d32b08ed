"""What a rate limit costs a step when it is never reached (issue 26: within 10%).

Usage (from the repo root)::

    .venv/bin/python benchmarks/rate_limit_cost.py             # 5 rounds, ~2 min
    .venv/bin/python benchmarks/rate_limit_cost.py --rounds 3 --runs 100

The same private PostgreSQL, Redis and production worker commands as ``run.py``
(``harness.Bench``), with the package defaults (eager ticks and inline steps on). Each round
runs, one after the other, ``bench_chain10`` (10 ``bench.echo`` steps) and
``bench_chain10_rated`` (the same under ``RateLimit("1000000/s")``, one key: a bucket that is
never empty, and the worst case for its lock): ``--runs`` concurrent runs of each, timed
from the first start to the last finish, with the CPU of every process. Then 20 sequential
runs of each for the latency. Rounds alternate which goes first. The ratios (rated /
unlimited) are reported per round and as the median of the rounds, with their spread, in
``benchmarks/rate_limit_results.json``.

A rate-limited step is never run inline (its token is taken by the claim of its message):
that is most of the difference, and why the figures are read with inline steps on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [
    str(Path(__file__).resolve().parent),
    str(Path(__file__).resolve().parents[1] / "tests"),
]

from common import BENCH_DIR, STEPS, git_describe, log  # noqa: E402
from harness import Bench, machine_info  # noqa: E402

PLAIN = "bench_chain10"


def throughput(bench: Bench, workflow: str, n: int) -> dict[str, float]:
    ductor = bench.app.ductor
    name = f"{workflow}-{time.monotonic():.0f}"
    with bench.cpu_phase(name, n * STEPS, "step"):
        t0 = time.perf_counter()
        handles = [ductor.start(workflow, input={"value": 0}) for _ in range(n)]
        for h in handles:
            view = ductor.wait(h.run_id, timeout=bench.args.phase_timeout)
            if view.status.value != "succeeded" or view.output != STEPS:
                raise RuntimeError(f"{workflow} run {h.run_id}: {view.status} {view.output!r}")
        wall = time.perf_counter() - t0
    cpu = bench.results["cpu"].pop(name)
    return {
        "steps_per_s": round(n * STEPS / wall, 1),
        "cpu_ms_per_step": cpu["cpu_ms_per_unit"],
        "background_cores": cpu["background_cores"],
    }


def latency(bench: Bench, workflow: str, n: int = 20) -> float:
    ductor = bench.app.ductor
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        ductor.wait(ductor.start(workflow, input={"value": 0}).run_id, timeout=60)
        samples.append(time.perf_counter() - t0)
    return round(statistics.median(samples) * 1000, 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--runs", type=int, default=100, help="concurrent runs per measurement")
    p.add_argument("--step-concurrency", type=int, default=2)
    p.add_argument("--phase-timeout", type=float, default=120.0)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--output", default=str(BENCH_DIR / "rate_limit_results.json"))
    args = p.parse_args(argv)
    # What harness.Bench reads of run.py's flags, at run.py's defaults.
    args.experiment, args.no_timers, args.batch_size, args.broker = [], True, 100, "redis"
    rounds: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        bench = Bench(args, stack)
        bench.setup()
        bench.results["cpu"] = {}
        bench.use_mode("inline", timers=False)
        for workflow in (PLAIN, bench.app.RATED_WORKFLOW):  # warm-up: connections, caches
            throughput(bench, workflow, 20)
        for i in range(args.rounds):
            order = [PLAIN, bench.app.RATED_WORKFLOW][:: 1 if i % 2 == 0 else -1]
            got = {wf: throughput(bench, wf, args.runs) for wf in order}
            for wf in order:
                got[wf]["latency_p50_ms"] = latency(bench, wf)
            plain, rated = got[PLAIN], got[bench.app.RATED_WORKFLOW]
            ratio = {
                "steps_per_s": round(rated["steps_per_s"] / plain["steps_per_s"], 3),
                "cpu_ms_per_step": round(rated["cpu_ms_per_step"] / plain["cpu_ms_per_step"], 3),
                "latency_p50_ms": round(rated["latency_p50_ms"] / plain["latency_p50_ms"], 3),
            }
            log(f"round {i + 1}: unlimited {plain} rated {rated} ratio {ratio}")
            rounds.append({"unlimited": plain, "rated": rated, "ratio": ratio})
        info = machine_info(bench)
    summary = {
        key: {
            "median": statistics.median(r["ratio"][key] for r in rounds),
            "min": min(r["ratio"][key] for r in rounds),
            "max": max(r["ratio"][key] for r in rounds),
        }
        for key in ("steps_per_s", "cpu_ms_per_step", "latency_p50_ms")
    }
    out = {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git": git_describe(),
        "machine": info,
        "runs_per_measurement": args.runs,
        "rounds": rounds,
        "rated_over_unlimited": summary,
    }
    with open(args.output, "w") as f:
        json.dump(out, f, indent=2)
    log(f"rated / unlimited, median of {args.rounds} (min-max): {summary}")
    log(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
