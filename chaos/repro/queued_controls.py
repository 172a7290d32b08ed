"""Deterministic reproduction of controls left unhandled long after their run finished: the
chaos harness found a run ``succeeded`` with 22 ``resume`` controls still unhandled 45 s later.

Cause: a tick drains one control (``store/load.py:_control``: "the oldest control not handled
yet: one per tick") and never wakes its run for the next one; each control relies on the
wake-up its client sent. When those wake-ups go elsewhere the queue drains at the sweeper's
pace, one control per ``LOST_REWAKE_AFTER_S`` (30 s) after ``LOST_WAKEUP_AFTER_S`` (10 s):

* controls moved to a continue-as-new successor (``store/ticks.py:_insert_successor``): their
  wake-ups woke the predecessor, which is closed;
* wake-ups lost with Redis (restart or outage).

Here: three pauses and a cancel queued on a running run, one tick (as if one wake-up
arrived): one control is handled, the tick's outbox holds no wake-up of its own run, three
stay queued.

Run: ``.venv/bin/python chaos/repro/queued_controls.py`` (exits 1 when it reproduces).
"""

# ruff: noqa: T201

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests")]

from servers import PostgresServer  # noqa: E402


def reproduce(url: str) -> dict[str, object]:
    import sqlalchemy as sa
    from celery import Celery

    from ductor_celery import Ductor, StepContext, Workflow
    from ductor_celery.runtime import tick_task

    app = Celery("repro_controls", broker="memory://")
    app.conf.update(ductor_database_url=url)
    ductor = Ductor(app)

    @ductor.step(name="repro.noop")
    def noop(ctx: StepContext) -> int:
        return 0

    wf = Workflow("repro_queued_controls")
    wf.wait_signal("w", signal="never")
    ductor.register(wf)
    rt = ductor.runtime
    engine = sa.create_engine(url)
    run_id = ductor.start("repro_queued_controls", workflow_id="repro-controls").run_id
    tick_task.run_tick(rt, run_id)
    # Queued as clients whose own tick did not get to them leave them (a control call applies
    # its control before it returns, so the queue is made here row by row).
    from ductor_celery.store.external import insert_control

    for kind in ("pause", "pause", "pause", "cancel"):
        insert_control(rt.engine(), run_id=run_id, kind=kind)
    sent: list[object] = []
    real_send = rt.dispatcher.send
    rt.dispatcher.send = lambda rows: (sent.extend(rows), real_send(rows))[1]
    try:
        outcome = tick_task.run_tick(rt, run_id)  # the one wake-up that arrived
    finally:
        rt.dispatcher.send = real_send
    with engine.connect() as conn:
        left = (
            conn.execute(
                sa.text(
                    "SELECT kind FROM eec_workflow_control"
                    " WHERE run_id = :r AND handled_at IS NULL ORDER BY id"
                ),
                {"r": run_id},
            )
            .scalars()
            .all()
        )
        status = conn.execute(
            sa.text("SELECT status FROM eec_workflow_run WHERE run_id = :r"), {"r": run_id}
        ).scalar_one()
    engine.dispose()
    self_wakes = [
        r
        for r in sent
        if getattr(r, "kind", None) == "wakeup" and getattr(r, "run_id", None) == run_id
    ]
    return {
        "tick": outcome,
        "status": status,
        "unhandled": list(left),
        "self_wakes": len(self_wakes),
        "stranded": bool(left) and not self_wakes,
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
    if found["stranded"]:
        print(
            f"REPRODUCED: the tick handled one control and left {len(found['unhandled'])} "  # type: ignore[arg-type]
            "queued without waking the run for them (each now waits for its own wake-up, or "
            "for the sweeper: 10 s, then one per 30 s)"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
