"""The printed report, with rich: the phase plan, the summary against the targets, tick
outcomes, memory, scatter runs, where a run's time goes, CPU by process, SQL, cProfile.

Everything here reads the results dict (``results.json``'s content) and prints; nothing is
measured or computed that the JSON does not hold. On a terminal the tables fit its width;
into a file or a pipe no row is wrapped, so a row stays one line for ``grep``.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from common import dig, log
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text
from targets import TARGET_RECOMPUTE_PCT

#: The console width when stdout is not a terminal: wide enough that no table row wraps.
FILE_WIDTH = 400


def console() -> Console:
    """A console on the current stdout. Nothing in the text is rich markup (SQL and Python
    reprs have brackets), so markup, emoji codes and highlighting are off."""
    out = Console(markup=False, emoji=False, highlight=False)
    if not out.is_terminal:
        out = Console(markup=False, emoji=False, highlight=False, width=FILE_WIDTH)
    return out


def table(*names: str, left: Iterable[str] | None = None) -> Table:
    """A table whose ``left`` columns (default: the first, the row labels) are left-aligned
    and may wrap on a narrow terminal; the others are right-aligned figures that never wrap."""
    t = Table(box=box.SIMPLE, pad_edge=False, show_edge=False, header_style="bold")
    lefts = set(names[:1] if left is None else left)
    for name in names:
        if name in lefts:
            t.add_column(name)
        else:
            t.add_column(name, justify="right", no_wrap=True)
    return t


def show(out: Console, t: Table) -> None:
    """Print a table; into a file or a pipe without the padding after each row's last cell."""
    if out.is_terminal:
        out.print(t)
        return
    with out.capture() as captured:
        out.print(t)
    out.file.write("".join(row.rstrip() + "\n" for row in captured.get().splitlines()))
    out.file.flush()


def line(out: Console, text: str, style: str | None = None) -> None:
    """A line of prose, as ``print`` would write it (the terminal wraps it, rich does not)."""
    out.print(Text(text, style=style or ""), soft_wrap=True)


def heading(out: Console, text: str) -> None:
    out.print()
    line(out, text, "bold")


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"


def _pairs(d: dict[str, Any], fmt: str) -> str:
    return ", ".join(f"{k} {v:{fmt}}" for k, v in d.items())


# -- the plan ----------------------------------------------------------------------------------


def print_plan(args: argparse.Namespace, plan: list[tuple[str, float]]) -> None:
    """The phases about to run (``plan.phase_plan``) and their budgets, with the time limit."""
    mode = "default: the sum of the budgets" if args.time_limit_default else "--time-limit"
    log(f"{len(plan)} phases; time limit {args.time_limit:g}s ({mode}):")
    t = table("phase", "budget")
    for name, budget in plan:
        t.add_row(name, f"{budget:.0f}s")
    show(console(), t)


# -- the summary -------------------------------------------------------------------------------

_VERDICT_STYLE = {"MET": "green", "MISSED": "bold red", "n/a": "dim"}


def print_summary(res: dict[str, Any]) -> None:
    out = console()
    rows = res["summary"]
    t = table("figure (raw Celery from the same run)", "ductor", "raw", "ratio", "target", "")
    for r in rows:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        verdict = {True: "MET", False: "MISSED", None: ""}[r["met"]]
        if r["target"] and r["met"] is None:
            verdict = "n/a"
        t.add_row(
            r["figure"],
            _num(r["ductor"]),
            _num(r["raw"]),
            ratio,
            r["target"],
            Text(verdict, style=_VERDICT_STYLE.get(verdict, "")),
        )
    out.print()
    show(out, t)
    judged = [r for r in rows if r["met"] is not None]
    line(
        out,
        f"targets met: {sum(1 for r in judged if r['met'])} of {len(judged)}; ratio = ductor / "
        "raw; growth, seconds and % are ductor's own figure",
    )
    rl, rt = res.get("raw_chain_latency"), res.get("raw_throughput")
    for mode, m in res.get("modes", {}).items():
        one = dig(m, "one_coordinator", "throughput") or {}
        line(
            out,
            f"eager {mode}: {dig(m, 'latency', 'n')} sequential runs; {one.get('runs')} "
            f"concurrent 10-step runs in {one.get('wall_s')} s (1 coordinator)"
            + (
                f", {dig(m, 'two_coordinators', 'throughput', 'wall_s')} s (2 coordinators)"
                if m.get("two_coordinators")
                else ""
            ),
        )
    if rl and rt:
        line(
            out,
            f"raw Celery: {rl['n']} chains one at a time; {rt['tasks']} plain tasks in "
            f"{rt['wall_s']:.2f} s; CPU per task/step: all benchmark processes (/proc)",
        )
    b = res.get("batched_scatter")
    if b and not b.get("available"):
        line(out, f"batched scatter: not available ({b.get('why')})")
    if res["settings"].get("experiment"):
        line(
            out,
            f"WHAT-IF RUN, not the default figures: --experiment "
            f"{' '.join(res['settings']['experiment'])}",
            "bold yellow",
        )


# -- ticks, memory, scatters -------------------------------------------------------------------


def print_ticks(res: dict[str, Any]) -> None:
    entries: list[tuple[str, dict[str, Any]]] = []
    for mode, m in res.get("modes", {}).items():
        for key, n in (("one_coordinator", 1), ("two_coordinators", 2)):
            ts = dig(m, key, "tick_stats")
            if ts:
                entries.append((f"throughput, eager {mode}, {n} coordinator(s)", ts))
    sc = res.get("scatter") or {}
    for d in sc.get("ductor", []):
        if d.get("tick_stats"):
            entries.append((f"scatter {d['items']:,}, eager {sc['eager_ticks']}", d["tick_stats"]))
    b = res.get("batched_scatter") or {}
    if b.get("tick_stats"):
        entries.append(
            (f"batched scatter {b['items']:,}, eager {b['eager_ticks']}", b["tick_stats"])
        )
    if not entries:
        return
    out = console()
    t = table(
        "ticks (every worker process, timer lines)",
        "ticks",
        "coord",
        "eager",
        "busy eager",
        "recomputes",
        "recompute %",
        "outcomes",
        left=["ticks (every worker process, timer lines)", "outcomes"],
    )
    for name, ts in entries:
        pct_text = "-" if ts["recompute_pct"] is None else f"{ts['recompute_pct']:.2f}"
        t.add_row(
            name,
            str(ts["ticks"]),
            str(ts["coordinator_ticks"]),
            str(ts["eager_ticks"]),
            str(ts["busy_eager_ticks"]),
            str(ts["recomputes"]),
            pct_text,
            str(ts["outcomes"]),
        )
    out.print()
    show(out, t)
    eager_on = [ts for name, ts in entries if "eager on" in name or "eager inline" in name]
    if eager_on and not any(ts["eager_ticks"] for ts in eager_on):
        line(
            out,
            "NOTE: eager ticks were on, yet no tick ran in a step worker: the step-worker "
            "hook is not in the package yet (or calls an uninstrumented run_tick)",
            "bold yellow",
        )
    line(
        out,
        f"recompute % = recomputes / ticks that computed (not busy); target under "
        f"{TARGET_RECOMPUTE_PCT:g}% with two coordinators",
    )


def print_memory(res: dict[str, Any]) -> None:
    mem = res.get("memory")
    if not mem:
        return
    out = console()
    heading(
        out,
        f"memory: VmRSS (MB) of every process of each ductor worker, before -> after "
        f"{mem['scatters']} scatters of {mem['items']:,} items in a row "
        f"(eager {mem['eager_ticks']})",
    )

    def mb(before: dict[str, int], after: dict[str, int], key: str) -> str:
        return f"{before.get(key, 0) / 1024:.1f} -> {after.get(key, 0) / 1024:.1f}"

    t = table("worker", "main", "pool processes", "pool", "total", "growth")
    for name, before in mem["rss_before_kb"].items():
        after = mem["rss_after_kb"].get(name, {})
        growth = (after.get("total_kb", 0) / before["total_kb"] - 1) if before["total_kb"] else 0
        t.add_row(
            name,
            mb(before, after, "main_kb"),
            str(before["children"]),
            mb(before, after, "children_kb"),
            mb(before, after, "total_kb"),
            f"{growth:+.1%}",
        )
    show(out, t)
    line(out, f"wall per scatter (s): {', '.join(f'{w:.1f}' for w in mem['wall_s'])}")


def print_scatter_details(res: dict[str, Any]) -> None:
    sc = res.get("scatter") or {}
    ds = list(sc.get("ductor", []))
    if (res.get("batched_scatter") or {}).get("available"):
        ds.append(res["batched_scatter"])
    if not ds:
        return
    out = console()
    heading(out, "scatter runs:")
    t = table(
        "workflow",
        "items",
        "wall s",
        "items/s",
        "coordinator CPU ms/item",
        "ticks committed",
        "run-row state peak bytes",
    )
    for d in ds:
        t.add_row(
            d["workflow"],
            f"{d['items']:,}",
            f"{d['wall_s']:.2f}",
            f"{d['items_per_s']:.1f}",
            f"{d['coordinator_cpu_ms_per_item']:.2f}",
            str(d["ticks_committed"]),
            str(d["run_row_state_bytes_peak"]),
        )
    for g in sc.get("raw_group", []):
        wall = "no results in time" if g["wall_s"] is None else f"{g['wall_s']:.2f}"
        t.add_row("raw Celery group", f"{g['items']:,}", wall, "", "", "", "")
    show(out, t)


# -- where the time goes -----------------------------------------------------------------------


def _phase_table(rows: list[tuple[str, dict[str, float]]]) -> Table:
    """Mean phases of a tick or a step, one row per measurement, one column per phase (the
    union, in the order first seen; blank where a row has none)."""
    names: list[str] = []
    for _, figures in rows:
        names.extend(k for k in figures if k not in names)
    # The count first and the total last, the phases in their order between.
    names.sort(key=lambda k: {"count": -1, "total": 1}.get(k, 0))
    t = table("", *names)
    for label, figures in rows:
        t.add_row(
            label,
            *(
                "" if k not in figures else str(figures[k]) if k == "count" else f"{figures[k]:.3f}"
                for k in names
            ),
        )
    return t


def print_breakdowns(res: dict[str, Any]) -> None:
    out = console()
    for mode, m in res.get("modes", {}).items():
        bd = m.get("latency_breakdown")
        phases: dict[str, list[tuple[str, dict[str, float]]]] = {"tick": [], "step": []}
        if bd:
            heading(
                out,
                f"where a sequential 10-step run's time goes, eager ticks {mode} (mean of "
                f"{bd['runs']} runs, ms; {bd['eager_ticks_per_run']} eager ticks and "
                f"{bd.get('inline_steps_per_run', 0)} inline steps per run):",
            )
            t = table("segment", "ms")
            t.show_footer = True
            t.columns[0].footer = "sum"
            t.columns[1].footer = f"{bd['per_run_total_ms']:.2f}"
            for name, ms in bd["per_run_ms"].items():
                t.add_row(name, f"{ms:.2f}")
            show(out, t)
            line(
                out,
                "  not on the critical path (mean ms per call): "
                + _pairs(bd["off_critical_path_mean_ms"], ".2f"),
            )
            line(
                out,
                "  broker publishes per call (task messages + task-sent events): "
                + _pairs(bd["broker_publishes_per_call"], "g"),
            )
            phases["tick"].append(("tick phases (mean ms)", bd["tick_phase_mean_ms"]))
            phases["step"].append(("step phases (mean ms)", bd["step_phase_mean_ms"]))
        notes: list[str] = []
        for key, n in (("one_coordinator", 1), ("two_coordinators", 2)):
            phase = m.get(key) or {}
            tp = phase.get("phase_mean_ms")
            if tp:
                for kind in ("tick", "step"):
                    if kind in tp:
                        phases[kind].append(
                            (f"under load (eager {mode}, {n} coord), {kind} (mean ms)", tp[kind])
                        )
                if "coordinator_busy_fraction" in tp:
                    notes.append(
                        f"  under load (eager {mode}, {n} coord): the coordinator process(es) "
                        f"spent {tp['coordinator_busy_fraction']:.0%} of the phase inside ticks "
                        "(summed over processes)"
                    )
            th = phase.get("throughput")
            if th:
                notes.append(
                    f"  coordinator queue when the last run finished (eager {mode}, {n} coord): "
                    f"{th['coordinator_queue_at_finish']} wake-ups, drained in {th['drain_s']} s"
                )
        if not bd and (phases["tick"] or phases["step"]):
            heading(out, f"tick and step phases, eager ticks {mode}:")
        for kind in ("tick", "step"):
            if phases[kind]:
                if bd or kind == "step":
                    out.print()
                show(out, _phase_table(phases[kind]))
        for note in notes:
            line(out, note)


# -- CPU, SQL, cProfile ------------------------------------------------------------------------


def print_cpu(res: dict[str, Any]) -> None:
    cpus = res.get("cpu")
    if not cpus:
        return
    out = console()
    heading(out, "CPU time of all processes per unit of work (ms; from /proc, 10 ms ticks):")
    by = "by process (ms per unit)"
    t = table("phase", "ms per unit", "cores busy", by, left=["phase", by])
    for name, c in cpus.items():
        parts = ", ".join(f"{k} {v:g}" for k, v in c["by_process_ms_per_unit"].items() if v >= 0.05)
        t.add_row(
            name, f"{c['cpu_ms_per_unit']:.2f} ms/{c['unit']}", f"{c['cores_busy']:.2f}", parts
        )
    show(out, t)
    worst = max(c.get("background_cores", 0.0) for c in cpus.values())
    if worst > 0.15:
        line(
            out,
            f"  WARNING: up to {worst:.2f} cores were used by processes outside the "
            "benchmark ('other', not counted per unit): rerun on a quiet machine",
            "bold yellow",
        )


def print_pg_statements(res: dict[str, Any]) -> None:
    pgs = res.get("pg_statements_one_run")
    if not pgs:
        return
    out = console()
    heading(out, "PostgreSQL statements of one 10-step run (log_statement=all):")
    for name, rep in pgs["statements"].items():
        out.print()
        line(out, f"  {name}: {rep['total']} statements ({rep['per_step']} per step)")
        t = table(
            "count", "statement (first 90 characters)", left=["statement (first 90 characters)"]
        )
        for shape, count in list(rep["shapes"].items())[:20]:
            t.add_row(str(count), shape)
        show(out, t)


def print_profile(res: dict[str, Any]) -> None:
    prof = res.get("profile")
    if not prof:
        return
    out = console()
    for kind, rep in prof.items():
        heading(
            out,
            f"cProfile, {kind}: {rep['calls']} calls, "
            f"{rep['wall_per_call_ms_profiled']:.2f} ms/call under the profiler",
        )
        t = table("self time by layer", "ms per call")
        for k, v in list(rep["by_layer_self_ms_per_call"].items())[:8]:
            t.add_row(k, f"{v:.2f}")
        show(out, t)
        for title, rows, key in (
            ("top cumulative", rep["top_cumulative"], "cum_ms_per_call"),
            ("top self", rep["top_self"], "self_ms_per_call"),
        ):
            line(out, f"  {title} (ms per call):")
            t = table("ms per call", "calls per call", "function", left=["function"])
            for row in rows:
                t.add_row(f"{row[key]:.3f}", f"x{row['ncalls_per_call']:g}", row["func"])
            show(out, t)


def print_table(res: dict[str, Any]) -> None:
    print_summary(res)
    print_ticks(res)
    print_memory(res)
    print_scatter_details(res)
    print_breakdowns(res)
    print_cpu(res)
    print_pg_statements(res)
    print_profile(res)
    print_other_load(res)


# -- --repeat ----------------------------------------------------------------------------------


def _fig(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}x" if unit == "x" else f"{v:.2f}"


def print_repeat(res: dict[str, Any]) -> None:
    """``--repeat``: each figure's median over the rounds, its spread and every round's value;
    then each round's other load, and why a peer is missing."""
    from repeat import QUIET_OTHER_CORES, quiet_text

    rep = res["repeat"]
    rounds = rep["rounds"]
    out = console()
    heading(
        out,
        f"{len(rounds)} rounds, ductor (eager ticks {rep['eager_ticks']}) and its baseline "
        "interleaved in each; ratio = ductor / baseline of the same round",
    )
    t = table(
        "figure",
        "median",
        "min..max",
        "each round",
        "ductor, baseline (medians)",
        left=["figure", "each round"],
    )
    for f in rep["figures"]:
        u = f["unit"]
        base = "" if f["baseline_median"] is None else f", {_num(f['baseline_median'])}"
        t.add_row(
            f["figure"],
            _fig(f["median"], u),
            f"{_fig(f['min'], u)}..{_fig(f['max'], u)}",
            " ".join(_fig(v, u) for v in f["rounds"]),
            f"{_num(f['ductor_median'])}{base}",
        )
    show(out, t)
    loads = [r["other_load"] for r in rounds]
    t = table("round", "wall s", "machine cores", "benchmark cores", "other cores", "")
    for i, load in enumerate(loads, 1):
        t.add_row(
            str(i),
            f"{load['wall_s']:.0f}",
            f"{load['machine_cores']:.2f}",
            f"{load['benchmark_cores']:.2f}",
            f"{load['other_cores']:.2f}",
            quiet_text(load),
        )
    heading(out, "the machine's other load (whole machine from /proc/stat minus the benchmark):")
    show(out, t)
    busy = [x["other_cores"] for x in loads if x["other_cores"] > QUIET_OTHER_CORES]
    if busy:
        line(
            out,
            f"NOT A QUIET MACHINE in {len(busy)} of {len(loads)} rounds (up to {max(busy):.2f} "
            f"other cores; the goal is under {QUIET_OTHER_CORES:g})",
            "bold yellow",
        )
    for name in sorted({k for r in rounds for k in r.get("peers", {})}):
        whys = {r["peers"][name].get("why") for r in rounds if not r["peers"][name]["available"]}
        for why in sorted(w for w in whys if w):
            line(out, f"peer {name}: not measured in some rounds ({why})")


def print_other_load(res: dict[str, Any]) -> None:
    from repeat import quiet_text

    load = res.get("other_load")
    if load:
        line(console(), f"the machine's other load over the whole run: {quiet_text(load)}")
