"""Concurrency leases: at most ``limit`` attempts per key hold a slot, and only holders run.

A lease is a row ``(key, slot)`` naming its holder's token. The coordinator asks for slots in
the commit that creates attempts (``acquire``); an attempt that gets none is created anyway and
waits, unsent. Whoever ends an attempt (the worker writing its outcome, the coordinator closing
it on timeout, cancel or terminate) releases its slot in that same transaction (``release``),
which hands the slot to the oldest waiting attempt of the key and writes its step message to
the outbox. A worker may only claim an attempt that holds its slot (``store.attempts.claim``),
so a re-sent or duplicated message for a waiting attempt is dropped, never run.

A key never has more than ``limit`` lease rows: a slot is granted only while fewer rows than
the requester's limit exist (slot numbers only keep the primary key unique). A limit lowered in
a new workflow version therefore holds back new grants until enough old holders end.

Every change to one key's slots happens under a per-key advisory lock on PostgreSQL (SQLite
serializes all writes); a transaction that touches several keys locks them in sorted order.
The sweeper (``reclaim_key``) only *tries* the lock and skips a busy key, so it never waits
behind a tick or a worker. See docs/leases.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..limits import later
from .dialect import dialect_of
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
    dialect = dialect_of(conn)
    for key in sorted(set(keys)):
        dialect.advisory_lock(conn, LEASE_LOCK_NAMESPACE, key)


def try_lock_key(conn: Connection, key: str) -> bool:
    """Take one key's lock if nobody holds it (the sweeper's way: never wait, come back)."""
    return dialect_of(conn).try_advisory_lock(conn, LEASE_LOCK_NAMESPACE, key)


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


def _free_slot(held: set[int], limit: int) -> int | None:
    """The lowest free slot, or None when the key already has ``limit`` holders (counting
    holders granted under another limit, e.g. by an older workflow version)."""
    if len(held) >= limit:
        return None
    return next(s for s in range(len(held) + 1) if s not in held)


def _grant(conn: Connection, key: str, slot: int, req: LeaseRequest, now: datetime) -> None:
    conn.execute(
        sa.insert(concurrency_lease).values(
            key=key,
            slot=slot,
            token=req.token,
            run_id=req.run_id,
            node=req.node,
            granted_at=now,
            expires_at=later(now, req.timeout),  # saturates: a timeout setting past ten years
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
            slot = _free_slot(held, req.limit)
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
                step_attempt.c.lease_waiting,
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
                step_attempt.c.priority,
            )
            .where(
                step_attempt.c.lease_key == key,
                step_attempt.c.lease_waiting,
                ~holds_lease(),
            )
            .order_by(
                step_attempt.c.priority.desc(), step_attempt.c.created_at, step_attempt.c.token
            )
            .limit(_WAITERS_PER_RELEASE)
        ).all()
        for w in waiters:
            slot = _free_slot(held, w.lease_limit or 1)
            if slot is None:
                break  # first come first served: nobody overtakes the oldest waiter
            req = LeaseRequest(w.token, w.run_id, w.node, key, w.lease_limit or 1, w.timeout)
            _grant(conn, key, slot, req, now)
            held.add(slot)
            intents.append(step_intent(w.run_id, w.token, w.node, w.step, w.queue, w.priority))
    return insert_outbox(conn, intents, now)


@dataclass(slots=True)
class Reclaimed:
    """What the sweeper did to one key's leases."""

    released: list[str]  # tokens whose lease was freed: their holder ended or is gone
    extended: list[str]  # tokens whose holder is still open: expiry pushed forward
    wake: list[str]  # runs of open holders past their expiry: their tick should look at them
    outbox: list[OutboxRow]  # grants to waiters and re-sent messages of unclaimed holders
    granted: int


def reclaim_key(conn: Connection, key: str, now: datetime) -> Reclaimed:
    """The sweeper's backstop for one key; the caller holds the key's lock (``try_lock_key``).

    A lease past ``expires_at`` whose holder attempt is finished or missing was left behind
    (its release never ran): free it. A holder still open keeps its lease (only the holder's
    end may free it, or the zero-overlap rule breaks), its expiry moves one step timeout on,
    its run is returned for a wake-up (the coordinator times out a lost claim), and an
    unclaimed holder has its step message sent again (a grant message that got lost). Then
    free slots go to the key's waiters, oldest first, as a release would.
    """
    holder = step_attempt
    expired = conn.execute(
        sa.select(
            concurrency_lease.c.token,
            concurrency_lease.c.run_id,
            holder.c.token.label("attempt_token"),
            holder.c.finished_at,
            holder.c.claimed_at,
            holder.c.timeout,
            holder.c.node,
            holder.c.step,
            holder.c.queue,
            holder.c.priority,
        )
        .select_from(
            concurrency_lease.outerjoin(holder, holder.c.token == concurrency_lease.c.token)
        )
        .where(
            concurrency_lease.c.key == key,
            sa.or_(concurrency_lease.c.expires_at.is_(None), concurrency_lease.c.expires_at <= now),
        )
        .order_by(concurrency_lease.c.slot)
    ).all()
    dead = [r.token for r in expired if r.attempt_token is None or r.finished_at is not None]
    alive = [r for r in expired if r.attempt_token is not None and r.finished_at is None]
    if dead:
        conn.execute(sa.delete(concurrency_lease).where(concurrency_lease.c.token.in_(dead)))
    resend = []
    for r in alive:
        conn.execute(
            sa.update(concurrency_lease)
            .where(concurrency_lease.c.token == r.token)
            .values(expires_at=later(now, max(float(r.timeout or 0), 1.0)))
        )
        if r.claimed_at is None:
            resend.append(step_intent(r.run_id, r.token, r.node, r.step, r.queue, r.priority or 0))
    outbox = insert_outbox(conn, resend, now)
    grants = grant_waiting(conn, [key], now)
    return Reclaimed(
        released=dead,
        extended=[r.token for r in alive],
        wake=sorted({r.run_id for r in alive}),
        outbox=outbox + grants,
        granted=len(grants),
    )
