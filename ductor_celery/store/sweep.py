"""The sweeper's queries: what needs a nudge because a message was lost or a time came due."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from ..engine.kinds import DispatchKind
from ..engine.status import RunStatus
from . import leases
from .dialect import dialect_of
from .outbox import OutboxRow, delete_outbox
from .schema import (
    concurrency_lease,
    run_slot,
    step_attempt,
    workflow_control,
    workflow_outbox,
    workflow_run,
    workflow_signal,
    workflow_timer,
)


def _now(engine: Engine) -> datetime:
    return dialect_of(engine).db_now(engine)


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
            step_attempt.c.unfolded,
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


def parents_behind_children(engine: Engine, *, older_than: float, limit: int = 1000) -> list[str]:
    """Open parents with a child that committed after the parent's own last commit, a while
    ago: the child's wake-up of its parent (it finished, or passed a checkpoint) may be lost.
    A parent that merely waits on a busy child gets a no-op tick; the caller throttles."""
    child = workflow_run.alias("child")
    return _run_ids(
        engine,
        sa.select(workflow_run.c.run_id)
        .join(child, child.c.parent_run_id == workflow_run.c.run_id)
        .where(
            workflow_run.c.status == RunStatus.RUNNING.value,
            child.c.updated_at > workflow_run.c.updated_at,
            child.c.updated_at <= _cutoff(engine, older_than),
        ),
        limit,
    )


def pending_runs(engine: Engine, *, older_than: float, limit: int = 1000) -> list[str]:
    """Runs a client inserted that no tick has picked up: the first wake-up was lost. A
    delayed run (its timer row still in the future) is not late: its timer wakes it. Nor is a
    run waiting in line for a run-concurrency slot (store/run_slots.py): the end of a holder
    grants it one and wakes it (once granted, a lost wake-up is found here again)."""
    cutoff = _cutoff(engine, older_than)
    delayed = sa.exists().where(
        workflow_timer.c.run_id == workflow_run.c.run_id,
        workflow_timer.c.fire_at > cutoff + timedelta(seconds=older_than),
    )
    in_line = sa.exists().where(
        run_slot.c.run_id == workflow_run.c.run_id, run_slot.c.granted_at.is_(None)
    )
    return _run_ids(
        engine,
        sa.select(workflow_run.c.run_id).where(
            workflow_run.c.status == RunStatus.PENDING.value,
            workflow_run.c.created_at <= cutoff,
            ~delayed,
            ~in_line,
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
        query = dialect_of(engine).lock_rows(query, skip_locked=True)
        rows = [
            OutboxRow(
                id=r.id,
                run_id=r.run_id,
                kind=DispatchKind.parse(r.kind),
                task=r.task,
                queue=r.queue,
                payload=r.payload,
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


def lease_keys_to_sweep(engine: Engine, *, now: datetime, limit: int = 100) -> list[str]:
    """Keys with a lease past its expiry, or with waiting attempts and a free slot.

    One statement. With no leases and no leased attempts open it reads an empty table and an
    empty partial index (``eec_workflow_step_attempt_lease_wait``); with waiters it looks at
    each waiter once. In steady state the second half finds nothing: every release and every
    acquire hands free slots to waiters in the same transaction; it catches limits raised by a
    new workflow version and slots freed by hand.
    """
    expired = sa.select(concurrency_lease.c.key.label("key")).where(
        sa.or_(concurrency_lease.c.expires_at.is_(None), concurrency_lease.c.expires_at <= now)
    )
    held = (
        sa.select(sa.func.count())
        .select_from(concurrency_lease)
        .where(concurrency_lease.c.key == step_attempt.c.lease_key)
        .scalar_subquery()
    )
    starved = sa.select(step_attempt.c.lease_key.label("key")).where(
        step_attempt.c.lease_waiting,
        ~leases.holds_lease(),
        held < sa.func.coalesce(step_attempt.c.lease_limit, 1),
    )
    keys = sa.union(expired, starved).subquery()
    with engine.connect() as conn:
        return sorted(
            conn.execute(sa.select(keys.c.key).order_by(keys.c.key).limit(limit)).scalars()
        )


@dataclass(slots=True)
class LeaseSweep:
    keys: int = 0
    skipped: int = 0  # keys busy under another transaction's lock: looked at next sweep
    released: int = 0
    extended: int = 0
    granted: int = 0
    sent: int = 0
    wake: list[str] = field(default_factory=list)


def reclaim_leases(
    engine: Engine, send: Callable[[list[OutboxRow]], None], *, limit: int = 100
) -> LeaseSweep:
    """The lease backstop: free leases left behind by holders that ended, keep live holders'
    leases alive, grant free slots to waiters (``leases.reclaim_key``), one short transaction
    per key. Step messages are sent after each commit and their outbox rows deleted; a failed
    send leaves them to ``relay_stale_outbox``. The returned ``wake`` lists runs whose open
    holder outlived its lease: the caller wakes them so their tick can time the attempt out.
    """
    now = _now(engine)
    result = LeaseSweep()
    for key in lease_keys_to_sweep(engine, now=now, limit=limit):
        with engine.begin() as conn:
            if not leases.try_lock_key(conn, key):
                result.skipped += 1
                continue
            done = leases.reclaim_key(conn, key, now)
        result.keys += 1
        result.released += len(done.released)
        result.extended += len(done.extended)
        result.granted += done.granted
        result.wake.extend(done.wake)
        if done.outbox:
            send(done.outbox)
            delete_outbox(engine, [r.id for r in done.outbox])
            result.sent += len(done.outbox)
    return result


def timers_due_by(engine: Engine, until: datetime, limit: int = 1000) -> list[tuple[str, datetime]]:
    """Timer rows due at or before ``until``, earliest first, as (run id, fire time): what a
    controlled clock (``ductor_celery.testing``) fires in time order while it advances."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(workflow_timer.c.run_id, workflow_timer.c.fire_at)
            .where(workflow_timer.c.fire_at <= until)
            .order_by(workflow_timer.c.fire_at, workflow_timer.c.run_id)
            .limit(limit)
        ).all()
    return [(r.run_id, _aware(r.fire_at)) for r in rows]


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def next_timer_after(engine: Engine, after: datetime) -> datetime | None:
    """The earliest timer row due later than ``after`` (the test harness's next stop)."""
    with engine.connect() as conn:
        value = conn.execute(
            sa.select(sa.func.min(workflow_timer.c.fire_at)).where(workflow_timer.c.fire_at > after)
        ).scalar_one_or_none()
    return None if value is None else _aware(value)
