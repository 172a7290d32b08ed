"""The tick's own cost on a real PostgreSQL, in this process: no broker, no workers.

    PYTHONPATH=. python benchmarks/tick_cost.py [--rounds 5] [--ticks 400]

Starts a throwaway PostgreSQL (tests/servers.py), then, each round:
- committed: ``--ticks`` first ticks of fresh one-step runs (pending -> running: the run
  update, one attempt, two transitions, one outbox row, in the one-statement commit);
- no-op: ``--ticks`` ticks of a finished run (the duplicate wake-up: clear the wake-up row,
  one read, nothing to commit).

Step messages are not sent (the dispatcher's ``send`` records them): what is timed is
``run_tick`` from its call to its return. Prints the median per-tick wall time over rounds,
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
from ductor_celery.runtime.coordinator import run_tick  # noqa: E402
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
        ductor.step(name="t.one")(lambda ctx: 1)
        wf = Workflow("one")
        wf.step("a", "t.one")
        ductor.register(wf)
        rt = ductor.runtime
        finished = ductor.start("one", input={}).run_id
        ductor.terminate(finished)
        for _ in range(20):
            run_tick(rt, finished)
        committed: list[float] = []
        noop: list[float] = []
        for _ in range(args.rounds):
            runs = [ductor.start("one", input={}).run_id for _ in range(args.ticks)]
            t0 = time.perf_counter()
            for run_id in runs:
                assert run_tick(rt, run_id) == "committed"
            committed.append((time.perf_counter() - t0) / args.ticks)
            t0 = time.perf_counter()
            for _ in range(args.ticks):
                assert run_tick(rt, finished) == "noop"
            noop.append((time.perf_counter() - t0) / args.ticks)
        for name, figures in (("committed", committed), ("no-op", noop)):
            rounds = ", ".join(f"{1000 * f:.3f}" for f in figures)
            sys.stdout.write(
                f"{name} tick: median {1000 * statistics.median(figures):.3f} ms "
                f"(rounds: {rounds})\n"
            )


if __name__ == "__main__":
    main()
