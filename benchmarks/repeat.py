"""``run.py --repeat N``: N rounds of issue 29's figures, ductor and raw Celery (and the peers)
interleaved round by round on the same servers and workers, each figure's ratio reported as
the median over the rounds with its min..max spread and every round's value.

A round is: ductor's 10-step latency, no-op tick and throughput (one coordinator, the last of
``--eager-modes``: the package default unless asked), raw Celery's chain latency and
throughput, each scatter size (ductor, then a raw group), the batched scatter, then each
peer. During each round ``cpu.OtherLoad`` measures the machine's other load: CPU the whole
machine spent minus what the benchmark's own process trees spent, in cores; a round over
``QUIET_OTHER_CORES`` is said to have run on a machine that was not quiet.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import cpu
from common import cpu_name, dig, log
from ductor_phases import ductor_mode_phases
from harness import Bench
from peers import DbosPeer
from raw_phases import raw_phases
from scatters import batched_scatter, scatter_phases

#: Above this many cores of other load, a round ran on a machine that was not quiet (issue 29).
QUIET_OTHER_CORES = 0.1


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _scatter(res: dict[str, Any], n: int) -> tuple[float | None, float | None]:
    sc = res.get("scatter") or {}
    d = next((x for x in sc.get("ductor", []) if x["items"] == n), None)
    g = next((x for x in sc.get("raw_group", []) if x["items"] == n), None)
    return dig(d, "wall_s"), dig(g, "wall_s")


def figure_specs(mode: str, sizes: list[int]) -> list[tuple[str, str, Callable[..., Any]]]:
    """(figure, unit, read) per figure: ``read(round results)`` -> (ductor, baseline, value),
    where value is ductor / baseline for a ratio, ductor's own figure otherwise."""
    lat = ("modes", mode, "latency", "p50_ms")
    tput = ("modes", mode, "one_coordinator", "throughput", "steps_per_s")
    cpu_load = ("cpu", cpu_name("ductor_throughput", mode), "cpu_ms_per_unit")

    def pair(a: tuple[str, ...], b: tuple[str, ...]) -> Callable[..., Any]:
        def read(r: dict[str, Any]) -> tuple[Any, Any, Any]:
            x, y = dig(r, *a), dig(r, *b)
            return x, y, _ratio(x, y)

        return read

    def noop(r: dict[str, Any]) -> tuple[Any, Any, Any]:
        ms = dig(r, "modes", mode, "noop_tick", "wall_ms_per_tick")
        return ms, None, ms

    specs: list[tuple[str, str, Callable[..., Any]]] = [
        ("10-step run p50 / raw chain of 10", "x", pair(lat, ("raw_chain_latency", "p50_ms"))),
        (
            "steps/s, concurrent 10-step runs / raw tasks/s",
            "x",
            pair(tput, ("raw_throughput", "tasks_per_s")),
        ),
        (
            "CPU per step under that load / per raw task",
            "x",
            pair(cpu_load, ("cpu", "raw_throughput", "cpu_ms_per_unit")),
        ),
        ("no-op tick (duplicate wake-up), ms", "ms", noop),
    ]
    for n in sizes:
        specs.append(
            (
                f"scatter of {n:,} no-op items / raw group",
                "x",
                lambda r, n=n: (*_scatter(r, n), _ratio(*_scatter(r, n))),
            )
        )

    def batched(r: dict[str, Any]) -> tuple[Any, Any, Any]:
        b = r.get("batched_scatter") or {}
        return b.get("wall_s"), None, b.get("wall_s")

    def batched_vs_group(r: dict[str, Any]) -> tuple[Any, Any, Any]:
        b = r.get("batched_scatter") or {}
        raw = _scatter(r, b["items"])[1] if b.get("items") else None
        return b.get("wall_s"), raw, _ratio(b.get("wall_s"), raw)

    specs.append(("batched scatter, s", "s", batched))
    specs.append(("batched scatter / raw group of as many items", "x", batched_vs_group))
    dbos = ("peers", "dbos")
    specs += [
        (
            "10-step run p50 / DBOS workflow of 10 steps",
            "x",
            pair(lat, (*dbos, "latency", "p50_ms")),
        ),
        ("steps/s / DBOS queue steps/s", "x", pair(tput, (*dbos, "queue", "steps_per_s"))),
        (
            "CPU per step under load / DBOS's (its process + PostgreSQL)",
            "x",
            pair(cpu_load, (*dbos, "queue", "cpu_ms_per_step")),
        ),
    ]
    return specs


def run_rounds(bench: Bench) -> dict[str, Any]:
    """Set up once, then ``--repeat`` rounds; the results of every round and the table."""
    args = bench.args
    bench.setup()
    mode = args.eager_modes[-1]
    bench.use_mode(mode)
    workers = bench.results["workers"]
    peers: dict[str, DbosPeer | dict[str, Any]] = {}
    if "dbos" in args.peers:
        peers["dbos"] = DbosPeer.start(bench)
    rounds: list[dict[str, Any]] = []
    for i in range(args.repeat):
        log(f"=== round {i + 1} of {args.repeat} ===")
        bench.results = {"modes": {}, "workers": workers}
        load = cpu.OtherLoad(bench.roots())
        ductor_mode_phases(bench, mode)
        raw_phases(bench)
        scatter_phases(bench)
        batched_scatter(bench)
        for name, peer in peers.items():
            result = peer.measure() if isinstance(peer, DbosPeer) else peer
            bench.results.setdefault("peers", {})[name] = result
        bench.results["other_load"] = load.result()
        rounds.append(bench.results)
        log(f"round {i + 1}: {quiet_text(bench.results['other_load'])}")
    specs = figure_specs(mode, sorted({n for n in args.scatter_sizes if n > 0}))
    return {"eager_ticks": mode, "rounds": rounds, "figures": summarize_rounds(rounds, specs)}


def quiet_text(load: dict[str, float]) -> str:
    other = load["other_cores"]
    if other > QUIET_OTHER_CORES:
        return f"not a quiet machine: {other:.2f} other cores"
    return f"quiet: {other:.2f} other cores"


def summarize_rounds(
    rounds: list[dict[str, Any]], specs: list[tuple[str, str, Callable[..., Any]]]
) -> list[dict[str, Any]]:
    """Per figure: every round's value, their median and min..max, and the medians of
    ductor's own figure and of the baseline. A figure no round has is left out."""
    out = []
    for figure, unit, read in specs:
        triples = []
        for r in rounds:
            try:
                triples.append(read(r))
            except (KeyError, TypeError):
                triples.append((None, None, None))
        values = [v for _, _, v in triples if v is not None]
        if not values:
            continue
        ductor = [d for d, _, _ in triples if d is not None]
        base = [b for _, b, _ in triples if b is not None]
        out.append(
            {
                "figure": figure,
                "unit": unit,
                "median": round(statistics.median(values), 3),
                "min": round(min(values), 3),
                "max": round(max(values), 3),
                "rounds": [None if v is None else round(v, 3) for _, _, v in triples],
                "ductor_median": round(statistics.median(ductor), 3) if ductor else None,
                "baseline_median": round(statistics.median(base), 3) if base else None,
            }
        )
    return out
