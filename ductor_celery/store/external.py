"""Clients' writes of external input: signals (approvals are signals) and operator controls.

Clients only insert; the coordinator marks rows applied or handled in its commit.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from ..engine.kinds import AuditAction, ControlKind
from ..engine.status import OPEN_RUN_STATUSES, RunStatus
from ..errors import InvalidOperation
from . import audit, blobs
from .dialect import dialect_of
from .schema import workflow_control, workflow_run, workflow_signal
from .start_requests import RequestKey, request_insert
from .start_requests import find_on as find_request

#: First key of the advisory locks that order one workflow id's signals ("ductor" in ASCII-ish).
SIGNAL_LOCK_NAMESPACE = 0x0D0C


def lock_workflow_signals(conn: Connection, workflow_id: str) -> None:
    """Serialize, per workflow id, signal inserts and the coordinator's continue-as-new hand-over.

    Signals are consumed in id order, so ids must be handed out in commit order; and a signal
    must never land on a run that has just been continued. SQLite serializes every write.
    """
    dialect_of(conn).advisory_lock(conn, SIGNAL_LOCK_NAMESPACE, workflow_id)


def insert_signal(
    engine: Engine,
    *,
    run_id: str,
    workflow_id: str,
    name: str,
    payload: Any,
    idempotency_key: str,
    who: audit.Who | None = None,
    action: AuditAction = AuditAction.SIGNAL,
    node: str | None = None,
    request: RequestKey | None = None,
) -> tuple[int, bool, str]:
    """Accept a signal. Returns (id, created, run id it went to). ``who``: its audit entry
    (``action``: an approval's decision is ``approve``/``reject`` on ``node``), in the same
    transaction; a repeated idempotency key writes none.

    A repeated idempotency key returns the first signal's id. A run that was continued as new
    hands the signal to its successor; a run that finished otherwise refuses it.

    ``request`` (a signal webhook's delivery, store/start_requests.py): its row is inserted with
    the signal; a request made before returns its signal, even once its run has finished.
    Repeats of one request name one workflow id, so the lock below orders them.
    """
    insert = dialect_of(engine).insert
    with engine.begin() as conn:
        lock_workflow_signals(conn, workflow_id)
        earlier = find_request(conn, request) if request is not None else None
        if earlier is not None and earlier.signal_id is not None:
            return earlier.signal_id, False, earlier.run_id
        if idempotency_key is not None:
            existing = conn.execute(
                sa.select(workflow_signal.c.id, workflow_signal.c.run_id).where(
                    workflow_signal.c.workflow_id == workflow_id,
                    workflow_signal.c.idempotency_key == idempotency_key,
                )
            ).one_or_none()
            if existing is not None:
                return int(existing.id), False, existing.run_id
        run_id = _open_successor(conn, run_id)
        stmt = insert(workflow_signal).values(
            run_id=run_id,
            workflow_id=workflow_id,
            name=name,
            # A large payload is stored by reference, owned by the run it goes to.
            payload=blobs.offloaded_on(conn, run_id, payload),
            idempotency_key=idempotency_key,
        )
        row = conn.execute(stmt.returning(workflow_signal.c.id)).one()
        if request is not None:
            conn.execute(
                request_insert(
                    request, run_id=run_id, workflow_id=workflow_id, signal_id=int(row.id)
                )
            )
        if who is not None:
            detail: dict[str, Any] = {"signal": name} if action == AuditAction.SIGNAL else {}
            if action == AuditAction.SIGNAL and not idempotency_key.startswith("ductor:"):
                detail["idempotency_key"] = idempotency_key
            if request is not None:
                detail["request"] = request.detail()
            audit.record(
                conn,
                action,
                actor=who.actor,
                source=who.source,
                run_id=run_id,
                workflow_id=workflow_id,
                node=node,
                detail=detail,
            )
        return int(row.id), True, run_id


def _open_successor(conn: Connection, run_id: str) -> str:
    """The run itself if open, else the open run it was continued into (read under the lock)."""
    for _ in range(1000):
        run = conn.execute(
            sa.select(workflow_run.c.status, workflow_run.c.continued_to).where(
                workflow_run.c.run_id == run_id
            )
        ).one()
        if run.status in OPEN_RUN_STATUSES:
            return run_id
        if run.status != RunStatus.CONTINUED.value or not run.continued_to:
            raise InvalidOperation(f"cannot signal run {run_id}: it is {run.status}")
        run_id = run.continued_to
    raise InvalidOperation(f"cannot signal run {run_id}: continue-as-new chain too long")


def pending_signal_named(engine: Engine, run_id: str, name: str) -> bool:
    with engine.connect() as conn:
        return (
            conn.execute(
                sa.select(workflow_signal.c.id).where(
                    workflow_signal.c.run_id == run_id,
                    workflow_signal.c.name == name,
                    workflow_signal.c.applied_at.is_(None),
                )
            ).first()
            is not None
        )


def insert_control(
    engine: Engine,
    *,
    run_id: str,
    kind: ControlKind,
    reason: str | None = None,
    requested_by: str | None = None,
    input: Any = None,
    has_input: bool = False,
    node: str | None = None,
    spec_hash: str | None = None,
    source: str | None = None,
) -> int:
    """Queue a control. ``node``: a redrive's from-node; ``spec_hash``: a continue-as-new's
    target definition (stored by the caller first); ``requested_by`` and ``source``: who asked,
    copied into the audit entry by the tick that applies it."""
    with engine.begin() as conn:
        return int(
            conn.execute(
                sa.insert(workflow_control)
                .values(
                    run_id=run_id,
                    kind=kind,
                    reason=reason,
                    requested_by=requested_by,
                    # A redrive's or continue-as-new's large input: by reference.
                    input=blobs.offloaded_on(conn, run_id, input),
                    has_input=has_input,
                    node=node,
                    spec_hash=spec_hash,
                    source=source,
                )
                .returning(workflow_control.c.id)
            ).scalar_one()
        )


def signal_payloads(engine: Engine, ids: list[int]) -> dict[int, Any]:
    if not ids:
        return {}
    with engine.connect() as conn:
        return dict(
            conn.execute(
                sa.select(workflow_signal.c.id, workflow_signal.c.payload).where(
                    workflow_signal.c.id.in_(ids)
                )
            ).all()
        )


def control_outcome(engine: Engine, control_id: int) -> tuple[bool, str | None]:
    """Whether the control row is handled yet, and its result (``engine.kinds``)."""
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(workflow_control.c.handled_at, workflow_control.c.result).where(
                workflow_control.c.id == control_id
            )
        ).first()
    if row is None:  # pruned with its run: it was handled
        return True, None
    return row.handled_at is not None, row.result
