"""The tick's own cost on a real PostgreSQL, in this process: no broker, no workers.

    PYTHONPATH=. python benchmarks/tick_cost.py [--rounds 5] [--ticks 400]

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
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from celery import Celery  # noqa: E402
from servers import PostgresServer  # noqa: E402

from ductor_celery import Ductor, Workflow  # noqa: E402
from ductor_celery.engine.kinds import DispatchKind  # noqa: E402
from ductor_celery.runtime.coordinator import run_tick  # noqa: E402
from ductor_celery.store import attempts  # noqa: E402
from ductor_celery.store.migrate import upgrade  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ticks", type=int, default=400)
    args = parser.parse_args()
    with PostgresServer() as pg:
        pg.create_database("tick_cost")
        url = pg.url("tick_cost")
        upgrade(url)
        app = Celery("tick_cost", set_as_current=False)
        app.conf.broker_url = "memory://"
        ductor = Ductor(app, database_url=url)
        sent: list[Any] = []
        ductor.runtime.dispatcher.send = sent.extend  # type: ignore[method-assign]
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
        rt = ductor.runtime
        finished = ductor.start("one", input={}).run_id
        ductor.terminate(finished)
        for _ in range(20):
            run_tick(rt, finished)
        figures: dict[str, list[tuple[float, float]]] = {"committed": [], "no-op": [], "fold": []}
        for _ in range(args.rounds):
            runs = [ductor.start("one", input={}).run_id for _ in range(args.ticks)]
            w0, c0 = time.perf_counter(), time.process_time()
            for run_id in runs:
                assert run_tick(rt, run_id) == "committed"
            w1, c1 = time.perf_counter(), time.process_time()
            figures["committed"].append(((w1 - w0) / args.ticks, (c1 - c0) / args.ticks))
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.ticks):
                assert run_tick(rt, finished) == "noop"
            w1, c1 = time.perf_counter(), time.process_time()
            figures["no-op"].append(((w1 - w0) / args.ticks, (c1 - c0) / args.ticks))
            figures["fold"].append(_fold_ticks(ductor, sent, args.ticks // CHAIN))
        for name, rounds in figures.items():
            wall = statistics.median(w for w, _ in rounds)
            cpu = statistics.median(c for _, c in rounds)
            least = min(c for _, c in rounds)
            sys.stdout.write(
                f"{name} tick: median wall {1000 * wall:.3f} ms, this process's CPU "
                f"{1000 * cpu:.3f} ms (least of the rounds {1000 * least:.3f} ms)\n"
            )


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
