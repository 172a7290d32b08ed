"""Deterministic reproduction of the bug the chaos checker found as ``applied_once`` ("the
result of X was folded twice (applied, then ignored as stale by a later tick)"), and of a
liveness consequence of the same cause.

Cause: a tick's first statement (``store/load.py:_run_row_statement``) reads the run row
``FOR UPDATE`` *and*, in the same statement, scalar subqueries over other tables: the run's
timer row (``timer_at``), whether it has controls and signals, and (in the working tree as of
this writing) the unfolded results themselves. Under READ COMMITTED, a statement that waits
for the row lock re-reads only the locked row once the holder commits; every subquery keeps
the snapshot the statement started with. So a tick that waited for another tick of the same
run sees the run row as that tick left it, but the attempts, the timer and the inbox as they
were before it:

1. results the other tick folded are handed to the waiting tick again: it logs
   ``stale result ignored (token ...)`` for a result that was applied (history is wrong; an
   extra commit and transitions per occurrence, which also brings the automatic
   continue-as-new closer);
2. ``timer_at`` is the timer row the other tick has just deleted or moved: ``_set_timer``
   then skips writing a timer the run needs (it believes an earlier one exists), and a run
   whose next event is a timer (here a 60 s sleep) is left with no timer row at all: nothing
   ever wakes it again.

Run: ``.venv/bin/python chaos/repro/stale_snapshot.py`` (private PostgreSQL on 127.0.0.1;
prints what it finds, exits 1 when it reproduces either effect).
"""

# ruff: noqa: T201

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests")]

from servers import PostgresServer  # noqa: E402


def reproduce(url: str) -> dict[str, object]:
    """Run the scenario against a migrated, empty database at ``url``; what happened."""
    import sqlalchemy as sa
    from celery import Celery

    from ductor_celery import Ductor, StepContext, Workflow
    from ductor_celery.runtime import tick_task
    from ductor_celery.store import attempts, tick_store

    app = Celery("repro", broker="memory://")
    app.conf.update(ductor_database_url=url)
    ductor = Ductor(app)

    @ductor.step(name="repro.one")
    def one(ctx: StepContext) -> int:
        return 1

    wf = Workflow("repro_stale_snapshot")
    wf.step("s1", one)
    wf.wait_signal("w", signal="go", after=["s1"])  # no timeout: no timer while it waits
    wf.sleep("nap", seconds=60, after=["w"])
    wf.step("s2", one, after=["nap"])
    ductor.register(wf)
    rt = ductor.runtime
    engine = sa.create_engine(url)

    handle = ductor.start("repro_stale_snapshot", workflow_id="repro-1")
    run_id = handle.run_id
    assert tick_task.run_tick(rt, run_id) == "committed"  # s1's attempt (and a timer)
    token = f"{run_id}:s1:1"
    assert attempts.claim(engine, token, "repro-worker") is not None
    attempts.finish(engine, token, outcome="succeeded", output=1)

    # Tick A folds s1 and then holds the run's lock for 1.5 s before it commits.
    # The tick loop's SQL adapter commits through store.tick_store.commit_on.
    original = tick_store.commit_on

    def slow_commit(conn, loaded, payload, claim=None, carried=None):  # type: ignore[no-untyped-def]
        out = original(conn, loaded, payload, claim, carried)
        if threading.current_thread().name == "tick-A":
            time.sleep(1.5)
        return out

    ticks: dict[str, str] = {}
    tick_store.commit_on = slow_commit
    try:
        a = threading.Thread(
            target=lambda: ticks.update(A=tick_task.run_tick(rt, run_id)), name="tick-A"
        )
        a.start()
        time.sleep(0.4)
        # A signal arrives while A holds the lock; tick B (its wake-up) waits for the lock.
        ductor.signal("repro-1", "go", {"ok": True}, idempotency_key="go-1")
        time.sleep(0.2)
        b = threading.Thread(
            target=lambda: ticks.update(B=tick_task.run_tick(rt, run_id)), name="tick-B"
        )
        b.start()
        a.join()
        b.join()
    finally:
        tick_store.commit_on = original

    with engine.connect() as conn:
        log = [
            tuple(r)
            for r in conn.execute(
                sa.text(
                    "SELECT seq, node, from_status, to_status, reason FROM eec_workflow_history "
                    "WHERE run_id = :r ORDER BY seq"
                ),
                {"r": run_id},
            )
        ]
        timer = conn.execute(
            sa.text("SELECT fire_at FROM eec_workflow_timer WHERE run_id = :r"), {"r": run_id}
        ).scalar_one_or_none()
        state = conn.execute(
            sa.text("SELECT eec_run_state(state, run_id) FROM eec_workflow_run WHERE run_id = :r"),
            {"r": run_id},
        ).scalar_one()
    engine.dispose()
    nap = state["nodes"]["nap"]
    return {
        "ticks": ticks,
        "log": log,
        "token": token,
        "nap": nap,
        "timer": timer,
        # s1's result was applied by A and handed to B again, which logged it as stale
        "double_fold": any("stale result ignored" in r[4] and token in r[4] for r in log),
        # the run sleeps (deadline in the state) but has no timer row: nothing wakes it
        "lost_timer": nap.get("status") == "waiting" and timer is None,
    }


def main() -> int:
    from ductor_celery.store.migrate import upgrade

    with PostgresServer() as pg:
        pg.create_database("repro")
        url = pg.url("repro")
        upgrade(url)
        found = reproduce(url)
    print("ticks:", found["ticks"])
    for row in found["log"]:  # type: ignore[attr-defined]
        print("  ", row)
    nap = found["nap"]
    print(
        "nap:",
        nap.get("status"),
        "deadline",
        nap.get("deadline"),  # type: ignore[union-attr]
        "| timer row:",
        found["timer"],
    )
    if found["double_fold"]:
        print(
            f"REPRODUCED: {found['token']} was applied by tick A and handed again to tick B, "
            "which logged it as a stale result"
        )
    if found["lost_timer"]:
        print(
            "REPRODUCED: the run sleeps until",
            nap.get("deadline"),  # type: ignore[union-attr]
            "but has no timer row: nothing will ever wake it (tick B read the timer row "
            "tick A deleted)",
        )
    return 1 if (found["double_fold"] or found["lost_timer"]) else 0


if __name__ == "__main__":
    sys.exit(main())
