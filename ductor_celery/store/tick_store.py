"""The production store behind the coordinator's port (``coordinator/port.py``): PostgreSQL
or SQLite through SQLAlchemy, one connection and one transaction per tick.

A thin adapter: the load is ``load.load_on``, the commit ``ticks.commit_on``, both on the
transaction's connection, which holds the run's row lock from the load to the commit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import datetime
from types import TracebackType
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from ..coordinator.port import Loaded, LoadedRun, OutboxRow, TickClaim
from ..definition.blobrefs import BlobNeeds
from ..definition.spec import WorkflowSpec
from ..engine import AttemptResult, EngineConfig, TickInputs, TickPayload
from . import blobs, next_read, wakes
from .db import driver_cursor, give_back, lend_autocommit, release_kept, with_retry
from .dialect import dialect_of
from .load import NeedsTransaction, load_on
from .ticks import (
    commit_alone,
    commit_on,
    commits_alone,
    lock_at_version,
    refresh_stale_timer,
    reject_control,
    timer_is_stale,
)

T = TypeVar("T")

#: A tick's transaction holds its run's row lock from the load to the commit, a few
#: milliseconds. Its process may stop or be cut off from the database in between (a SIGSTOP, a
#: partition, a host gone): PostgreSQL would keep the lock, and every other tick of the run
#: waiting on it, until TCP gives up on the silent client (two hours with the server's default
#: keepalives). So each tick's transaction bounds both ends, transaction-local (``SET LOCAL``:
#: through a transaction-pooling PgBouncer too, and nothing outlives the tick):
#: - the server ends a transaction idle this long between two of its statements, which
#:   releases the lock; the stalled process finds out at its next statement and retries its
#:   tick from the start (``with_retry``; ``record_version`` fences whatever it computed);
#: - a tick waits at most this long for the lock, then leaves the run to the sweeper's
#:   lost-wake-up scan (``load._run_row``): a coordinator runs one tick at a time, and would
#:   otherwise stall every run behind one it cannot lock.
TICK_IDLE_TIMEOUT = "20s"
TICK_LOCK_TIMEOUT = "5s"
_BOUND_TICK = sa.text(
    "SELECT set_config('idle_in_transaction_session_timeout', :idle, true), "
    "set_config('lock_timeout', :lock, true)"
)

#: The same in psycopg's own placeholders, for its cursor.
_BOUND_TICK_PSYCOPG = (
    "SELECT set_config('idle_in_transaction_session_timeout', %s, true), "
    "set_config('lock_timeout', %s, true)"
)


def _bound_tick(conn: Connection) -> None:
    """Set the tick's timeouts as its transaction begins: on psycopg's own cursor when it is
    psycopg (a fixed statement whose result nobody reads: SQLAlchemy's execution path would
    cost more than the statement), else through SQLAlchemy."""
    driver: Any = conn.connection.driver_connection
    if hasattr(driver, "pgconn"):  # psycopg 3
        with driver_cursor(conn) as cursor:
            cursor.execute(_BOUND_TICK_PSYCOPG, (TICK_IDLE_TIMEOUT, TICK_LOCK_TIMEOUT))
    else:
        conn.execute(_BOUND_TICK, {"idle": TICK_IDLE_TIMEOUT, "lock": TICK_LOCK_TIMEOUT})


#: A pinned definition by its hash, read on the tick's connection when not cached.
SpecFor = Callable[[str, Connection], WorkflowSpec]


class SqlTickStore:
    """``TickStore`` over an SQLAlchemy engine."""

    __slots__ = ("engine", "spec_for", "config", "bounds_ticks")

    def __init__(self, engine: Engine, spec_for: SpecFor, config: EngineConfig) -> None:
        self.engine = engine
        self.spec_for = spec_for
        self.config = config
        #: Whether each tick's transaction sets its own timeouts (``_BOUND_TICK``).
        self.bounds_ticks = dialect_of(engine).bounds_transactions

    def transaction(self) -> SqlTickTransaction:
        return SqlTickTransaction(self)

    def retrying(self, fn: Callable[[], T], what: str) -> T:
        return with_retry(fn, what=what)

    def clear_wake(self, run_id: str) -> bool:
        return with_retry(
            functools.partial(wakes.clear_wake, self.engine, run_id), what="clear wake-up"
        )

    def reject_control(self, control_id: int, result: str) -> None:
        reject_control(self.engine, control_id, result)


class SqlTickTransaction:
    """One tick's transaction on its connection ``conn``.

    A tick asked to lock late (``load(lock_late=True)``: one carrying a plain step's outcome,
    or a run's first tick on a step worker)
    on PostgreSQL begins without one (docs/tick-without-transaction.md): its read is in
    autocommit, with no lock, and so is its commit when that is the one statement alone
    (``ticks.commits_alone``), which takes the run's lock itself. Any other write first gives
    the read's connection back, begins a transaction on another and locks the run as it was
    read (``_begin_at_version``); that one is then ``conn``.
    """

    __slots__ = ("_store", "_begin", "_reader", "_loaded", "conn")

    def __init__(self, store: SqlTickStore) -> None:
        self._store = store
        self._begin: Any = None  # the transaction, once begun (``engine.begin()``)
        self._reader: Connection | None = None  # the autocommit connection, if any
        self._loaded: LoadedRun | None = None  # what the autocommit read loaded
        self.conn: Connection

    def __enter__(self) -> SqlTickTransaction:
        return self

    def _begin_transaction(self) -> None:
        release_kept()  # one connection per tick, never an idle one beside it
        self._begin = self._store.engine.begin()
        self.conn = self._begin.__enter__()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._begin is not None:
                self._begin.__exit__(exc_type, exc, tb)
        finally:
            if self._reader is not None:
                if exc_type is None:
                    give_back(self._reader)  # kept for the chain's next tick, if it keeps
                else:
                    self._reader.close()

    def load(self, run_id: str, *, wait_for_lock: bool, lock_late: bool = False) -> Loaded | None:
        """The run, its transaction bounded first (``TICK_IDLE_TIMEOUT``,
        ``TICK_LOCK_TIMEOUT``): by a statement of its own before a read that waits for the
        run's lock, by the read itself when it does not wait (an eager tick). ``lock_late`` (an
        eager tick that carries a plain step's outcome, or a run's first, PostgreSQL): read in
        autocommit, with no lock (the commit takes it), or not at all when this thread's last
        commit returned the read (``store/next_read.py``)."""
        store = self._store
        # What this thread's last commit said the run's next read would find: for this tick
        # only, and only if it locks late (docs/next-read-from-commit.md).
        kept = next_read.take(store.engine, run_id)
        if lock_late and not wait_for_lock and store.bounds_ticks:
            reader = lend_autocommit(store.engine)
            self._reader = self.conn = reader
            try:
                found = load_on(
                    reader,
                    run_id,
                    store.spec_for,
                    store.config,
                    wait_for_lock=False,
                    in_transaction=False,
                    kept=kept,
                )
            except NeedsTransaction:
                found = None
            else:
                if found is not None:
                    self._loaded = found[0]
                return found
            # The load would write: read again, in a transaction, as any other tick.
            self._reader = None
            reader.close()
        self._begin_transaction()
        bounds = None
        if store.bounds_ticks:
            if wait_for_lock:
                _bound_tick(self.conn)
            else:
                bounds = (TICK_IDLE_TIMEOUT, TICK_LOCK_TIMEOUT)
        return load_on(
            self.conn,
            run_id,
            store.spec_for,
            store.config,
            wait_for_lock=wait_for_lock,
            bounds=bounds,
        )

    def _begin_at_version(self) -> None:
        """Read in autocommit, about to write more than one statement: begin the transaction
        on a connection of its own and lock the run at the version read (``RunBusy`` if
        another tick holds it or committed it since)."""
        loaded, reader = self._loaded, self._reader
        assert loaded is not None and reader is not None and self._begin is None
        # Nothing reads on it after this point: one connection per tick, never two at once
        # (a pool full of readers each waiting for a second connection would stall).
        self._reader = None
        reader.close()
        self._begin_transaction()
        lock_at_version(self.conn, loaded, TICK_IDLE_TIMEOUT, TICK_LOCK_TIMEOUT)
        self._loaded = None

    def commit(
        self,
        loaded: LoadedRun,
        payload: TickPayload,
        claim: TickClaim | None,
        carried: AttemptResult | None = None,
    ) -> list[OutboxRow]:
        if self._loaded is not None:
            if commits_alone(self.conn, loaded, payload, claim):
                return commit_alone(self.conn, loaded, payload, claim, carried, TICK_LOCK_TIMEOUT)
            self._begin_at_version()
        return commit_on(self.conn, loaded, payload, claim, carried)

    def refresh_stale_timer(self, loaded: LoadedRun, fire_at: datetime | None) -> bool:
        if self._loaded is not None:
            if not timer_is_stale(loaded, fire_at):
                return False
            self._begin_at_version()
        return refresh_stale_timer(self.conn, loaded, fire_at)

    def read_values(self, inputs: TickInputs, needs: BlobNeeds) -> TickInputs:
        return blobs.read_needs(self.conn, inputs, needs)
