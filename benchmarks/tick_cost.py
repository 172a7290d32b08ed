"""The tick's own cost on a real PostgreSQL, in this process: no broker, no workers.

    PYTHONPATH=. python benchmarks/tick_cost.py [--rounds 5] [--ticks 400] [--prepare-ab]

Starts a throwaway PostgreSQL (tests/servers.py), then, each round:
- committed: ``--ticks`` first ticks of fresh one-step runs (pending -> running: the run
  update, one attempt, two transitions, one outbox row, in the one-statement commit);
- no-op: ``--ticks`` ticks of a finished run (the duplicate wake-up: clear the wake-up row,
  one read, nothing to commit);
- fold: ticks folding a step's result in runs of a six-step chain whose output reads every
  node (each tick reads the finished nodes' outputs, folds one result, starts the next step
  or finishes the run); the claims and finishes between them are not timed.

Step messages are not sent (the dispatcher's ``send`` records them): what is timed is
``run_tick`` from its call to its return. Prints the median per-tick wall time over rounds
and the CPU time this process spent per tick (the Python side of the tick; PostgreSQL's own
time is in the wall figure only; the least of the rounds is the steadiest on a busy machine),
so A/B runs of two checkouts (``PYTHONPATH=<checkout>``) can be compared side by side.
``--prepare-ab``: each round three times, interleaved, with psycopg's server-side prepares on,
off (``ductor_database_prepare = False``), and off through a PgBouncer in transaction pooling
mode (tests/servers.py), the cost of running behind one.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from celery import Celery  # noqa: E402
from servers import PgBouncer, PostgresServer  # noqa: E402

from ductor_celery import Ductor, Workflow  # noqa: E402
from ductor_celery.engine.kinds import DispatchKind  # noqa: E402
from ductor_celery.runtime.tick_task import run_tick  # noqa: E402
from ductor_celery.store import attempts  # noqa: E402
from ductor_celery.store.migrate import upgrade  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ticks", type=int, default=400)
    parser.add_argument(
        "--prepare-ab",
        action="store_true",
        help="each round in three setups, side by side: server-side prepares on, off, and off "
        "through PgBouncer in transaction pooling mode (ductor_database_prepare)",
    )
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        pg = stack.enter_context(PostgresServer())
        pg.create_database("tick_cost")
        url = pg.url("tick_cost")
        upgrade(url)
        setups = {"": (url, True)}
        if args.prepare_ab:
            pooler = stack.enter_context(PgBouncer(pg, pool_size=4))
            setups = {
                "prepare on, ": (url, True),
                "prepare off, ": (url, False),
                "prepare off via PgBouncer, ": (pooler.url("tick_cost"), False),
            }
        benches = {label: _Bench(*setup) for label, setup in setups.items()}
        figures: dict[str, list[tuple[float, float]]] = {
            f"{label}{name}": [] for label in setups for name in ("committed", "no-op", "fold")
        }
        for _ in range(args.rounds):
            for label, bench in benches.items():  # interleaved: the same machine load
                for name, figure in bench.round(args.ticks).items():
                    figures[f"{label}{name}"].append(figure)
        for name, rounds in figures.items():
            wall = statistics.median(w for w, _ in rounds)
            cpu = statistics.median(c for _, c in rounds)
            least = min(c for _, c in rounds)
            sys.stdout.write(
                f"{name} tick: median wall {1000 * wall:.3f} ms, this process's CPU "
                f"{1000 * cpu:.3f} ms (least of the rounds {1000 * least:.3f} ms)\n"
            )


class _Bench:
    """One Ductor on ``url``, prepares on or off, with its finished run for no-op ticks."""

    def __init__(self, url: str, prepare: bool) -> None:
        app = Celery("tick_cost", set_as_current=False)
        app.conf.broker_url = "memory://"
        app.conf.ductor_database_prepare = prepare
        ductor = Ductor(app, database_url=url)
        self.sent: list[Any] = []
        ductor.runtime.dispatcher.send = self.sent.extend  # type: ignore[method-assign,assignment]
        ductor.runtime.dispatcher.wake = lambda run_id: None  # type: ignore[method-assign]
        ductor.runtime.dispatcher.first_tick = lambda run_id: None  # type: ignore[method-assign]
        ductor.step(name="t.one")(lambda ctx: 1)
        wf = Workflow("one")
        wf.step("a", "t.one")
        ductor.register(wf)
        chain = Workflow("chain")
        for i in range(CHAIN):
            chain.step(f"s{i}", "t.one", after=[f"s{i - 1}"] if i else [])
        chain.output({f"s{i}": f"$.nodes.s{i}.output" for i in range(CHAIN)})
        ductor.register(chain)
        self.ductor = ductor
        self.finished = ductor.start("one", input={}).run_id
        ductor.terminate(self.finished)
        for _ in range(20):
            run_tick(ductor.runtime, self.finished)

    def round(self, ticks: int) -> dict[str, tuple[float, float]]:
        """Per-tick wall and CPU of each kind of tick, one round."""
        ductor, rt = self.ductor, self.ductor.runtime
        out = {}
        runs = [ductor.start("one", input={}).run_id for _ in range(ticks)]
        w0, c0 = time.perf_counter(), time.process_time()
        for run_id in runs:
            assert run_tick(rt, run_id) == "committed"
        w1, c1 = time.perf_counter(), time.process_time()
        out["committed"] = ((w1 - w0) / ticks, (c1 - c0) / ticks)
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(ticks):
            assert run_tick(rt, self.finished) == "noop"
        w1, c1 = time.perf_counter(), time.process_time()
        out["no-op"] = ((w1 - w0) / ticks, (c1 - c0) / ticks)
        out["fold"] = _fold_ticks(ductor, self.sent, ticks // CHAIN)
        return out


CHAIN = 6


def _fold_ticks(ductor: Any, sent: list[Any], runs: int) -> tuple[float, float]:
    """Per-tick wall and CPU of the ticks that fold each step of ``runs`` chain runs."""
    rt, engine = ductor.runtime, ductor.runtime.engine()
    ids = [ductor.start("chain", input={}).run_id for _ in range(runs)]
    sent.clear()
    for run_id in ids:
        run_tick(rt, run_id)
    wall = cpu = 0.0
    ticks = 0
    for step in range(CHAIN):
        tokens = [r.payload["token"] for r in sent if r.kind == DispatchKind.STEP]
        sent.clear()
        assert len(tokens) == runs, (step, len(tokens))
        for token in tokens:
            attempts.claim(engine, token, f"w-{token}")
            attempts.finish(engine, token, outcome="succeeded", output={"step": step})
            w0, c0 = time.perf_counter(), time.process_time()
            assert run_tick(rt, token.rsplit(":", 2)[0]) == "committed"
            wall += time.perf_counter() - w0
            cpu += time.process_time() - c0
            ticks += 1
    return wall / ticks, cpu / ticks


if __name__ == "__main__":
    main()
