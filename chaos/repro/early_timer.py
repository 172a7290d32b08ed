"""Deterministic reproduction of a timer row that stays overdue: the chaos harness saw runs
waiting for an approval (timeout 600 s) whose ``eec_workflow_timer`` row was minutes in the
past, with ``woken_at`` moving every few seconds.

Cause: the tick commit writes the timer row "only when it must move earlier or go"
(``store/ticks.py:_set_timer``: a row still in the future and no later than the new
``next_wake_at`` is left as it is, "it wakes the run early, a no-op tick that moves it"). But a
tick with nothing to change is a no-op that does not commit (``runtime/tick_task.py``:
``if not payload.changed: return "noop"``), so nothing ever moves the early row. Once it is
due, the sweeper wakes the run every ``REWAKE_AFTER_S`` (5 s) with a no-op tick, until the real
deadline: for an approval with ``timeout=86400`` that is about 17,000 wasted ticks (and
sweeper round trips) a day for every such run.

Here: an event set with a 2 s timeout and an approval with a 600 s timeout wait side by side;
the events arrive (the event set succeeds, its deadline no longer matters), the timer row
stays at the event set's old deadline, and every sweep after it is due finds the run again.

Run: ``.venv/bin/python chaos/repro/early_timer.py`` (private PostgreSQL on 127.0.0.1; exits 1
when it reproduces).
"""

# ruff: noqa: T201

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests")]

from servers import PostgresServer  # noqa: E402


def reproduce(url: str) -> dict[str, object]:
    import sqlalchemy as sa
    from celery import Celery

    from ductor_celery import Ductor, Workflow
    from ductor_celery.runtime import tick_task
    from ductor_celery.store import sweep

    app = Celery("repro_timer", broker="memory://")
    app.conf.update(ductor_database_url=url)
    ductor = Ductor(app)
    wf = Workflow("repro_early_timer")
    wf.event_set("ev", events=["a", "b"], mode="all", timeout=2, on_timeout="continue")
    wf.approval("ok", timeout=600)
    ductor.register(wf)
    rt = ductor.runtime
    engine = sa.create_engine(url)

    def timer() -> object:
        with engine.connect() as conn:
            return conn.execute(
                sa.text("SELECT fire_at FROM eec_workflow_timer WHERE run_id = :r"), {"r": run_id}
            ).scalar_one_or_none()

    run_id = ductor.start("repro_early_timer", workflow_id="repro-timer").run_id
    tick_task.run_tick(rt, run_id)  # both wait: the timer is the event set's deadline
    ductor.signal("repro-timer", "a", 1)
    ductor.signal("repro-timer", "b", 2)
    tick_task.run_tick(rt, run_id)  # the event set succeeds; the approval waits on
    early = timer()
    time.sleep(2.5)  # the event set's old deadline passes
    ticks, wakes = [], 0
    for _ in range(3):
        if run_id in sweep.due_timer_runs(engine, rewake_after=0.0):
            wakes += 1
            ticks.append(tick_task.run_tick(rt, run_id))
        time.sleep(0.2)
    late = timer()
    with engine.connect() as conn:
        deadline = conn.execute(
            sa.text(
                "SELECT state->'nodes'->'ok'->>'deadline' FROM eec_workflow_run WHERE run_id = :r"
            ),
            {"r": run_id},
        ).scalar_one()
    engine.dispose()
    return {
        "timer_after_events": early,
        "timer_after_sweeps": late,
        "ticks": ticks,
        "wakes": wakes,
        "approval_deadline": deadline,
        "overdue_forever": wakes == 3 and late == early and all(t == "noop" for t in ticks),
    }


def main() -> int:
    from ductor_celery.store.migrate import upgrade

    with PostgresServer() as pg:
        pg.create_database("repro")
        url = pg.url("repro")
        upgrade(url)
        found = reproduce(url)
    for key, value in found.items():
        print(f"{key}: {value}")
    if found["overdue_forever"]:
        print(
            "REPRODUCED: the timer row stays at the event set's old deadline; each sweep wakes "
            "the run again and each tick is a no-op that never moves it, until the approval's "
            f"deadline {found['approval_deadline']}"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
