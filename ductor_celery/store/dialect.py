"""What differs between ductor's two databases, in one object per database.

The store runs on PostgreSQL (a server shared by every process) and on SQLite (a file on one
machine, the embedded default). Where they differ, a store module asks the dialect object of
its engine or connection (``dialect_of``) instead of testing the database's name: this module
is the only place that knows which database does what (a unit test keeps it so).

What differs, grouped:

- **Inserts that meet a key**: ``insert`` is the database's own ``INSERT`` construct, which has
  ``on_conflict_do_nothing``/``on_conflict_do_update`` on both.
- **Clock**: on PostgreSQL every time written or compared is the server's ``now()``, one clock
  for every process; on SQLite it is this process's, or the test harness's injected one
  (``store/clock.py``). ``write_now``, ``now_on``, ``db_now``, ``statement_now``.
- **Locks**: PostgreSQL locks rows (``FOR UPDATE``, ``SKIP LOCKED``) and keys (transaction-scoped
  advisory locks); on SQLite every transaction begins ``IMMEDIATE`` (``store/db.py``), which
  already keeps every other writer out, so both are no-ops there. ``lock_rows``,
  ``advisory_lock``, ``try_advisory_lock``.
- **Round trips**: a PostgreSQL statement is a round trip away, so the hot paths have
  one-statement forms there (the claim, the tick commit in ``store/pg_commit.py``, the
  results read with the run row, an unleased finish, a rate token taken in the commit).
  SQLite is in-process: a second statement costs nothing. ``one_statement``: the module keeps
  both algorithms and picks one by it.
- **Wake-ups and finishes**: PostgreSQL de-duplicates wake-up messages (``workflow_wake``) and
  announces finished runs (``NOTIFY``); SQLite sends every wake-up and its waiters poll.
  ``dedupes_wakes``, ``notify``, ``notifies``.
- **Transactions**: a consistent multi-statement read (``snapshot_options``), per-transaction
  timeouts (``bounds_transactions``), foreign keys enforced (``enforces_foreign_keys``).

The lookup is a dictionary read per call (the dialect's name is on the engine already): no
query, nothing per engine to keep.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from . import clock


class Dialect(ABC):
    """One database's ways; the two subclasses below are the only instances."""

    #: SQLAlchemy's name for the database ("postgresql", "sqlite").
    name: ClassVar[str]
    #: Times are the database server's ``now()`` (else this process's clock, or an injected one).
    server_clock: ClassVar[bool]
    #: The hot paths' one-statement forms apply (a round trip is worth saving).
    one_statement: ClassVar[bool]
    #: Wake-up requests are de-duplicated in ``workflow_wake`` (else every one is sent).
    dedupes_wakes: ClassVar[bool]
    #: Finished runs are announced (``NOTIFY``): a waiter can listen instead of polling.
    notifies: ClassVar[bool]
    #: A tick's transaction gets its own idle and lock timeouts (``store/tick_store.py``).
    bounds_transactions: ClassVar[bool]
    #: A commit it acknowledged can still be lost (a failover to an asynchronous standby).
    may_lose_commits: ClassVar[bool]
    #: Foreign keys are enforced: a row naming a missing one is refused (a run's insert then
    #: finds its definition gone, ``store/runs.save_definition``).
    enforces_foreign_keys: ClassVar[bool]
    #: Execution options for a read whose statements must all see one snapshot.
    snapshot_options: ClassVar[Mapping[str, Any]]

    @abstractmethod
    def insert(self, table: sa.Table) -> Any:
        """The database's ``INSERT`` for ``table`` (it has ``on_conflict_do_*``)."""

    @abstractmethod
    def write_now(self, engine: Engine) -> Any:
        """The time to write into a row: an SQL expression or a value."""

    @abstractmethod
    def now_on(self, conn: Connection) -> datetime:
        """The store's time, read in ``conn``'s transaction (UTC-aware)."""

    @abstractmethod
    def db_now(self, engine: Engine) -> datetime:
        """The store's time, outside any transaction."""

    @abstractmethod
    def statement_now(self, conn: Connection) -> datetime:
        """The wall clock at this statement, not at the transaction's start (two reads in one
        transaction differ)."""

    @abstractmethod
    def lock_rows(
        self,
        query: Any,
        *,
        of: Any = None,
        skip_locked: bool = False,
        read: bool = False,
        key_share: bool = False,
    ) -> Any:
        """``query`` locking the rows it selects until the transaction ends."""

    @abstractmethod
    def advisory_lock(self, conn: Connection, namespace: int, key: str) -> None:
        """Take ``key``'s lock in ``namespace`` until the transaction ends (wait for it)."""

    @abstractmethod
    def try_advisory_lock(self, conn: Connection, namespace: int, key: str) -> bool:
        """Take ``key``'s lock if nobody holds it; whether this transaction holds it now."""

    @abstractmethod
    def notify(self, conn: Connection, channel: str, payload: str) -> None:
        """Announce ``payload`` on ``channel`` when the transaction commits."""

    @abstractmethod
    def sortable_time(self, column: Any) -> Any:
        """``column`` (a timestamp) as it compares and orders exactly."""

    @abstractmethod
    def bound_time(self, value: datetime) -> Any:
        """``value`` bound for comparison with ``sortable_time``."""

    @abstractmethod
    def identity(self, execute: Callable[[Any], list[Any]]) -> tuple[Any, ...]:
        """What tells one database from another, read through ``execute`` (a caller's
        connection: ``store/joined.py`` checks it is to ductor's database)."""

    def inject_clock(self, engine: Engine, now: clock.Clock) -> None:
        """Make ``now`` the store's time for ``engine`` (the test harness's controlled
        clock); a database whose server keeps the time refuses it."""
        if self.server_clock:
            raise ValueError(f"a clock can only be injected into a SQLite engine, not {self.name}")
        clock.inject(engine, now)

    def engine_identity(self, engine: Engine) -> tuple[Any, ...]:
        """``identity`` of ductor's own database."""
        with engine.connect() as conn:
            return self.identity(lambda s: list(conn.execute(s).all()))


class PostgresDialect(Dialect):
    name = "postgresql"
    server_clock = True
    one_statement = True
    dedupes_wakes = True
    notifies = True
    bounds_transactions = True
    may_lose_commits = True
    enforces_foreign_keys = True
    #: Every statement of the read sees the snapshot of its first.
    snapshot_options: ClassVar[Mapping[str, Any]] = {"isolation_level": "REPEATABLE READ"}

    def insert(self, table: sa.Table) -> Any:
        return postgresql.insert(table)

    def write_now(self, engine: Engine) -> Any:
        return sa.func.now()

    def now_on(self, conn: Connection) -> datetime:
        return _aware(conn.execute(sa.select(sa.func.now())).scalar_one())

    def db_now(self, engine: Engine) -> datetime:
        with engine.connect() as conn:
            value = conn.execute(sa.select(sa.func.now())).scalar_one()
        assert isinstance(value, datetime)
        return value

    def statement_now(self, conn: Connection) -> datetime:
        # clock_timestamp(): now() is the transaction's start.
        value = conn.execute(sa.select(sa.func.clock_timestamp())).scalar_one()
        assert isinstance(value, datetime)
        return value

    def lock_rows(
        self,
        query: Any,
        *,
        of: Any = None,
        skip_locked: bool = False,
        read: bool = False,
        key_share: bool = False,
    ) -> Any:
        return query.with_for_update(of=of, skip_locked=skip_locked, read=read, key_share=key_share)

    def advisory_lock(self, conn: Connection, namespace: int, key: str) -> None:
        conn.execute(sa.select(sa.func.pg_advisory_xact_lock(namespace, sa.func.hashtext(key))))

    def try_advisory_lock(self, conn: Connection, namespace: int, key: str) -> bool:
        return bool(
            conn.execute(
                sa.select(sa.func.pg_try_advisory_xact_lock(namespace, sa.func.hashtext(key)))
            ).scalar_one()
        )

    def notify(self, conn: Connection, channel: str, payload: str) -> None:
        conn.execute(sa.select(sa.func.pg_notify(channel, payload)))

    def sortable_time(self, column: Any) -> Any:
        return column

    def bound_time(self, value: datetime) -> Any:
        return value

    def identity(self, execute: Callable[[Any], list[Any]]) -> tuple[Any, ...]:
        row = execute(
            sa.text(
                "SELECT current_database(), extract(epoch FROM pg_postmaster_start_time())::text"
            )
        )[0]
        return ("postgresql", row[0], row[1])


#: SQLite keeps timestamps as text whose format depends on who wrote them (its own
#: ``CURRENT_TIMESTAMP`` has no fraction, SQLAlchemy writes microseconds): compared as text,
#: equal times would differ, so both sides go through this one format.
_SQLITE_TIME_FORMAT = "%Y-%m-%d %H:%M:%f"


class SqliteDialect(Dialect):
    name = "sqlite"
    server_clock = False
    one_statement = False
    dedupes_wakes = False
    notifies = False
    bounds_transactions = False
    may_lose_commits = False  # a file on this machine
    enforces_foreign_keys = False  # PRAGMA foreign_keys is off, SQLite's default
    #: One connection's transaction is one snapshot already.
    snapshot_options: ClassVar[Mapping[str, Any]] = {}

    def insert(self, table: sa.Table) -> Any:
        return sqlite.insert(table)

    def write_now(self, engine: Engine) -> Any:
        return clock.now(engine)

    def now_on(self, conn: Connection) -> datetime:
        return clock.now(conn.engine)

    def db_now(self, engine: Engine) -> datetime:
        return clock.now(engine)

    def statement_now(self, conn: Connection) -> datetime:
        # Python's clock, not an injected one: what a schedule's trigger always used here.
        return datetime.now(UTC)

    def lock_rows(
        self,
        query: Any,
        *,
        of: Any = None,
        skip_locked: bool = False,
        read: bool = False,
        key_share: bool = False,
    ) -> Any:
        # BEGIN IMMEDIATE keeps every other writer out until the transaction ends.
        return query

    def advisory_lock(self, conn: Connection, namespace: int, key: str) -> None:
        return None  # BEGIN IMMEDIATE serializes every writer already

    def try_advisory_lock(self, conn: Connection, namespace: int, key: str) -> bool:
        return True  # nobody else can be writing

    def notify(self, conn: Connection, channel: str, payload: str) -> None:
        return None  # waiters on SQLite poll (store/finishes.py)

    def sortable_time(self, column: Any) -> Any:
        return sa.func.strftime(_SQLITE_TIME_FORMAT, column)

    def bound_time(self, value: datetime) -> Any:
        utc = value.astimezone(UTC).replace(tzinfo=None)
        return sa.func.strftime(_SQLITE_TIME_FORMAT, sa.literal(utc.isoformat(sep=" ")))

    def identity(self, execute: Callable[[Any], list[Any]]) -> tuple[Any, ...]:
        files = {r[1]: r[2] for r in execute(sa.text("PRAGMA database_list"))}
        path = files.get("main") or ""
        # An in-memory database is private to its connection: never ductor's.
        return ("sqlite", os.path.realpath(path) if path else f"<memory {id(execute)}>")

    def inject_clock(self, engine: Engine, now: clock.Clock) -> None:
        """Make ``now`` the store's time for ``engine`` (the test harness's controlled
        clock); a database whose server keeps the time refuses it."""
        if self.server_clock:
            raise ValueError(f"a clock can only be injected into a SQLite engine, not {self.name}")
        clock.inject(engine, now)

    def engine_identity(self, engine: Engine) -> tuple[Any, ...]:
        # From the URL: on SQLite our engine begins every transaction IMMEDIATE, which would
        # wait for the caller's, who may hold the write lock already.
        path = engine.url.database or ""
        real = os.path.realpath(path) if path and path != ":memory:" else "<memory>"
        return ("sqlite", real)


POSTGRES = PostgresDialect()
SQLITE = SqliteDialect()

_BY_NAME: dict[str, Dialect] = {d.name: d for d in (POSTGRES, SQLITE)}


def dialect_named(name: str) -> Dialect | None:
    """The dialect object for SQLAlchemy's name of a database; None for a database ductor
    does not run on (a caller's connection may be to any)."""
    return _BY_NAME.get(name)


def dialect_of(bind: Engine | Connection) -> Dialect:
    """The dialect object of an engine or a connection (a dictionary read)."""
    found = _BY_NAME.get(bind.dialect.name)
    if found is None:
        raise ValueError(
            f"ductor's database must be PostgreSQL or SQLite, not {bind.dialect.name!r}"
        )
    return found


def _aware(value: Any) -> datetime:
    """SQLite hands back naive datetimes (and a driver may); every datetime we keep is UTC."""
    assert isinstance(value, datetime)
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
