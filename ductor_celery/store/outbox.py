"""Outbox rows: dispatch intents written in the same transaction as the change that needs them
(``OutboxRow``, shaped by ``coordinator/rows.py``).

Whoever commits the change sends the rows after the commit and deletes them; the sweeper relays
rows left behind by a crash. A duplicate send is harmless (claims are by token).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from ..coordinator.port import OutboxRow
from ..coordinator.rows import OutboxIntent, outbox_row, step_intent, wakeup_intent
from .schema import workflow_outbox

__all__ = [
    "OutboxRow",
    "delete_outbox",
    "insert_outbox",
    "step_intent",
    "wakeup_intent",
]


def insert_outbox(conn: Connection, rows: Sequence[OutboxIntent], now: datetime) -> list[OutboxRow]:
    """Insert dispatch intents (run_id, kind, task, queue, payload) and return them with ids."""
    if not rows:
        return []
    values = [{**r, "created_at": now} for r in rows]
    result = conn.execute(_insert_statement(), values)
    return [outbox_row(i.id, r) for i, r in zip(result, rows, strict=True)]


@functools.cache
def _insert_statement() -> Any:
    """Built once per process: it runs in nearly every tick."""
    return sa.insert(workflow_outbox).returning(workflow_outbox.c.id, sort_by_parameter_order=True)


def delete_outbox(engine: Engine, ids: list[int]) -> None:
    if ids:
        with engine.begin() as conn:
            conn.execute(sa.delete(workflow_outbox).where(workflow_outbox.c.id.in_(ids)))
