"""Issue 10's targets, and the summary rows: every ductor figure beside raw Celery's from the
same run, as a ratio (or ductor's own figure) against its target."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from common import cpu_name, dig

# Issue 10's targets, all ratios against raw Celery from the same run (except the last three).
TARGET_LATENCY_RATIO = 2.0  # 10-step p50 vs a raw 10-task chain
TARGET_THROUGHPUT_RATIO = 0.5  # steps/s vs plain tasks/s
TARGET_CPU_RATIO = 2.0  # CPU ms per step vs per raw task, all processes
TARGET_SCATTER_RATIO = 1.2  # inline scatter wall time vs a raw group of as many tasks
TARGET_GROWTH_SLACK = 1.1  # 1,000 -> 10,000 items: at most 11x the wall time
TARGET_RECOMPUTE_PCT = 1.0  # tick recomputes with two coordinators, % of ticks
TARGET_BATCHED_S = 5.0  # 10,000 items with batch_size=100
TARGET_NOOP_TICK_MS = 1.0  # a duplicate wake-up's whole tick

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


def summarize(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The summary rows of a run's results (``results.json``'s ``summary``), in print order."""
    rows: list[dict[str, Any]] = []
    cpus = res.get("cpu", {})
    raw_p50 = dig(res, "raw_chain_latency", "p50_ms")
    raw_p90 = dig(res, "raw_chain_latency", "p90_ms")
    raw_tps = dig(res, "raw_throughput", "tasks_per_s")
    raw_cpu = dig(cpus, "raw_throughput", "cpu_ms_per_unit")
    raw_chain_cpu = dig(cpus, "raw_chain_latency", "cpu_ms_per_unit")
    for mode, m in res.get("modes", {}).items():
        rows.append(
            _row(
                f"10-step run p50 ms, eager {mode}",
                dig(m, "latency", "p50_ms"),
                raw_p50,
                target=("<=", TARGET_LATENCY_RATIO, "x"),
            )
        )
        rows.append(_row(f"10-step run p90 ms, eager {mode}", dig(m, "latency", "p90_ms"), raw_p90))
        rows.append(
            _row(
                f"no-op tick (duplicate wake-up) ms, eager {mode}",
                dig(m, "noop_tick", "wall_ms_per_tick"),
                None,
                ratio=False,
                target=("<", TARGET_NOOP_TICK_MS, " ms"),
                on="ductor",
            )
        )
        rows.append(
            _row(
                f"CPU ms/step, sequential runs, eager {mode}",
                dig(cpus, cpu_name("ductor_latency", mode), "cpu_ms_per_unit"),
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
                    dig(phase, "throughput", "steps_per_s"),
                    raw_tps,
                    target=(">=", TARGET_THROUGHPUT_RATIO, "x"),
                )
            )
            rows.append(
                _row(
                    f"CPU ms/step vs ms/task, {tag}",
                    dig(cpus, cpu_name("ductor_throughput", mode, n), "cpu_ms_per_unit"),
                    raw_cpu,
                    target=("<=", TARGET_CPU_RATIO, "x"),
                )
            )
            rows.append(
                _row(
                    f"tick recomputes, % of ticks, {tag}",
                    dig(phase, "tick_stats", "recompute_pct"),
                    None,
                    ratio=False,
                    target=("<", TARGET_RECOMPUTE_PCT, "%") if n > 1 else None,
                    on="ductor",
                )
            )
    dbos = dig(res, "peers", "dbos") or {}
    if dbos.get("available"):
        # The package default mode: the last measured.
        mode, m = list(res.get("modes", {}).items())[-1] if res.get("modes") else ("", {})
        rows.append(
            _row(
                f"10-step run p50 ms vs DBOS workflow of 10 steps, eager {mode}",
                dig(m, "latency", "p50_ms"),
                dig(dbos, "latency", "p50_ms"),
            )
        )
        rows.append(
            _row(
                f"steps/s vs DBOS queue steps/s, eager {mode}, 1 coord",
                dig(m, "one_coordinator", "throughput", "steps_per_s"),
                dig(dbos, "queue", "steps_per_s"),
            )
        )
        rows.append(
            _row(
                f"CPU ms/step vs DBOS's (its process + PostgreSQL), eager {mode}",
                dig(cpus, cpu_name("ductor_throughput", mode), "cpu_ms_per_unit"),
                dig(dbos, "queue", "cpu_ms_per_step"),
            )
        )
    sc = res.get("scatter") or {}
    raw_by_n = {g["items"]: g for g in sc.get("raw_group", [])}
    for d in sc.get("ductor", []):
        rows.append(
            _row(
                f"scatter {d['items']:,} items, wall s (eager {sc['eager_ticks']})",
                d["wall_s"],
                dig(raw_by_n.get(d["items"]), "wall_s"),
                target=("<=", TARGET_SCATTER_RATIO, "x"),
            )
        )
    ds = sc.get("ductor", [])
    if len(ds) >= 2:
        small, big = ds[0], ds[-1]
        scale = big["items"] / small["items"]
        raw_small = dig(raw_by_n.get(small["items"]), "wall_s")
        raw_big = dig(raw_by_n.get(big["items"]), "wall_s")
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
                dig(raw_by_n.get(b["items"]), "wall_s"),
                # The target is for 10,000 items; smaller test sizes get no verdict.
                target=("<", TARGET_BATCHED_S, " s") if b["items"] >= 10000 else None,
                on="ductor",
            )
        )
    return rows
