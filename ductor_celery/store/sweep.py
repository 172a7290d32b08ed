"""The sweeper's queries: what needs a nudge because a message was lost or a time came due."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from ..engine.status import RunStatus
from .db import is_postgres
from .outbox import OutboxRow
from .schema import (
    step_attempt,
    workflow_control,
    workflow_outbox,
    workflow_run,
    workflow_signal,
    workflow_timer,
)


def _now(engine: Engine) -> datetime:
    if is_postgres(engine):
        with engine.connect() as conn:
            value = conn.execute(sa.select(sa.func.now())).scalar_one()
        assert isinstance(value, datetime)
        return value
    return datetime.now(UTC)


def due_timer_runs(engine: Engine, *, rewake_after: float, limit: int = 1000) -> list[str]:
    """Runs whose timer is due, marking them woken so the next sweep does not repeat at once."""
    now = _now(engine)
    with engine.begin() as conn:
        rows = (
            conn.execute(
                sa.select(workflow_timer.c.run_id)
                .where(
                    workflow_timer.c.fire_at <= now,
                    sa.or_(
                        workflow_timer.c.woken_at.is_(None),
                        workflow_timer.c.woken_at <= now - timedelta(seconds=rewake_after),
                    ),
                )
                .order_by(workflow_timer.c.fire_at)
                .limit(limit)
            )
            .scalars()
            .all()
        )
        if rows:
            conn.execute(
                sa.update(workflow_timer)
                .where(workflow_timer.c.run_id.in_(rows))
                .values(woken_at=now)
            )
    return list(rows)


def _run_ids(engine: Engine, query: sa.Select[Any], limit: int) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(query.distinct().limit(limit)).scalars())


def _cutoff(engine: Engine, older_than: float) -> datetime:
    return _now(engine) - timedelta(seconds=older_than)


def unfolded_runs(engine: Engine, *, older_than: float, limit: int = 1000) -> list[str]:
    """Runs with finished attempts nobody folded: their wake-up was lost."""
    return _run_ids(
        engine,
        sa.select(step_attempt.c.run_id).where(
            step_attempt.c.finished_at.is_not(None),
            sa.not_(step_attempt.c.folded),
            step_attempt.c.finished_at <= _cutoff(engine, older_than),
        ),
        limit,
    )


def runs_with_unhandled_controls(
    engine: Engine, *, older_than: float, limit: int = 1000
) -> list[str]:
    """Controls a tick never drained: their wake-up was lost."""
    return _run_ids(
        engine,
        sa.select(workflow_control.c.run_id).where(
            workflow_control.c.handled_at.is_(None),
            workflow_control.c.created_at <= _cutoff(engine, older_than),
        ),
        limit,
    )


def runs_with_unapplied_signals(
    engine: Engine, *, older_than: float, limit: int = 1000
) -> list[str]:
    """Open runs holding signals not consumed yet (a lost wake-up, or a node not reached)."""
    return _run_ids(
        engine,
        sa.select(workflow_signal.c.run_id)
        .join(workflow_run, workflow_run.c.run_id == workflow_signal.c.run_id)
        .where(
            workflow_signal.c.applied_at.is_(None),
            workflow_signal.c.created_at <= _cutoff(engine, older_than),
            workflow_run.c.status.in_([RunStatus.RUNNING.value, RunStatus.PENDING.value]),
        ),
        limit,
    )


def pending_runs(engine: Engine, *, older_than: float, limit: int = 1000) -> list[str]:
    """Runs a client inserted that no tick has picked up: the first wake-up was lost."""
    return _run_ids(
        engine,
        sa.select(workflow_run.c.run_id).where(
            workflow_run.c.status == RunStatus.PENDING.value,
            workflow_run.c.created_at <= _cutoff(engine, older_than),
        ),
        limit,
    )


def relay_stale_outbox(
    engine: Engine,
    send: Callable[[list[OutboxRow]], None],
    *,
    older_than: float,
    limit: int = 500,
) -> int:
    """Send outbox rows a dispatcher never sent (it died after commit), oldest first.

    The rows are locked with SKIP LOCKED while they are sent and deleted in the same
    transaction, so two sweepers never take the same batch, and a failed send leaves them in
    place for the next sweep. Returns how many rows were sent.
    """
    cutoff = _now(engine) - timedelta(seconds=older_than)
    with engine.begin() as conn:
        query = (
            sa.select(workflow_outbox)
            .where(workflow_outbox.c.created_at <= cutoff)
            .order_by(workflow_outbox.c.id)
            .limit(limit)
        )
        if is_postgres(engine):
            query = query.with_for_update(skip_locked=True)
        rows = [
            OutboxRow(
                id=r.id, run_id=r.run_id, kind=r.kind, task=r.task, queue=r.queue, payload=r.payload
            )
            for r in conn.execute(query)
        ]
        if not rows:
            return 0
        send(rows)
        conn.execute(
            sa.delete(workflow_outbox).where(workflow_outbox.c.id.in_([r.id for r in rows]))
        )
    return len(rows)
