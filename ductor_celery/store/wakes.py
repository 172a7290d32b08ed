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

``clear_wake`` also tells the tick whether the run is settled (finished, nothing to fold): a
duplicate wake-up of a finished run then ends there, one indexed read with no lock and no
transaction, instead of the locked load and a compute that finds nothing to do.
"""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Engine

from ..engine.status import TERMINAL_RUN_STATUSES
from . import clock
from .db import autocommit, driver_compiled, driver_cursor
from .dialect import dialect_of
from .load import exists_where
from .schema import step_attempt, workflow_control, workflow_run, workflow_timer, workflow_wake

STALE_AFTER_S = 5.0


def request_wake(engine: Engine, run_id: str) -> bool:
    """Record that the run needs a tick. True: the caller must send the wake-up message."""
    if not dialect_of(engine).dedupes_wakes:
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


def clear_wake(engine: Engine, run_id: str) -> bool:
    """A coordinator tick of the run starts: later results need a wake-up of their own.

    Returns whether the run is settled: finished, with no outcome left to fold, no control to
    handle and no timer row come due, so the tick has nothing to do. One statement, no lock,
    no transaction: a duplicate wake-up of a finished run costs this indexed read alone."""
    if not dialect_of(engine).dedupes_wakes:
        with engine.connect() as conn:
            found = conn.execute(_settled(False), {"b_run": run_id, "b_now": clock.now(engine)})
            return found.first() is not None
    # Straight to psycopg's cursor: the text never changes and the one value is plain, so
    # SQLAlchemy's execution context and result wrapping were most of a duplicate wake-up's
    # CPU (benchmarks/README.md, sixteenth round).
    with autocommit(engine) as conn, driver_cursor(conn) as cursor:
        cursor.execute(_settled_text(), {"b_run": run_id})
        return cursor.fetchone() is not None


@functools.cache
def _settled_text() -> str:
    """``_settled(True)`` as psycopg's text (``%(b_run)s``), compiled once per process."""
    return str(driver_compiled(_settled(True)))


@functools.cache
def _settled(postgres: bool) -> Any:
    """The run if it is settled (``clear_wake``); on PostgreSQL the wake-up row is deleted by
    the same statement (a data-modifying CTE runs whether or not it is read)."""
    run_id = sa.bindparam("b_run", type_=sa.String)
    now = sa.func.now() if postgres else sa.bindparam("b_now", type_=workflow_timer.c.fire_at.type)
    query: Any = sa.select(sa.literal_column("1")).where(
        workflow_run.c.run_id == run_id,
        # The statuses as SQL literals, not an expanding parameter: the statement's text is
        # then fixed, with no per-call rendering of the list (a duplicate wake-up is this read).
        workflow_run.c.status.in_(
            [sa.literal_column(f"'{s.value}'") for s in sorted(TERMINAL_RUN_STATUSES)]
        ),
        ~exists_where(
            step_attempt,
            step_attempt.c.run_id == run_id,
            step_attempt.c.unfolded,  # the partial index's own predicate
        ),
        ~exists_where(
            workflow_control,
            workflow_control.c.run_id == run_id,
            workflow_control.c.handled_at.is_(None),
        ),
        ~exists_where(
            workflow_timer, workflow_timer.c.run_id == run_id, workflow_timer.c.fire_at <= now
        ),
    )
    if postgres:
        query = query.add_cte(
            sa.delete(workflow_wake).where(workflow_wake.c.run_id == run_id).cte("cleared")
        )
    return query
