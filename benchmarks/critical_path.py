"""Where a run's time goes, from the workers' phase timers.

With ``BENCH_TIMERS_DIR`` set, every ductor worker process appends one JSON line per tick and
per step (``bench_app.py``): wall-clock start and end, the phases (load, compute, commit, send,
outbox delete; claim, fn, finish, wake), the moment its first broker message was published,
and what the tick returned. This module joins them per run into the critical path (tick ->
hop -> step -> hop -> next tick), averages the phases under load, and counts tick outcomes
and recomputes.

The functions that take a directory wait 0.3 s first: the last records are written as the
tasks return.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from common import STEPS, log

TICK_PHASES = (
    "tx_begin",
    "load_tick",
    "compute_tick",
    "commit_tick",
    "tx_end",
    "send",
    "delete_outbox",
)
STEP_PHASES = ("claim", "fn", "finish", "wake", "nested_tick")


def read_timer_records(directory: Path) -> list[dict[str, Any]]:
    records = []
    for path in directory.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                records.append(json.loads(line))
    return records


def tick_results_since(directory: Path, since: float) -> dict[str, int]:
    """What each tick that started at or after ``since`` returned, counted (no wait)."""
    after: dict[str, int] = {}
    for r in read_timer_records(directory):
        if r["k"] == "tick" and r["start"] >= since:
            after[str(r.get("result"))] = after.get(str(r.get("result")), 0) + 1
    return after


def tick_stats(directory: Path, since: float, until: float) -> dict[str, Any]:
    """What the ticks that started in [since, until] did, from every worker's timer lines
    (coordinators and, for eager ticks, step workers): outcomes and recomputes."""
    time.sleep(0.3)  # the last records are written as the tasks return
    ticks = [
        r
        for r in read_timer_records(directory)
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


def latency_breakdown(
    directory: Path | None, runs: list[tuple[str, float, float]]
) -> dict[str, Any] | None:
    """Critical path of the sequential runs ``(run_id, wall start, wall end)``, from the
    workers' phase timers (wall clock); None without timers or with incomplete records."""
    if directory is None:
        return None
    try:
        time.sleep(0.3)  # the last records are written as the tasks return
        return join_runs(read_timer_records(directory), runs)
    except (KeyError, ValueError, statistics.StatisticsError) as exc:
        log(f"no latency breakdown (timer records incomplete: {exc!r})")
        return None


def join_runs(
    records: list[dict[str, Any]], runs: list[tuple[str, float, float]]
) -> dict[str, Any] | None:
    """The critical path of each run, joined from its ticks' and steps' records: mean ms per
    segment per run, what each tick and step spends after its publish, publishes per call,
    mean phases. A run with an extra (sweeper) tick or a lost record is left out."""
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
    inline_steps = 0
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
            if step.get("inline"):
                # Claimed in this tick's commit and run in the same process: no message. The
                # tick's commit writes the outcome of the step before (it carries it).
                parts["inline tick: load + compute + commit (outcome before, claim)"].append(
                    tick["end"] - tick["start"]
                )
                parts["tick returns -> inline step begins (no message)"].append(
                    step["start"] - tick["end"]
                )
                parts["inline step: fn + outcome kept, up to its eager tick"].append(
                    nxt["start"] - step["start"]
                )
                off_path["inline step after its eager tick"].append(step["end"] - nxt["end"])
                eager_ticks += 1
                inline_steps += 1
                continue
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
                parts["step: claim + fn + finish + publish wake-up"].append(s_pub - step["start"])
                parts["hop: wake-up message -> next tick begins"].append(nxt["start"] - s_pub)
                off_path["step after its publish (sent event)"].append(step["end"] - s_pub)
            off_path["tick after its publish (sent event, outbox delete)"].append(
                tick["end"] - t_pub
            )
        last = rt[-1]
        parts["last tick: load + compute + commit"].append(last["commit_tick_end"] - last["start"])
        parts["commit (NOTIFY) -> wait() returns"].append(w1 - last["commit_tick_end"])
        publishes["tick"].extend(t.get("publishes", 0) for t in rt[:-1])
        publishes["step"].extend(x.get("publishes", 0) for x in rs)
        for t in rt:
            for ph in TICK_PHASES:
                tick_phases[ph].append(t.get(ph, 0.0))
            tick_phases["total"].append(t["total"])
        for s in rs:
            for ph in STEP_PHASES:
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
        "inline_steps_per_run": round(inline_steps / runs_used, 2),
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


def throughput_phase_costs(
    directory: Path | None, since: float, until: float
) -> dict[str, Any] | None:
    """Mean tick and step phases during the throughput phase (CPU contention included)."""
    if directory is None:
        return None
    time.sleep(0.3)
    records = [r for r in read_timer_records(directory) if since <= r["start"] <= until]
    out: dict[str, Any] = {}
    for kind, phases in (("tick", TICK_PHASES), ("step", STEP_PHASES)):
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
