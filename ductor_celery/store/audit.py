"""The audit log's rows (``eec_audit``): written in the caller's transaction, read newest first.

docs/operations.md, "Who did what", says which action writes an entry where. Every writer here
takes the connection of the transaction that makes the action take effect, so an entry exists
exactly when its action does.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from ..engine.kinds import KEPT_PAST_THEIR_RUN, AuditAction, AuditSource
from .db import aware
from .schema import audit, workflow_control, workflow_run

# -- where an action comes from: the calling layer's word -----------------------------------
#
# Plain Python calls are ``api``; the CLI, the console, bulk controls and the sweeper say
# otherwise with ``acting_as``, a context variable, so no public signature carries a source and
# a thread or task never sees another's.

_source: contextvars.ContextVar[AuditSource] = contextvars.ContextVar(
    "ductor_audit_source", default=AuditSource.API
)


def current_source() -> AuditSource:
    """The source the calling layer declared (``api`` unless one did)."""
    return _source.get()


@contextmanager
def acting_as(source: AuditSource | str) -> Iterator[None]:
    """Within the block, actions this thread (or task) takes are recorded as from ``source``."""
    token = _source.set(AuditSource(source))
    try:
        yield
    finally:
        _source.reset(token)


#: The longest reason or comment an entry keeps (the control row keeps all of it).
_DETAIL_TEXT = 500


@dataclass(frozen=True, slots=True)
class Who:
    """Who asks, and from where: what a writer needs to record its action's entry."""

    actor: str | None = None
    source: AuditSource = AuditSource.API


def entry_insert(action: AuditAction, **entry: Any) -> Any:
    """The INSERT of one entry (``entry_values``' keywords), for whichever connection runs
    the action's transaction (a caller's own, through store/joined.py, too)."""
    return sa.insert(audit).values(**entry_values(action, **entry))


def entry_values(
    action: AuditAction,
    *,
    actor: str | None,
    source: AuditSource | str,
    run_id: str | None = None,
    workflow_id: str | None = None,
    node: str | None = None,
    detail: dict[str, Any] | None = None,
    at: datetime | None = None,
) -> dict[str, Any]:
    """The row of one entry."""
    values: dict[str, Any] = {
        "actor": actor,
        "action": AuditAction(action).value,
        "source": AuditSource(source).value,
        "run_id": run_id,
        "workflow_id": workflow_id,
        "node": node,
        "detail": detail or None,
    }
    if at is not None:
        values["at"] = at
    return values


def record(conn: Connection, action: AuditAction, **entry: Any) -> None:
    """One entry (``entry_insert``'s keywords), in ``conn``'s transaction."""
    conn.execute(entry_insert(action, **entry))


def record_many(conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
    """Several entries at once (a parent's child runs): dicts of ``record``'s columns."""
    if rows:
        conn.execute(sa.insert(audit), list(rows))


def record_applied_control(conn: Connection, control_id: int, at: datetime) -> None:
    """The entry of a control the tick applies, from its row (who asked, from where), in the
    tick's own commit: a refused control never gets here."""
    row = conn.execute(
        sa.select(
            workflow_control.c.kind,
            workflow_control.c.requested_by,
            workflow_control.c.source,
            workflow_control.c.reason,
            workflow_control.c.node,
            workflow_control.c.run_id,
            workflow_run.c.workflow_id,
        )
        .join(workflow_run, workflow_run.c.run_id == workflow_control.c.run_id)
        .where(workflow_control.c.id == control_id)
    ).first()
    if row is None:
        return
    detail = {"reason": row.reason[:_DETAIL_TEXT]} if row.reason else None
    record(
        conn,
        AuditAction(row.kind),
        actor=row.requested_by,
        source=row.source or AuditSource.API,
        run_id=row.run_id,
        workflow_id=row.workflow_id,
        node=row.node,
        detail=detail,
        at=at,
    )


@dataclass(frozen=True, slots=True)
class AuditFilter:
    run_ids: tuple[str, ...] | None = None
    workflow_id: str | None = None
    actor: str | None = None
    action: str | None = None
    since: datetime | None = None


def entries(
    engine: Engine, where: AuditFilter, *, limit: int, before_id: int | None
) -> tuple[list[dict[str, Any]], int | None]:
    """Up to ``limit`` entries newest first (by id), and the id to continue before (``None``:
    the last page)."""
    query = sa.select(audit).order_by(audit.c.id.desc()).limit(limit + 1)
    if where.run_ids is not None and where.workflow_id is not None:
        query = query.where(
            sa.or_(audit.c.run_id.in_(where.run_ids), audit.c.workflow_id == where.workflow_id)
        )
    elif where.run_ids is not None:
        query = query.where(audit.c.run_id.in_(where.run_ids))
    if where.actor is not None:
        query = query.where(audit.c.actor == where.actor)
    if where.action is not None:
        query = query.where(audit.c.action == where.action)
    if where.since is not None:
        query = query.where(audit.c.at >= where.since)
    if before_id is not None:
        query = query.where(audit.c.id < before_id)
    with engine.connect() as conn:
        rows = list(conn.execute(query))
    more = len(rows) > limit
    rows = rows[:limit]
    return [_aware(r) for r in rows], (rows[-1].id if more and rows else None)


def _aware(row: Any) -> dict[str, Any]:
    """A row as a dict, its time aware (SQLite hands back naive UTC)."""
    found = dict(row._mapping)
    found["at"] = aware(found["at"])
    return found


def delete_for_runs(conn: Connection, run_ids: Iterable[str]) -> None:
    """Prune: a run's entries go with it, but for those kept past their run (bulk actions)."""
    ids = list(run_ids)
    if ids:
        conn.execute(
            sa.delete(audit).where(
                audit.c.run_id.in_(ids),
                audit.c.source.not_in([s.value for s in KEPT_PAST_THEIR_RUN]),
            )
        )


def delete_older_than(engine: Engine, cutoff: datetime) -> int:
    """Retention of the log itself (``ductor_audit_retention_days``)."""
    with engine.begin() as conn:
        return int(conn.execute(sa.delete(audit).where(audit.c.at < cutoff)).rowcount or 0)
