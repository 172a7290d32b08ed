"""Concurrency leases: at most ``limit`` attempts per key hold a slot, and only holders run.

A lease is a row ``(key, slot)`` naming its holder's token. The coordinator asks for slots in
the commit that creates attempts (``acquire``); an attempt that gets none is created anyway and
waits, unsent. Whoever ends an attempt (the worker writing its outcome, the coordinator closing
it on timeout, cancel or terminate) releases its slot in that same transaction (``release``),
which hands the slot to the oldest waiting attempt of the key and writes its step message to
the outbox. A worker may only claim an attempt that holds its slot (``store.attempts.claim``),
so a re-sent or duplicated message for a waiting attempt is dropped, never run.

Every change to one key's slots happens under a per-key advisory lock on PostgreSQL (SQLite
serializes all writes); a transaction that touches several keys locks them in sorted order.
See docs/fan-out-and-leases.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .outbox import OutboxRow, insert_outbox, step_intent
from .schema import concurrency_lease, step_attempt

LEASE_LOCK_NAMESPACE = 0x6C65  # "le": the first key of the two-key advisory lock
#: How many waiting attempts one release looks at: more than any sane limit frees at once.
_WAITERS_PER_RELEASE = 256


@dataclass(frozen=True, slots=True)
class LeaseRequest:
    token: str
    run_id: str
    node: str
    key: str
    limit: int
    timeout: float


def lock_keys(conn: Connection, keys: Iterable[str]) -> None:
    """Take the per-key locks in sorted order (two transactions never wait on each other in a
    cycle). Re-taking a lock held by this transaction is free."""
    if conn.dialect.name != "postgresql":
        return
    for key in sorted(set(keys)):
        conn.execute(
            sa.select(sa.func.pg_advisory_xact_lock(LEASE_LOCK_NAMESPACE, sa.func.hashtext(key)))
        )


def keys_held_by(conn: Connection, tokens: list[str]) -> list[str]:
    if not tokens:
        return []
    return list(
        conn.execute(
            sa.select(concurrency_lease.c.key).where(concurrency_lease.c.token.in_(tokens))
        ).scalars()
    )


def _held_slots(conn: Connection, key: str) -> set[int]:
    return set(
        conn.execute(
            sa.select(concurrency_lease.c.slot).where(concurrency_lease.c.key == key)
        ).scalars()
    )


def _grant(conn: Connection, key: str, slot: int, req: LeaseRequest, now: datetime) -> None:
    conn.execute(
        sa.insert(concurrency_lease).values(
            key=key,
            slot=slot,
            token=req.token,
            run_id=req.run_id,
            node=req.node,
            granted_at=now,
            expires_at=now + timedelta(seconds=req.timeout),
        )
    )


def acquire(conn: Connection, requests: list[LeaseRequest], now: datetime) -> set[str]:
    """Give each request a free slot of its key, first come first served. Returns the tokens
    that got one; the others wait until a release hands them a slot. The caller holds the
    keys' locks (``lock_keys``)."""
    granted: set[str] = set()
    by_key: dict[str, list[LeaseRequest]] = {}
    for req in requests:
        by_key.setdefault(req.key, []).append(req)
    for key in sorted(by_key):
        held = _held_slots(conn, key)
        if _has_waiters(conn, key, exclude={r.token for r in by_key[key]}):
            continue  # older attempts wait for this key: they are served first
        for req in by_key[key]:
            slot = next((s for s in range(req.limit) if s not in held), None)
            if slot is None:
                break
            _grant(conn, key, slot, req, now)
            held.add(slot)
            granted.add(req.token)
    return granted


def _has_waiters(conn: Connection, key: str, exclude: set[str]) -> bool:
    return bool(
        conn.execute(
            sa.select(sa.func.count())
            .select_from(step_attempt)
            .where(
                step_attempt.c.lease_key == key,
                step_attempt.c.finished_at.is_(None),
                step_attempt.c.token.not_in(exclude),
                ~holds_lease(),
            )
        ).scalar()
    )


def holds_lease() -> sa.ColumnElement[bool]:
    """True for an attempt row that holds a lease slot (use in a WHERE on step_attempt)."""
    return sa.exists(
        sa.select(sa.literal(1))
        .select_from(concurrency_lease)
        .where(concurrency_lease.c.token == step_attempt.c.token)
    )


def release(conn: Connection, tokens: list[str], now: datetime) -> list[OutboxRow]:
    """Free the slots these (ended) attempts hold and hand them to the oldest waiters of each
    key. Returns the step messages to send after commit (already in the outbox)."""
    keys = keys_held_by(conn, tokens)
    if not keys:
        return []
    lock_keys(conn, keys)
    conn.execute(sa.delete(concurrency_lease).where(concurrency_lease.c.token.in_(tokens)))
    return grant_waiting(conn, keys, now)


def grant_waiting(conn: Connection, keys: Iterable[str], now: datetime) -> list[OutboxRow]:
    """Hand each key's free slots to its oldest waiting attempts, in creation order. The
    caller holds the keys' locks."""
    intents = []
    for key in sorted(set(keys)):
        held = _held_slots(conn, key)
        waiters = conn.execute(
            sa.select(
                step_attempt.c.token,
                step_attempt.c.run_id,
                step_attempt.c.node,
                step_attempt.c.step,
                step_attempt.c.queue,
                step_attempt.c.lease_limit,
                step_attempt.c.timeout,
            )
            .where(
                step_attempt.c.lease_key == key,
                step_attempt.c.finished_at.is_(None),
                ~holds_lease(),
            )
            .order_by(step_attempt.c.created_at, step_attempt.c.token)
            .limit(_WAITERS_PER_RELEASE)
        ).all()
        for w in waiters:
            slot = next((s for s in range(w.lease_limit or 1) if s not in held), None)
            if slot is None:
                break  # first come first served: nobody overtakes the oldest waiter
            req = LeaseRequest(w.token, w.run_id, w.node, key, w.lease_limit or 1, w.timeout)
            _grant(conn, key, slot, req, now)
            held.add(slot)
            intents.append(step_intent(w.run_id, w.token, w.node, w.step, w.queue))
    return insert_outbox(conn, intents, now)
