"""Outbox rows: dispatch intents written in the same transaction as the change that needs them.

Whoever commits the change sends the rows after the commit and deletes them; the sweeper relays
rows left behind by a crash. A duplicate send is harmless (claims are by token).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from ..engine.kinds import DispatchKind
from .schema import workflow_outbox


@dataclass(frozen=True, slots=True)
class OutboxRow:
    id: int
    run_id: str
    #: A str only for a kind this version does not know (a row written by a newer ductor,
    #: read back by the sweeper): the dispatcher logs it and drops the row.
    kind: DispatchKind | str
    task: str
    queue: str | None
    payload: dict[str, Any]


def insert_outbox(conn: Connection, rows: list[dict[str, Any]], now: datetime) -> list[OutboxRow]:
    """Insert dispatch intents (run_id, kind, task, queue, payload) and return them with ids."""
    if not rows:
        return []
    values = [{**r, "created_at": now} for r in rows]
    result = conn.execute(_insert_statement(), values)
    return [
        OutboxRow(
            id=i.id,
            run_id=r["run_id"],
            kind=r["kind"],
            task=r["task"],
            queue=r["queue"],
            payload=r["payload"],
        )
        for i, r in zip(result, rows, strict=True)
    ]


@functools.cache
def _insert_statement() -> Any:
    """Built once per process: it runs in nearly every tick."""
    return sa.insert(workflow_outbox).returning(workflow_outbox.c.id, sort_by_parameter_order=True)


def step_intent(run_id: str, token: str, node: str, step: str, queue: str | None) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "kind": DispatchKind.STEP,
        "task": step,
        "queue": queue,
        "payload": {"token": token, "run_id": run_id, "node": node},
    }


def wakeup_intent(run_id: str) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "kind": DispatchKind.WAKEUP,
        "task": "ductor.tick",
        "queue": None,
        "payload": {"run_id": run_id},
    }


def delete_outbox(engine: Engine, ids: list[int]) -> None:
    if ids:
        with engine.begin() as conn:
            conn.execute(sa.delete(workflow_outbox).where(workflow_outbox.c.id.in_(ids)))
