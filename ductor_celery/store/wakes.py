"""Coalesced wake-ups from step workers: one queued tick per run is enough.

A worker that finished an attempt must make sure a tick will see its result. It commits the
result first, then ``request_wake``: if a wake-up of the run is already queued and its tick has
not started, that tick will read the result, so no message is sent. The coordinator calls
``clear_wake`` (committed on its own) before it loads the run, so any result committed before
a worker found the row is visible to that tick's load.

The ordering argument, case by case:
- the worker's upsert finds the row: the tick that will delete it has not deleted it yet, so
  it loads after the worker's result was committed, and folds it;
- the tick deleted the row first: the upsert inserts a new one and the worker sends a wake-up;
- a row older than ``STALE_AFTER_S`` (its message was lost, e.g. a broker restart) is treated
  as absent, so a lost wake-up costs seconds, not a stalled run (the sweeper's lost-wake-up
  scan is the backstop behind that).

SQLite (the embedded single-process default) does not coalesce: every result wakes its run.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Engine

from .db import autocommit, is_postgres
from .schema import workflow_wake

STALE_AFTER_S = 5.0


def request_wake(engine: Engine, run_id: str) -> bool:
    """Record that the run needs a tick. True: the caller must send the wake-up message."""
    if not is_postgres(engine):
        return True
    now = sa.func.now()
    stale = workflow_wake.c.requested_at < now - sa.text(f"interval '{STALE_AFTER_S} seconds'")
    insert = pg_insert(workflow_wake).values(run_id=run_id, requested_at=now)
    stmt = insert.on_conflict_do_update(
        index_elements=[workflow_wake.c.run_id],
        set_={"requested_at": sa.case((stale, now), else_=workflow_wake.c.requested_at)},
    ).returning(
        # inserted (xmax = 0) or refreshed from stale (requested_at is this transaction's now)
        sa.or_(sa.text("xmax = 0"), workflow_wake.c.requested_at == now)
    )
    with autocommit(engine) as conn:
        return bool(conn.execute(stmt).scalar_one())


def clear_wake(engine: Engine, run_id: str) -> None:
    """A tick of the run starts now: later results need a wake-up of their own."""
    if not is_postgres(engine):
        return
    with autocommit(engine) as conn:
        conn.execute(sa.delete(workflow_wake).where(workflow_wake.c.run_id == run_id))
