"""Run concurrency: at most ``limit`` open runs per key of a workflow (docs/flow-control.md).

``Workflow(concurrency=RunConcurrency(key, limit, strategy))``. A run of such a workflow is
admitted by its first tick, not by its start: every way a run is born (a client's start, a
schedule, a parent's child, a successor) goes through a first tick, so one place decides.
Each run of the key has one ``eec_run_slot`` row from its first tick to its end:

- ``granted_at`` set: the run holds one of the key's ``limit`` slots (it may run);
- ``granted_at`` NULL: it waits, ``pending``; the commit that ends a holder grants the slot
  to the key's next waiter (higher ``priority`` first, then oldest) and wakes it.

Everything happens inside tick transactions, after the run's row lock, under the key's
advisory lock (PostgreSQL; SQLite serializes writers): ``admit`` in the load of a pending run,
``release`` in the commit that ends a run (the row deleted, slots granted), ``hand_over`` in
the commit that continues a run as new (the successor keeps the slot). A key never has more
than ``limit`` granted rows, except after a redrive, which an operator asks for: the
redriven run is admitted at once and counts against the limit.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..definition.paths import Scope, resolve
from ..definition.spec import RunConcurrencySpec
from ..engine.kinds import AuditSource, ControlKind
from ..engine.status import OPEN_RUN_STATUSES
from .outbox import OutboxRow, insert_outbox, wakeup_intent
from .schema import run_slot, workflow_control, workflow_run

RUN_SLOT_LOCK_NAMESPACE = 0x7273  # "rs"


@dataclass(frozen=True, slots=True)
class Admission:
    admitted: bool
    #: ``cancel_newest``: why the run is refused (the tick cancels it with this message).
    refused: str | None = None
    #: ``cancel_in_progress``: the holder asked to cancel, for the tick to wake.
    wake: tuple[str, ...] = ()


def key_for(workflow: str, spec: RunConcurrencySpec, run_input: Any) -> str:
    """``"<workflow>|<value>"`` of the key path resolved against the run's input."""
    value = resolve(spec.key, Scope(input=run_input, context={}, outputs={}))
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    key = f"{workflow}|{text}"
    if len(key) > 500:
        key = f"{workflow[:300]}|sha256:{hashlib.sha256(text.encode()).hexdigest()}"
    return key


def lock_key(conn: Connection, key: str) -> None:
    if conn.dialect.name == "postgresql":
        conn.execute(
            sa.select(sa.func.pg_advisory_xact_lock(RUN_SLOT_LOCK_NAMESPACE, sa.func.hashtext(key)))
        )


def admit(
    conn: Connection,
    *,
    run_id: str,
    key: str,
    spec: RunConcurrencySpec,
    priority: int,
    now: datetime,
) -> Admission:
    """Whether a pending run may start: it holds a slot, or takes a free one now. Otherwise
    it waits (its row says so), and by ``strategy``: ``cancel_newest`` refuses it,
    ``cancel_in_progress`` asks the key's oldest holder to cancel to make room."""
    mine = conn.execute(
        sa.select(run_slot.c.granted_at).where(run_slot.c.run_id == run_id)
    ).one_or_none()
    if mine is not None and mine.granted_at is not None:
        return Admission(True)
    lock_key(conn, key)
    if mine is None:
        conn.execute(
            sa.insert(run_slot).values(
                run_id=run_id, key=key, priority=priority, created_at=now, granted_at=None
            )
        )
    held = _held(conn, key)
    first = _waiters(conn, key, 1)
    if held < spec.limit and first == [run_id]:
        _grant(conn, [run_id], now)
        return Admission(True)
    if spec.strategy == "cancel_newest":
        return Admission(
            False,
            refused=(
                f"run concurrency: {held} of {spec.limit} runs of key {key!r} already open "
                "(strategy cancel_newest)"
            ),
        )
    if spec.strategy == "cancel_in_progress" and mine is None:
        victim = _cancel_oldest(conn, key, now, run_id)
        return Admission(False, wake=(victim,) if victim is not None else ())
    return Admission(False)


def is_granted(conn: Connection, run_id: str) -> bool:
    return (
        conn.execute(
            sa.select(run_slot.c.granted_at).where(run_slot.c.run_id == run_id)
        ).scalar_one_or_none()
        is not None
    )


def release(conn: Connection, run_id: str, key: str, limit: int, now: datetime) -> list[OutboxRow]:
    """The run ended: its row goes, and free slots go to the key's next waiters (woken)."""
    lock_key(conn, key)
    conn.execute(sa.delete(run_slot).where(run_slot.c.run_id == run_id))
    free = limit - _held(conn, key)
    if free <= 0:
        return []
    chosen = _waiters(conn, key, free)
    if not chosen:
        return []
    _grant(conn, chosen, now)
    return insert_outbox(conn, [wakeup_intent(r) for r in chosen], now)


def hand_over(conn: Connection, run_id: str, successor: str) -> None:
    """Continue-as-new: the successor is the same logical run, and keeps its slot."""
    conn.execute(sa.update(run_slot).where(run_slot.c.run_id == run_id).values(run_id=successor))


def readmit(conn: Connection, run_id: str, key: str, priority: int, now: datetime) -> None:
    """A redriven run runs again at once: it holds a slot (an operator's decision)."""
    lock_key(conn, key)
    conn.execute(sa.delete(run_slot).where(run_slot.c.run_id == run_id))
    conn.execute(
        sa.insert(run_slot).values(
            run_id=run_id, key=key, priority=priority, created_at=now, granted_at=now
        )
    )


def _held(conn: Connection, key: str) -> int:
    return int(
        conn.execute(
            sa.select(sa.func.count())
            .select_from(run_slot)
            .where(run_slot.c.key == key, run_slot.c.granted_at.is_not(None))
        ).scalar_one()
    )


def _waiters(conn: Connection, key: str, limit: int) -> list[str]:
    """The key's next waiters: higher priority first, then in the order they arrived."""
    return list(
        conn.execute(
            sa.select(run_slot.c.run_id)
            .where(run_slot.c.key == key, run_slot.c.granted_at.is_(None))
            .order_by(run_slot.c.priority.desc(), run_slot.c.created_at, run_slot.c.run_id)
            .limit(limit)
        ).scalars()
    )


def _grant(conn: Connection, run_ids: list[str], now: datetime) -> None:
    conn.execute(sa.update(run_slot).where(run_slot.c.run_id.in_(run_ids)).values(granted_at=now))


def _cancel_oldest(conn: Connection, key: str, now: datetime, newcomer: str) -> str | None:
    """Ask the key's oldest holder that is not already being stopped to cancel (a control, as
    an operator's cancel would be), so the newcomer gets its slot when it has ended. Returns
    the run to wake (its tick applies the cancel)."""
    stopping = sa.exists().where(
        workflow_control.c.run_id == run_slot.c.run_id,
        workflow_control.c.kind.in_([ControlKind.CANCEL.value, ControlKind.TERMINATE.value]),
    )
    oldest = conn.execute(
        sa.select(run_slot.c.run_id)
        .join(workflow_run, workflow_run.c.run_id == run_slot.c.run_id)
        .where(
            run_slot.c.key == key,
            run_slot.c.granted_at.is_not(None),
            workflow_run.c.status.in_([s.value for s in OPEN_RUN_STATUSES]),
            ~stopping,
        )
        .order_by(run_slot.c.granted_at, run_slot.c.run_id)
        .limit(1)
    ).scalar_one_or_none()
    if oldest is None:
        return None  # every holder is on its way out already: the newcomer waits for one
    conn.execute(
        sa.insert(workflow_control).values(
            run_id=oldest,
            kind=ControlKind.CANCEL.value,
            reason=f"run concurrency: making room for run {newcomer} (cancel_in_progress)",
            requested_by="ductor",
            source=AuditSource.CONCURRENCY.value,
            has_input=False,
            created_at=now,
        )
    )
    return str(oldest)
