"""Rate limits: a token bucket per key, taken from by the claim (docs/flow-control.md).

``RateLimit("N/s", key=...)`` gives each resolved key a bucket of N tokens refilled over the
period. The bucket is one row of ``eec_rate_bucket`` in GCRA form: ``tat``, the theoretical
arrival time. With ``T = period / N`` (one token's worth of time) and ``tau = period - T``
(the burst a full bucket allows), a claim at ``now`` may take a token when
``tat - tau <= now``, and taking it sets ``tat = max(tat, now) + T``. Over any window of length
``w`` that admits at most ``N + floor(w / T)`` claims.

The token is taken by the claim itself (``claim_limited``), in the transaction that sets the
attempt's ``claimed_at`` and under the bucket row's lock, so every step function that runs took
one token at the moment it was allowed to start. A claim that finds no token, or an attempt
of the key ahead of it in line, claims nothing: it marks its attempt waiting
(``rate_wait_since``) and its message is dropped. The sweeper (``release_waiters``) hands the
tokens a key has to the first waiters in line by marking them released
(``rate_released_at``) and sending their messages; they keep their place until their claims
take the tokens.

Lock order: attempt rows, then the bucket row. A worker's claim locks its attempt row
(``FOR UPDATE``) before the bucket; a tick's commit closes or inserts attempt rows before it
takes an inline step's token. The sweeper's release locks a bucket and then only the attempt
rows nobody holds (``SKIP LOCKED``), so it never waits on a row. Outcome writes never touch a
bucket. No two of them wait on each other in a cycle. (A tick's take also stamps its claimed
attempt's ``claimed_at`` after locking the bucket: that row is the commit's own insert, which
nobody else can see, let alone lock.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection, Engine

from . import clock
from .db import aware
from .dialect import dialect_of
from .outbox import OutboxRow, delete_outbox, insert_outbox, step_intent
from .schema import rate_bucket, step_attempt

#: How many keys with waiters one sweep looks at, and waiters one key releases at most.
KEYS_PER_SWEEP = 200
MAX_RELEASE = 1000
#: A bucket full for this long is deleted: it behaves exactly as no row.
FULL_BUCKET_KEPT = timedelta(hours=1)


@dataclass(frozen=True, slots=True)
class RateHeld:
    """The claim found no token for the attempt (or older attempts of its key waiting): it
    waits, marked, with no message out, until the sweeper releases it."""

    token: str
    key: str
    #: When the bucket next has a token (the sweeper's first pass after that releases it).
    ready_at: datetime


@dataclass(frozen=True, slots=True)
class Bucket:
    """One key's bucket as a claim or a release sees it, under its lock."""

    key: str
    tat: datetime
    now: datetime
    limit: int
    period: float

    @property
    def interval(self) -> timedelta:
        """One token's worth of time, rounded up to the clock's microsecond: rounding up keeps
        every admission within the promise (a token never comes back early)."""
        micros = round(self.period * 1_000_000)
        return timedelta(microseconds=-(-micros // self.limit))

    @property
    def burst(self) -> timedelta:
        """How far ahead of now ``tat`` may be for a claim to still find a token: N - 1
        intervals, so a full bucket admits exactly N at one instant."""
        return self.interval * (self.limit - 1)

    @property
    def ready_at(self) -> datetime:
        return self.tat - self.burst

    def tokens(self) -> int:
        """Tokens claims could take now, one after another (exact: whole microseconds)."""
        ahead = self.tat - self.now
        if ahead <= timedelta(0):
            return self.limit
        if ahead > self.burst:
            return 0
        return min(self.limit, (self.burst - ahead) // self.interval + 1)

    def taken(self) -> datetime:
        """``tat`` after one token is taken now."""
        return max(self.tat, self.now) + self.interval


def lock_bucket(conn: Connection, key: str, limit: int, period: float) -> Bucket:
    """The key's bucket row, locked until the transaction ends (created full if missing),
    with the database's time (PostgreSQL ``clock_timestamp()``; SQLite: the store's clock,
    and ``BEGIN IMMEDIATE`` already serializes writers)."""
    if dialect_of(conn).one_statement:
        # One statement creates the row or locks the existing one, and reads the clock: a
        # conflicting insert updates nothing but still takes the row lock.
        # The clock at the lock, not the transaction's start: claims are admitted in lock
        # order, and their recorded times then follow that order as closely as they can.
        insert = postgresql.insert(rate_bucket).values(
            key=key, tat=sa.func.clock_timestamp(), updated_at=sa.func.clock_timestamp()
        )
        row = conn.execute(
            insert.on_conflict_do_update(
                index_elements=[rate_bucket.c.key], set_={"key": insert.excluded.key}
            ).returning(rate_bucket.c.tat, sa.func.clock_timestamp().label("now"))
        ).one()
        tat, now = row.tat, row.now
    else:
        now = clock.now(conn.engine)
        tat = conn.execute(
            sa.select(rate_bucket.c.tat).where(rate_bucket.c.key == key)
        ).scalar_one_or_none()
        if tat is None:
            conn.execute(sa.insert(rate_bucket).values(key=key, tat=now, updated_at=now))
            tat = now
    return Bucket(key, _aware(tat), _aware(now), max(int(limit), 1), max(float(period), 1e-6))


def take(conn: Connection, bucket: Bucket) -> None:
    conn.execute(
        sa.update(rate_bucket)
        .where(rate_bucket.c.key == bucket.key)
        .values(tat=bucket.taken(), updated_at=bucket.now)
    )


def older_waiter(
    conn: Connection, key: str, created_at: Any, token: str, priority: int = 0
) -> bool:
    """Whether an attempt of ``key`` ahead of this one waits for a token: of a higher
    priority, or of the same priority and created before it."""
    mine = sa.literal(created_at, step_attempt.c.created_at.type)
    return (
        conn.execute(
            sa.select(sa.literal(1))
            .where(
                step_attempt.c.rate_key == key,
                step_attempt.c.rate_waiting,
                sa.or_(
                    step_attempt.c.priority > priority,
                    sa.and_(
                        step_attempt.c.priority == priority,
                        sa.tuple_(step_attempt.c.created_at, step_attempt.c.token)
                        < sa.tuple_(mine, token),
                    ),
                ),
            )
            .limit(1)
        ).first()
        is not None
    )


def take_for_claim(
    conn: Connection, key: str, limit: int, period: float, token: str, created_at: datetime,
    priority: int,
) -> bool:  # fmt: skip
    """In a tick's commit: take a token of ``key`` for the attempt ``token`` the commit
    creates claimed (an inline chain's next step), if the bucket has one and no attempt of the
    key is ahead of it in line. One statement on PostgreSQL, in the tick's transaction (no
    commit of its own), the commit's last: the bucket's lock is held until the tick commits,
    a round trip later.

    A token taken stamps the attempt's ``claimed_at`` with the take's own time, as a worker's
    claim does (``attempts.claim_limited``): the commit inserted it claimed at the tick's
    time (its transaction's start), milliseconds earlier, and the bucket admits claims by the
    times it takes them at."""
    bucket = Bucket(key, created_at, created_at, limit, period)
    if dialect_of(conn).one_statement:
        return bool(
            conn.execute(
                _take_statement(),
                {
                    "b_key": key,
                    "b_interval": bucket.interval,
                    "b_burst": bucket.burst,
                    "b_token": token,
                    "b_created": created_at,
                    "b_priority": priority,
                },
            ).scalar_one()
        )
    bucket = lock_bucket(conn, key, limit, period)
    if bucket.tokens() == 0 or older_waiter(conn, key, created_at, token, priority):
        return False
    take(conn, bucket)
    conn.execute(
        sa.update(step_attempt).where(step_attempt.c.token == token).values(claimed_at=bucket.now)
    )
    return True


@functools.cache
def _take_statement() -> Any:
    """``take_for_claim`` on PostgreSQL. The ``INSERT ... ON CONFLICT DO UPDATE`` creates the
    bucket full or locks it, and its ``WHERE`` is evaluated on the locked row: the rule of
    ``Bucket.tokens`` and ``older_waiter``, with ``statement_timestamp()`` as now."""
    return sa.text(
        """
WITH taken AS (
    INSERT INTO eec_rate_bucket AS b (key, tat, updated_at)
    VALUES (:b_key, statement_timestamp() + :b_interval, statement_timestamp())
    ON CONFLICT (key) DO UPDATE
        SET tat = greatest(b.tat, statement_timestamp()) + :b_interval,
            updated_at = statement_timestamp()
        WHERE b.tat - :b_burst <= statement_timestamp()
          AND NOT EXISTS (
              SELECT 1 FROM eec_workflow_step_attempt w
              WHERE w.rate_key = :b_key
                AND w.rate_waiting
                AND (w.priority > :b_priority
                     OR (w.priority = :b_priority
                         AND (w.created_at, w.token) < (:b_created, :b_token))))
    RETURNING 1
), stamped AS (
    UPDATE eec_workflow_step_attempt SET claimed_at = statement_timestamp()
    WHERE token = :b_token AND EXISTS (SELECT 1 FROM taken)
)
SELECT count(*) FROM taken
"""
    ).bindparams(
        sa.bindparam("b_interval", type_=sa.Interval()),
        sa.bindparam("b_burst", type_=sa.Interval()),
        sa.bindparam("b_created", type_=sa.DateTime(timezone=True)),
    )


def give_back(conn: Connection, token: str, now: datetime) -> None:
    """The commit that created ``token`` claimed found no token for it: it is not claimed
    after all, and waits in line (no message: the sweeper sends one when its turn comes)."""
    conn.execute(
        sa.update(step_attempt)
        .where(step_attempt.c.token == token)
        .values(claimed_at=None, claimed_by=None, carrier=None, rate_wait_since=now)
    )


def hold(conn: Connection, token: str, now: datetime) -> None:
    """Mark the attempt waiting for a token: in line from its first refusal (its place is
    kept), and no longer released if it was."""
    conn.execute(
        sa.update(step_attempt)
        .where(
            step_attempt.c.token == token,
            step_attempt.c.finished_at.is_(None),
            step_attempt.c.claimed_at.is_(None),
        )
        .values(
            rate_wait_since=sa.func.coalesce(step_attempt.c.rate_wait_since, now),
            rate_released_at=None,
        )
    )


# -- the sweeper's release ----------------------------------------------------------------

#: A released waiter whose claim has not come this long after its release is released again
#: (its message was lost): until then its token is counted as spoken for.
RELEASE_GRACE = timedelta(seconds=30)


@dataclass(slots=True)
class RateSweep:
    keys: int = 0
    released: int = 0
    #: The last key this pass looked at: the next pass starts after it (every key has its
    #: turn, however many have waiters).
    last_key: str | None = None


def keys_with_waiters(
    engine: Engine, after: str | None = None, limit: int | None = None
) -> list[str]:
    """Up to ``limit`` keys that have waiting attempts, in key order from after ``after``,
    wrapping around: a scan of an index that is empty when none wait."""

    def keys(conn: Connection, start: str | None, n: int) -> list[str]:
        query = sa.select(step_attempt.c.rate_key).where(step_attempt.c.rate_waiting)
        if start is not None:
            query = query.where(step_attempt.c.rate_key > start)
        return list(
            conn.execute(query.distinct().order_by(step_attempt.c.rate_key).limit(n)).scalars()
        )

    limit = KEYS_PER_SWEEP if limit is None else limit
    with engine.connect() as conn:
        found = keys(conn, after, limit)
        if after is not None and len(found) < limit:
            found += [k for k in keys(conn, None, limit - len(found)) if k not in found]
        return found


def _in_line(key: str) -> tuple[Any, ...]:
    return (
        step_attempt.c.rate_key == key,
        step_attempt.c.rate_waiting,
    )


_LINE_ORDER = (step_attempt.c.priority.desc(), step_attempt.c.created_at, step_attempt.c.token)


def release_key(conn: Connection, key: str) -> list[OutboxRow]:
    """Hand the tokens ``key`` has now to the first waiters in line (higher priority first,
    then oldest): mark them released and write their step messages to the outbox (the caller
    sends them after the commit). They keep their place: a newer attempt's claim still sees
    them ahead of it, and their own claims take the tokens. A token already spoken for by a
    released waiter whose claim has not come yet is not handed out twice."""
    oldest = conn.execute(
        sa.select(step_attempt.c.rate_limit, step_attempt.c.rate_period)
        .where(*_in_line(key))
        .order_by(*_LINE_ORDER)
        .limit(1)
    ).first()
    if oldest is None:
        return []
    # The first waiter's declaration sizes the bucket, as its claim will.
    bucket = lock_bucket(conn, key, oldest.rate_limit or 1, oldest.rate_period or 1.0)
    recent = bucket.now - RELEASE_GRACE
    spoken_for = conn.execute(
        sa.select(sa.func.count())
        .select_from(step_attempt)
        .where(*_in_line(key), step_attempt.c.rate_released_at >= recent)
    ).scalar_one()
    count = min(bucket.tokens() - int(spoken_for), MAX_RELEASE)
    if count <= 0:
        return []
    query = (
        sa.select(
            step_attempt.c.token,
            step_attempt.c.run_id,
            step_attempt.c.node,
            step_attempt.c.step,
            step_attempt.c.queue,
            step_attempt.c.priority,
        )
        .where(
            *_in_line(key),
            sa.or_(
                step_attempt.c.rate_released_at.is_(None),
                step_attempt.c.rate_released_at < recent,
            ),
        )
        .order_by(*_LINE_ORDER)
        .limit(count)
    )
    # A tick closing one of them meanwhile is left alone (it is next sweep's business).
    query = dialect_of(conn).lock_rows(query, skip_locked=True)
    released = conn.execute(query).all()
    if not released:
        return []
    conn.execute(
        sa.update(step_attempt)
        .where(step_attempt.c.token.in_([r.token for r in released]))
        .values(rate_released_at=bucket.now)
    )
    return insert_outbox(
        conn,
        [step_intent(r.run_id, r.token, r.node, r.step, r.queue, r.priority) for r in released],
        bucket.now,
    )


def release_waiters(engine: Engine, send: Any, after: str | None = None) -> RateSweep:
    """The sweeper's pass: for each key with waiters (from after ``after``, wrapping), one
    short transaction that releases as many as the bucket has tokens for; their messages are
    sent after each commit and their outbox rows deleted (a failed send leaves them to the
    outbox relay)."""
    result = RateSweep(last_key=after)
    for key in keys_with_waiters(engine, after):
        with engine.begin() as conn:
            rows = release_key(conn, key)
        result.keys += 1
        result.last_key = key
        if rows:
            send(rows)
            delete_outbox(engine, [r.id for r in rows])
            result.released += len(rows)
    return result


def prune_full_buckets(engine: Engine) -> int:
    """Delete buckets that have been full for ``FULL_BUCKET_KEPT``: no row means a full
    bucket, so nothing changes but the table's size."""
    with engine.begin() as conn:
        cutoff = dialect_of(engine).now_on(conn) - FULL_BUCKET_KEPT
        return int(conn.execute(sa.delete(rate_bucket).where(rate_bucket.c.tat < cutoff)).rowcount)


def _aware(value: Any) -> datetime:
    result = aware(value)
    assert result is not None
    return result
