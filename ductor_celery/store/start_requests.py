"""Requests from outside that take effect once: ``eec_start_request``.

An HTTP start with an ``Idempotency-Key`` and a webhook's delivery may be sent again (a retry
after a timeout, a provider's redelivery, two deliveries at once). Each is keyed by (scope,
key): ``api:<workflow>`` and the header's value, ``hook:<name>`` and the delivery's id. The row
is inserted in the transaction that inserts the run it starts (``runs.insert_run``) or the
signal it sends (``external.insert_signal``), so a crash never leaves one without the other;
the primary key makes a concurrent repeat fail its insert, roll back whatever else it wrote,
and find the first request's row instead. A start that meets an open run of its workflow id
(and so starts nothing) records that run as the request's in the transaction that reads it
(``record_on``, from ``runs.insert_run_requested``), the run row locked against a prune until
it commits. A repeat finds the row whether or not its run has finished, until the run is
pruned (retention.py deletes the rows with their run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from .dialect import dialect_of
from .schema import start_request

#: Scopes: a start through the console's JSON API, and a webhook's delivery.
API_SCOPE = "api:"
HOOK_SCOPE = "hook:"


@dataclass(frozen=True, slots=True)
class RequestKey:
    """Which request: ``scope`` (``api:<workflow>``, ``hook:<name>``) and its ``key``."""

    scope: str
    key: str

    @classmethod
    def api(cls, workflow: str, key: str) -> RequestKey:
        return cls(API_SCOPE + workflow, key)

    @classmethod
    def hook(cls, name: str, key: str) -> RequestKey:
        return cls(HOOK_SCOPE + name, key)

    def detail(self) -> dict[str, str]:
        """What the audit entry of the request's start or signal says of it."""
        return {"scope": self.scope, "key": self.key}


@dataclass(frozen=True, slots=True)
class Requested:
    """What a request did: the run it started (or signalled), and its signal row if any."""

    run_id: str
    workflow_id: str
    signal_id: int | None = None


def request_insert(
    request: RequestKey, *, run_id: str, workflow_id: str, signal_id: int | None = None
) -> sa.Insert:
    """The row of a request, for the transaction that makes its run or signal."""
    return sa.insert(start_request).values(
        scope=request.scope,
        key=request.key,
        run_id=run_id,
        workflow_id=workflow_id,
        signal_id=signal_id,
    )


def find_on(conn: Connection, request: RequestKey) -> Requested | None:
    row = conn.execute(
        sa.select(
            start_request.c.run_id, start_request.c.workflow_id, start_request.c.signal_id
        ).where(start_request.c.scope == request.scope, start_request.c.key == request.key)
    ).one_or_none()
    if row is None:
        return None
    signal_id = None if row.signal_id is None else int(row.signal_id)
    return Requested(run_id=row.run_id, workflow_id=row.workflow_id, signal_id=signal_id)


def find(engine: Engine, request: RequestKey) -> Requested | None:
    """The request's row, if it was made before."""
    with engine.connect() as conn:
        return find_on(conn, request)


def record_on(conn: Connection, request: RequestKey, run_id: str, workflow_id: str) -> Requested:
    """In the caller's transaction, which read ``run_id`` open (a start that inserted no run:
    the open run of its workflow id was there, so the start returns that one): the request's
    row if a concurrent repeat wrote it, else a row that records that run as the request's, so
    a repeat after the run finished still returns it and starts nothing. The first row written
    wins (a concurrent repeat's insert waits for this transaction, then finds the row)."""
    insert: Any = dialect_of(conn).insert
    conn.execute(
        insert(start_request)
        .values(scope=request.scope, key=request.key, run_id=run_id, workflow_id=workflow_id)
        .on_conflict_do_nothing()
    )
    found = find_on(conn, request)
    assert found is not None
    return found
