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
``release`` in the commit that ends a run or continues it as new (the row deleted under the
key it was stored with, slots granted; a successor is admitted by its own first tick, under
its own key), ``readmit`` in the commit of a redrive. A key never has more than ``limit``
granted rows, except after a redrive, which an operator asks for: the redriven run is
admitted at once and counts against the limit. The sweeper releases rows whose run ended or
is gone (``reap``), a backstop. Commits take these locks before lease locks, as the
admission in a load does (``lock_for_commit``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..definition.paths import Scope, resolve
from ..definition.spec import RunConcurrencySpec
from ..engine.kinds import AuditSource, ControlKind
from ..engine.slots import scoped_key
from ..engine.status import OPEN_RUN_STATUSES
from .dialect import dialect_of
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
    """``"<workflow>|<value>"`` of the key path resolved against the run's input, shaped as
    lease and rate keys are (``engine.slots.scoped_key``)."""
    return scoped_key(workflow, resolve(spec.key, Scope(input=run_input, context={}, outputs={})))


def lock_key(conn: Connection, key: str) -> None:
    dialect_of(conn).advisory_lock(conn, RUN_SLOT_LOCK_NAMESPACE, key)


def admit(
    conn: Connection,
    *,
    run_id: str,
    key: str,
    spec: RunConcurrencySpec,
    priority: int,
    now: datetime,
) -> Admission:
    """Whether a pending run may start: it holds a slot, or its place in line comes up now.
    Otherwise it waits (its row says so), and by ``strategy``: ``cancel_newest`` refuses it,
    ``cancel_in_progress`` asks the key's oldest holder to cancel to make room."""
    # The key's lock first: a release (the end of a holder) may grant this run's row at any
    # moment before it, and what follows must see the row as it stands.
    lock_key(conn, key)
    mine = conn.execute(
        sa.select(run_slot.c.granted_at).where(run_slot.c.run_id == run_id)
    ).one_or_none()
    if mine is not None and mine.granted_at is not None:
        return Admission(True)
    if mine is None:
        conn.execute(
            sa.insert(run_slot).values(
                run_id=run_id,
                key=key,
                slot_limit=spec.limit,
                priority=priority,
                created_at=now,
                granted_at=None,
            )
        )
    # Free slots go to the line in its order, this run or not: a run ahead of it (of a higher
    # priority, or left waiting by a limit raised in a newer version) is granted and woken
    # here rather than left for a release.
    granted = _grant_in_order(conn, key, now)
    wake = tuple(r for r in granted if r != run_id)
    if run_id in granted:
        return Admission(True, wake=wake)
    if spec.strategy == "cancel_newest":
        refused = (
            f"run concurrency: {_held(conn, key)} of {spec.limit} runs of key {key!r} already "
            "open (strategy cancel_newest)"
        )
        return Admission(False, refused=refused, wake=wake)
    if spec.strategy == "cancel_in_progress" and mine is None:
        victim = _cancel_oldest(conn, key, now, run_id)
        if victim is not None:
            wake += (victim,)
    return Admission(False, wake=wake)


def is_granted(conn: Connection, run_id: str) -> bool:
    return (
        conn.execute(
            sa.select(run_slot.c.granted_at).where(run_slot.c.run_id == run_id)
        ).scalar_one_or_none()
        is not None
    )


def stored_key(conn: Connection, run_id: str) -> str | None:
    """The key the run's row is in line or holds a slot under (None: it has no row)."""
    return conn.execute(
        sa.select(run_slot.c.key).where(run_slot.c.run_id == run_id)
    ).scalar_one_or_none()


def release(conn: Connection, run_id: str, now: datetime) -> list[OutboxRow]:
    """The run ended (or continued as new): its row goes, under the key it was stored with,
    and free slots go to that key's line (woken). A successor is admitted by its own first
    tick, under the key its own input and definition give."""
    key = stored_key(conn, run_id)
    if key is None:
        return []
    lock_key(conn, key)
    conn.execute(sa.delete(run_slot).where(run_slot.c.run_id == run_id))
    granted = _grant_in_order(conn, key, now)
    return insert_outbox(conn, [wakeup_intent(r) for r in granted], now)


def readmit(
    conn: Connection, run_id: str, key: str, limit: int, priority: int, now: datetime
) -> list[OutboxRow]:
    """A redriven run runs again at once: it holds a slot of the key its (new) input gives
    (an operator's decision); a row it still had elsewhere is released."""
    outbox = release(conn, run_id, now)
    lock_key(conn, key)
    conn.execute(
        sa.insert(run_slot).values(
            run_id=run_id,
            key=key,
            slot_limit=limit,
            priority=priority,
            created_at=now,
            granted_at=now,
        )
    )
    return outbox


def lock_for_commit(conn: Connection, run_id: str, key: str | None) -> None:
    """Take the run-slot locks a commit will need before any other lock of the commit (lease
    keys): the admission in a load takes this lock first too, so the order is the same in
    every writer."""
    for k in sorted({k for k in (stored_key(conn, run_id), key) if k is not None}):
        lock_key(conn, k)


def reap(conn: Connection, now: datetime, limit: int = 100) -> list[OutboxRow]:
    """The sweeper's backstop: rows of runs that have ended or are gone (a run ended by a
    version of ductor without this table's rules, a row changed by hand) are released, and
    their keys' lines move."""
    ended = conn.execute(
        sa.select(run_slot.c.run_id)
        .outerjoin(workflow_run, workflow_run.c.run_id == run_slot.c.run_id)
        .where(
            sa.or_(
                workflow_run.c.run_id.is_(None),
                workflow_run.c.status.not_in([s.value for s in OPEN_RUN_STATUSES]),
            )
        )
        .limit(limit)
    ).scalars()
    outbox: list[OutboxRow] = []
    for run_id in list(ended):
        outbox += release(conn, run_id, now)
    return outbox


def _held(conn: Connection, key: str) -> int:
    return int(
        conn.execute(
            sa.select(sa.func.count())
            .select_from(run_slot)
            .where(run_slot.c.key == key, run_slot.c.granted_at.is_not(None))
        ).scalar_one()
    )


#: How many waiters one grant looks at: more than any sane limit frees at once.
_WAITERS_PER_GRANT = 256


def _grant_in_order(conn: Connection, key: str, now: datetime) -> list[str]:
    """Grant the key's free slots to its line in order (higher priority first, then arrival),
    each while fewer runs hold a slot than the limit its own definition declared; the first
    that cannot have one stops the line (nobody overtakes it). Returns the runs granted."""
    held = _held(conn, key)
    waiters = conn.execute(
        sa.select(run_slot.c.run_id, run_slot.c.slot_limit)
        .where(run_slot.c.key == key, run_slot.c.granted_at.is_(None))
        .order_by(run_slot.c.priority.desc(), run_slot.c.id)
        .limit(_WAITERS_PER_GRANT)
    ).all()
    granted: list[str] = []
    for w in waiters:
        if held >= (w.slot_limit or 1):
            break
        granted.append(w.run_id)
        held += 1
    if granted:
        conn.execute(
            sa.update(run_slot).where(run_slot.c.run_id.in_(granted)).values(granted_at=now)
        )
    return granted


def _cancel_oldest(conn: Connection, key: str, now: datetime, newcomer: str) -> str | None:
    """Ask the key's oldest holder that is not already being stopped to cancel (a control, as
    an operator's cancel would be), so the newcomer gets its slot when it has ended. Returns
    the run to wake (its tick applies the cancel)."""
    # On its way out: a cancel or terminate asked since it got its slot (one from before a
    # redrive does not count).
    stopping = sa.exists().where(
        workflow_control.c.run_id == run_slot.c.run_id,
        workflow_control.c.kind.in_([ControlKind.CANCEL.value, ControlKind.TERMINATE.value]),
        workflow_control.c.created_at >= run_slot.c.granted_at,
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
        .order_by(run_slot.c.granted_at, run_slot.c.id)
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
