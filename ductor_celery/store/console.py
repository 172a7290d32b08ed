"""Read-only queries of the web console and its ``/metrics``: bounded, never a write.

Each reads at most ``limit`` rows, so a run with thousands of attempts or signals costs a page
the same as a small one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from ..engine.status import OPEN_RUN_STATUSES
from .db import aware
from .schema import (
    concurrency_lease,
    step_attempt,
    workflow_control,
    workflow_definition,
    workflow_outbox,
    workflow_run,
    workflow_signal,
)


@dataclass(frozen=True, slots=True)
class AttemptRow:
    token: str
    node: str
    branch: int | None
    attempt: int
    generation: int
    step: str
    created_at: datetime | None
    claimed_at: datetime | None
    claimed_by: str | None
    heartbeat_at: datetime | None
    heartbeat_details: Any
    finished_at: datetime | None
    outcome: str | None
    error: Any
    waiting_for_lease: bool


def recent_attempts(
    engine: Engine, run_id: str, node: str | None = None, limit: int = 50
) -> tuple[list[AttemptRow], int]:
    """The run's (or one node's) latest attempts, newest first, and how many there are."""
    a = step_attempt
    where = [a.c.run_id == run_id]
    if node is not None:
        where.append(a.c.node == node)
    held = sa.exists().where(concurrency_lease.c.token == a.c.token)
    query = (
        sa.select(
            a.c.token,
            a.c.node,
            a.c.branch,
            a.c.attempt,
            a.c.generation,
            a.c.step,
            a.c.created_at,
            a.c.claimed_at,
            a.c.claimed_by,
            a.c.heartbeat_at,
            a.c.heartbeat_details,
            a.c.finished_at,
            a.c.outcome,
            a.c.error,
            sa.and_(a.c.lease_waiting, ~held).label("waiting_for_lease"),
        )
        .where(*where)
        .order_by(a.c.created_at.desc(), a.c.token.desc())
        .limit(limit)
    )
    with engine.connect() as conn:
        rows = conn.execute(query).all()
        total = conn.execute(sa.select(sa.func.count()).select_from(a).where(*where)).scalar_one()
    found = [
        AttemptRow(
            token=r.token,
            node=r.node,
            branch=r.branch,
            attempt=r.attempt,
            generation=r.generation,
            step=r.step,
            created_at=aware(r.created_at),
            claimed_at=aware(r.claimed_at),
            claimed_by=r.claimed_by,
            heartbeat_at=aware(r.heartbeat_at),
            heartbeat_details=r.heartbeat_details,
            finished_at=aware(r.finished_at),
            outcome=r.outcome,
            error=r.error,
            waiting_for_lease=bool(r.waiting_for_lease),
        )
        for r in rows
    ]
    return found, int(total)


def signals_of(engine: Engine, run_id: str, limit: int = 50) -> tuple[list[Any], int]:
    """The run's latest signals (approval decisions included), newest first, and their count."""
    s = workflow_signal
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(
                s.c.id,
                s.c.name,
                s.c.payload,
                s.c.idempotency_key,
                s.c.created_at,
                s.c.applied_at,
                s.c.applied_to,
            )
            .where(s.c.run_id == run_id)
            .order_by(s.c.id.desc())
            .limit(limit)
        ).all()
        total = conn.execute(
            sa.select(sa.func.count()).select_from(s).where(s.c.run_id == run_id)
        ).scalar_one()
    return list(rows), int(total)


def controls_of(engine: Engine, run_id: str, limit: int = 50) -> list[Any]:
    """The run's latest operator controls, newest first."""
    c = workflow_control
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.select(
                    c.c.id,
                    c.c.kind,
                    c.c.reason,
                    c.c.requested_by,
                    c.c.created_at,
                    c.c.handled_at,
                    c.c.result,
                )
                .where(c.c.run_id == run_id)
                .order_by(c.c.id.desc())
                .limit(limit)
            ).all()
        )


def children_of(engine: Engine, run_id: str, limit: int = 50) -> tuple[list[Any], int]:
    """The run's child runs (sub-workflows, child-run scatter branches), newest first."""
    r = workflow_run
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(r.c.run_id, r.c.workflow, r.c.status, r.c.parent_node, r.c.created_at)
            .where(r.c.parent_run_id == run_id)
            .order_by(r.c.created_at.desc(), r.c.run_id.desc())
            .limit(limit)
        ).all()
        total = conn.execute(
            sa.select(sa.func.count()).select_from(r).where(r.c.parent_run_id == run_id)
        ).scalar_one()
    return list(rows), int(total)


def workflow_names(engine: Engine, limit: int = 200) -> list[str]:
    """The names of the stored workflow definitions, for the runs list's filter."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.select(workflow_definition.c.name)
                .distinct()
                .order_by(workflow_definition.c.name)
                .limit(limit)
            ).scalars()
        )


# -- /metrics ---------------------------------------------------------------------------------


def open_runs_by_workflow(engine: Engine) -> list[tuple[str, str, int]]:
    """(workflow, status, count) of the open runs."""
    r = workflow_run
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(r.c.workflow, r.c.status, sa.func.count())
            .where(r.c.status.in_([s.value for s in OPEN_RUN_STATUSES]))
            .group_by(r.c.workflow, r.c.status)
        ).all()
    return [(w, s, int(n)) for w, s, n in rows]


def outbox_backlog(engine: Engine) -> int:
    """Dispatch intents committed and not yet sent (or sent and not yet deleted)."""
    with engine.connect() as conn:
        return int(
            conn.execute(sa.select(sa.func.count()).select_from(workflow_outbox)).scalar_one()
        )


def lease_waiters(engine: Engine) -> dict[str, int]:
    """Attempts waiting for a concurrency slot (no lease row of theirs yet), by step."""
    a = step_attempt
    held = sa.exists().where(concurrency_lease.c.token == a.c.token)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(a.c.step, sa.func.count()).where(a.c.lease_waiting, ~held).group_by(a.c.step)
        ).all()
    return {step: int(n) for step, n in rows}
