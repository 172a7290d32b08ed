"""The coordinator's side of the store: commit a tick's payload (``load.py`` reads the run).

``commit_tick`` is the only code that updates ``eec_workflow_run`` after its insert, and it
always does so ``WHERE record_version = :expected``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Engine

from ..engine import (
    RunStatus,
    TickPayload,
)
from ..engine.status import TERMINAL_RUN_STATUSES
from .db import is_postgres
from .external import lock_workflow_signals
from .load import LoadedRun
from .schema import (
    step_attempt,
    workflow_control,
    workflow_outbox,
    workflow_run,
    workflow_signal,
    workflow_timer,
    workflow_transition,
)

RUN_FINISHED_CHANNEL = "ductor_run_finished"


class VersionConflict(Exception):
    """Someone else committed this run (or an attempt changed) since we loaded it."""


@dataclass(frozen=True, slots=True)
class OutboxRow:
    id: int
    run_id: str
    kind: str
    task: str
    queue: str | None
    payload: dict[str, Any]


def commit_tick(engine: Engine, loaded: LoadedRun, payload: TickPayload) -> list[OutboxRow]:
    """Write the payload in one transaction, or raise VersionConflict and write nothing."""
    with engine.begin() as conn:
        return commit_on(conn, loaded, payload)


def commit_on(conn: Connection, loaded: LoadedRun, payload: TickPayload) -> list[OutboxRow]:
    """Write the payload in the caller's transaction; VersionConflict means roll it back."""
    now = loaded.now
    state = payload.state
    finished = state.status in TERMINAL_RUN_STATUSES
    values: dict[str, Any] = {
        "status": state.status.value,
        "state": state.to_json(),
        "record_version": loaded.record_version + 1,
        "transition_count": state.transitions,
        "updated_at": now,
    }
    if finished and loaded.state.status not in TERMINAL_RUN_STATUSES:
        values.update(output=payload.output, error=payload.error, finished_at=now)
    if payload.reopened:
        values.update(output=None, error=None, finished_at=None)
    if payload.successor is not None:
        values["continued_to"] = payload.successor.run_id
    updated = conn.execute(
        sa.update(workflow_run)
        .where(
            workflow_run.c.run_id == loaded.run_id,
            workflow_run.c.record_version == loaded.record_version,
        )
        .values(**values)
    )
    if updated.rowcount != 1:
        raise VersionConflict(loaded.run_id)

    for closed in payload.closed:
        # Conditional on the attempt still being open: if its worker finished it after our
        # load, roll back and recompute, so the worker's result is folded, not overwritten.
        res = conn.execute(
            sa.update(step_attempt)
            .where(step_attempt.c.token == closed.token, step_attempt.c.finished_at.is_(None))
            .values(
                finished_at=now,
                outcome=closed.outcome,
                error=closed.error,
                retryable=False,
                folded=True,
            )
        )
        if res.rowcount != 1:
            raise VersionConflict(f"attempt {closed.token} finished meanwhile")

    if payload.folded:
        conn.execute(
            sa.update(step_attempt)
            .where(step_attempt.c.token.in_(payload.folded))
            .values(folded=True)
        )

    if payload.new_attempts:
        copied = [a.args_from for a in payload.new_attempts if a.args_from]
        prior: dict[str, Any] = {}
        if copied:
            prior = dict(
                conn.execute(
                    sa.select(step_attempt.c.token, step_attempt.c.args).where(
                        step_attempt.c.token.in_(copied)
                    )
                ).all()
            )
        conn.execute(
            sa.insert(step_attempt),
            [
                {
                    "token": a.token,
                    "run_id": loaded.run_id,
                    "node": a.node,
                    "branch": None,
                    "generation": a.generation,
                    "attempt": a.attempt,
                    "step": a.step,
                    "queue": a.queue,
                    "args": prior.get(a.args_from, {}) if a.args_from else a.args,
                    "timeout": a.timeout,
                    "created_at": now,
                    "folded": False,
                }
                for a in payload.new_attempts
            ],
        )

    if payload.transitions:
        first = state.transitions - len(payload.transitions)
        conn.execute(
            sa.insert(workflow_transition),
            [
                {
                    "run_id": loaded.run_id,
                    "seq": first + i,
                    "node": tr.node,
                    "from_status": str(tr.from_status) if tr.from_status is not None else None,
                    "to_status": str(tr.to_status),
                    "reason": tr.reason[:2000],
                    "at": now,
                }
                for i, tr in enumerate(payload.transitions)
            ],
        )

    outbox: list[OutboxRow] = []
    if payload.dispatches:
        rows: list[dict[str, Any]] = [
            {
                "run_id": d.run_id,
                "kind": d.kind,
                "task": d.step,
                "queue": d.queue,
                "payload": {"token": d.token, "run_id": d.run_id, "node": d.node},
                "created_at": now,
            }
            for d in payload.dispatches
        ]
        result = conn.execute(
            sa.insert(workflow_outbox).returning(
                workflow_outbox.c.id, sort_by_parameter_order=True
            ),
            rows,
        )
        ids = [r.id for r in result]
        outbox = [
            OutboxRow(
                id=i,
                run_id=r["run_id"],
                kind=r["kind"],
                task=r["task"],
                queue=r["queue"],
                payload=r["payload"],
            )
            for i, r in zip(ids, rows, strict=True)
        ]

    for applied in payload.applied_signals:
        res = conn.execute(
            sa.update(workflow_signal)
            .where(workflow_signal.c.id == applied.id, workflow_signal.c.applied_at.is_(None))
            .values(
                applied_at=now, applied_to=applied.node, applied_version=loaded.record_version + 1
            )
        )
        if res.rowcount != 1:
            raise VersionConflict(f"signal {applied.id} applied meanwhile")
    if payload.handled_control is not None:
        conn.execute(
            sa.update(workflow_control)
            .where(workflow_control.c.id == payload.handled_control.id)
            .values(handled_at=now, result=payload.handled_control.result[:2000])
        )
    if payload.successor is not None:
        outbox.extend(_insert_successor(conn, loaded, payload, now))

    _set_timer(conn, loaded.run_id, payload.next_wake_at)

    if finished and loaded.state.status not in TERMINAL_RUN_STATUSES and is_postgres(conn.engine):
        conn.execute(sa.select(sa.func.pg_notify(RUN_FINISHED_CHANNEL, loaded.run_id)))
    return outbox


def _set_timer(conn: Connection, run_id: str, fire_at: datetime | None) -> None:
    if fire_at is None:
        conn.execute(sa.delete(workflow_timer).where(workflow_timer.c.run_id == run_id))
        return
    insert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
    stmt = insert(workflow_timer).values(run_id=run_id, fire_at=fire_at, woken_at=None)
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[workflow_timer.c.run_id],
            set_={"fire_at": fire_at, "woken_at": None},
        )
    )


def delete_outbox(engine: Engine, ids: list[int]) -> None:
    if ids:
        with engine.begin() as conn:
            conn.execute(sa.delete(workflow_outbox).where(workflow_outbox.c.id.in_(ids)))


def _insert_successor(
    conn: Connection, loaded: LoadedRun, payload: TickPayload, now: datetime
) -> list[OutboxRow]:
    """Continue-as-new: the successor run row, linked both ways, and its first wake-up."""
    successor = payload.successor
    assert successor is not None
    run = conn.execute(
        sa.select(
            workflow_run.c.workflow, workflow_run.c.version, workflow_run.c.parent_run_id
        ).where(workflow_run.c.run_id == loaded.run_id)
    ).one()
    conn.execute(
        sa.insert(workflow_run).values(
            run_id=successor.run_id,
            workflow_id=loaded.workflow_id,
            workflow=run.workflow,
            version=run.version,
            spec_hash=loaded.spec_hash,
            status=RunStatus.PENDING.value,
            state=successor.state.to_json(),
            input=successor.input,
            record_version=0,
            transition_count=0,
            parent_run_id=run.parent_run_id,
            continued_from=loaded.run_id,
            created_at=now,
            updated_at=now,
        )
    )
    # Signals the predecessor never consumed belong to the successor now. Under the signal
    # lock: a client inserting at this moment either lands before the move (and is moved) or
    # reads the run as continued (and follows it to the successor).
    lock_workflow_signals(conn, loaded.workflow_id)
    conn.execute(
        sa.update(workflow_signal)
        .where(workflow_signal.c.run_id == loaded.run_id, workflow_signal.c.applied_at.is_(None))
        .values(run_id=successor.run_id)
    )
    row = conn.execute(
        sa.insert(workflow_outbox)
        .values(
            run_id=successor.run_id,
            kind="wakeup",
            task="ductor.tick",
            queue=None,
            payload={"run_id": successor.run_id},
            created_at=now,
        )
        .returning(workflow_outbox.c.id)
    ).one()
    return [
        OutboxRow(
            id=row.id,
            run_id=successor.run_id,
            kind="wakeup",
            task="ductor.tick",
            queue=None,
            payload={"run_id": successor.run_id},
        )
    ]


def reject_control(engine: Engine, control_id: int, result: str) -> None:
    """Mark a control handled without applying it (its commit would break a database rule)."""
    with engine.begin() as conn:
        conn.execute(
            sa.update(workflow_control)
            .where(workflow_control.c.id == control_id, workflow_control.c.handled_at.is_(None))
            .values(handled_at=sa.func.now(), result=result[:2000])
        )
