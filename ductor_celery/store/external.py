"""Clients' writes of external input: signals (approvals are signals) and operator controls.

Clients only insert; the coordinator marks rows applied or handled in its commit.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine

from .schema import workflow_control, workflow_signal

#: First key of the advisory locks that order one workflow id's signals ("ductor" in ASCII-ish).
SIGNAL_LOCK_NAMESPACE = 0x0D0C


def insert_signal(
    engine: Engine,
    *,
    run_id: str,
    workflow_id: str,
    name: str,
    payload: Any,
    idempotency_key: str | None,
) -> tuple[int, bool]:
    """Accept a signal. Returns (id, created); a repeated idempotency key returns the first."""
    insert = pg_insert if engine.dialect.name == "postgresql" else sqlite_insert
    values = {
        "run_id": run_id,
        "workflow_id": workflow_id,
        "name": name,
        "payload": payload,
        "idempotency_key": idempotency_key,
    }
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            # Signals of one workflow id are consumed in id order, so ids must be handed out in
            # commit order: serialize this workflow's inserts (SQLite serializes every write).
            conn.execute(
                sa.select(
                    sa.func.pg_advisory_xact_lock(
                        SIGNAL_LOCK_NAMESPACE, sa.func.hashtext(workflow_id)
                    )
                )
            )
        stmt = insert(workflow_signal).values(**values)
        if idempotency_key is not None:
            stmt = stmt.on_conflict_do_nothing(
                index_elements=[workflow_signal.c.workflow_id, workflow_signal.c.idempotency_key],
                index_where=workflow_signal.c.idempotency_key.is_not(None),
            )
        row = conn.execute(stmt.returning(workflow_signal.c.id)).one_or_none()
        if row is not None:
            return int(row.id), True
        existing = conn.execute(
            sa.select(workflow_signal.c.id).where(
                workflow_signal.c.workflow_id == workflow_id,
                workflow_signal.c.idempotency_key == idempotency_key,
            )
        ).scalar_one()
        return int(existing), False


def signal_with_key(engine: Engine, workflow_id: str, idempotency_key: str) -> int | None:
    with engine.connect() as conn:
        found = conn.execute(
            sa.select(workflow_signal.c.id).where(
                workflow_signal.c.workflow_id == workflow_id,
                workflow_signal.c.idempotency_key == idempotency_key,
            )
        ).scalar_one_or_none()
    return int(found) if found is not None else None


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
    kind: str,
    reason: str | None = None,
    requested_by: str | None = None,
    input: Any = None,
    has_input: bool = False,
) -> int:
    with engine.begin() as conn:
        return int(
            conn.execute(
                sa.insert(workflow_control)
                .values(
                    run_id=run_id,
                    kind=kind,
                    reason=reason,
                    requested_by=requested_by,
                    input=input,
                    has_input=has_input,
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


def has_unhandled_control(engine: Engine, run_id: str, kinds: tuple[str, ...]) -> bool:
    with engine.connect() as conn:
        return (
            conn.execute(
                sa.select(workflow_control.c.id).where(
                    workflow_control.c.run_id == run_id,
                    workflow_control.c.handled_at.is_(None),
                    workflow_control.c.kind.in_(kinds),
                )
            ).first()
            is not None
        )
