"""Engines per process, created after fork, and the transient-error retry used by every writer.

A prefork child must never reuse a connection pool inherited from its parent (two processes
on one socket corrupt the protocol), so engines are keyed by (pid, url, prepare) and built
lazily.

Nothing here relies on session state, so the URL may go through PgBouncer in transaction
pooling mode: every statement runs in a transaction (or alone, autocommit), the advisory locks
are transaction-scoped, no ``SET`` outlives its transaction. The one thing the pooler breaks is
psycopg's server-side prepared statements (a connection prepares a statement after
``PREPARE_THRESHOLD`` executions and the next transaction may land on another server
connection): ``prepare=False`` turns them off (``ductor_database_prepare``). LISTEN goes
through its own connection (``store/finishes.py``, ``ductor_listen_database_url``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any, TypeVar

import psycopg
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DataError, DBAPIError, OperationalError, StatementError

from ..errors import StoreUnavailable
from ..payloads import storable_text
from .dialect import dialect_of
from .schema import dumps_json

log = logging.getLogger("ductor_celery.store")

_engines: dict[tuple[int, str, bool], Engine] = {}

#: psycopg's own default: a statement is prepared on the server once it has been executed this
#: many times on a connection (the tick's commit, the claim, the loads: a worker's hot path).
PREPARE_THRESHOLD = 5
_lock = threading.Lock()

T = TypeVar("T")


class ValuesRefused(Exception):
    """The database (or the driver, binding them) refused the values themselves: writing them
    again cannot help, writing something without them can. Connection problems are not this:
    ``with_retry`` rides them out, then raises ``StoreUnavailable``."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        #: What the database said, one line, without the statement and its parameters.
        self.cause = cause


@contextmanager
def refusing_values() -> Iterator[None]:
    """Turn the driver's refusal of a statement's values into ``ValuesRefused`` (the one place
    that knows which SQLAlchemy and driver errors mean that)."""
    try:
        yield
    except StatementError as exc:
        if isinstance(exc, DataError) or not isinstance(exc, DBAPIError):
            raise ValuesRefused(one_line_cause(exc)) from exc
        raise
    except psycopg.DataError as exc:  # a statement sent to psycopg's cursor directly
        raise ValuesRefused(one_line_cause(exc)) from exc


def one_line_cause(exc: BaseException) -> str:
    """What refused a value, as one storable line (it goes into the step's error), without
    the statement or its parameters."""
    orig = (
        exc.orig if isinstance(exc, StatementError) and isinstance(exc.orig, BaseException) else exc
    )
    try:
        text = " ".join(str(orig).split())
    except Exception:  # noqa: BLE001 - a driver message that cannot be printed
        text = "<unprintable>"
    line = f"{type(orig).__name__}: {text}" if text else type(orig).__name__
    return storable_text(line)[:500]  # it is stored in an error


@contextmanager
def autocommit(engine: Engine) -> Iterator[Connection]:
    """A connection for one statement, one round trip: no BEGIN/COMMIT around it (a single
    statement is atomic by itself). psycopg switches autocommit on the client side.

    Inside ``keeping_autocommit`` it is the thread's kept one (``lend_autocommit``), kept
    again after statements that went well; one that raised goes back to the pool."""
    conn = lend_autocommit(engine)
    try:
        yield conn
    except BaseException:
        conn.close()
        raise
    give_back(conn)


class _Kept(threading.local):
    #: The engine ``keeping_autocommit`` keeps a connection of in this thread, if any.
    engine: Engine | None = None
    #: That connection, while nobody uses it.
    conn: Connection | None = None
    #: When it was given back (``time.monotonic()``).
    since: float = 0.0


_kept = _Kept()

#: A kept connection idle longer than this (a slow step ran meanwhile) is checked in and a
#: new one checked out at its next use: the check-out is where the pool replaces a connection
#: past ``pool_recycle``, or of a pool a failover invalidated, and where ``_refresh_plans``
#: runs; and a connection idle for long is the one a proxy's idle timeout may have dropped.
KEPT_IDLE_AT_MOST_S = 1.0

# A child forked mid-chain (a step that forks) never uses or closes its parent's connection.
os.register_at_fork(after_in_child=lambda: _kept.__dict__.clear())


@contextmanager
def keeping_autocommit(engine: Engine) -> Iterator[None]:
    """Within it (this thread: a step worker's chain of inline steps), ``engine``'s autocommit
    connections are one, kept between uses instead of checked in to the pool after each and
    out again before the next: a check-out and check-in with its isolation level set and
    reset cost SQLAlchemy about 40 us of CPU, once per inline step (benchmarks/README.md,
    tenth round). It is given back at the end, when a statement on it raised, before its
    thread begins a tick's transaction (``release_kept``), and at its next use after
    ``KEPT_IDLE_AT_MOST_S`` idle; it is never kept past the pool's size (``give_back``), so
    kept ones never make a thread wait for the pool. A nested one keeps nothing more."""
    if _kept.engine is not None:
        yield
        return
    _kept.engine = engine
    try:
        yield
    finally:
        try:
            release_kept()
        finally:
            _kept.engine = None


def lend_autocommit(engine: Engine) -> Connection:
    """The thread's kept autocommit connection of ``engine`` (``keeping_autocommit``), else a
    new one from the pool; ``give_back`` (or ``close``) when done with it."""
    if _kept.engine is engine:
        conn = _kept.conn
        if conn is not None:
            _kept.conn = None
            fresh = time.monotonic() - _kept.since <= KEPT_IDLE_AT_MOST_S
            if fresh and not (conn.closed or conn.invalidated):
                return conn
            conn.close()
    return engine.connect().execution_options(isolation_level="AUTOCOMMIT")


def give_back(conn: Connection) -> None:
    """An autocommit connection whose statements went well: kept for the thread's next one
    (``keeping_autocommit``), else checked in to the pool. Kept only while at most the pool's
    size are out, itself included, so kept ones never take the pool's overflow: an idle kept
    one beside another of its thread's (a large value's transaction, a step that starts a
    run) never makes a thread wait for the pool; with many threads at once, each checks its
    connection in as before."""
    if (
        _kept.engine is conn.engine
        and _kept.conn is None
        and not (conn.closed or conn.invalidated)
        and _has_room(conn.engine.pool)
    ):
        if conn.in_transaction():
            # SQLAlchemy's own begun one (its execute begins one even in autocommit, where
            # the driver has none): ended as the pool's check-in would.
            conn.rollback()
        _kept.conn = conn
        _kept.since = time.monotonic()
    else:
        conn.close()


def _has_room(pool: Any) -> bool:
    # Only PostgreSQL's paths keep (autocommit connections are theirs); a pool without a
    # size (a NullPool, an in-memory SQLite's) never keeps.
    checkedout, size = getattr(pool, "checkedout", None), getattr(pool, "size", None)
    if checkedout is None or size is None:
        return False
    return bool(checkedout() <= size())


def release_kept() -> None:
    """Check the thread's kept autocommit connection, if any, in to the pool."""
    conn, _kept.conn = _kept.conn, None
    if conn is not None:
        conn.close()


def get_engine(url: str, *, prepare: bool = True) -> Engine:
    """The engine for ``url`` in this process (a new one after a fork). ``prepare``: let
    psycopg prepare statements on the server (``Settings.database_prepare``; SQLite ignores
    it)."""
    key = (os.getpid(), url, prepare or url.startswith("sqlite"))
    engine = _engines.get(key)
    if engine is not None:
        return engine
    with _lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _create_engine(url, prepare=key[2])
            _engines[key] = engine
    return engine


def open_engine(url: str, *, prepare: bool = True) -> Engine | None:
    """``get_engine``'s engine if this process has it, else ``None`` (never makes one): for
    a background look that must stop once its engine was forgotten or disposed of."""
    return _engines.get((os.getpid(), url, prepare or url.startswith("sqlite")))


def _create_engine(url: str, *, prepare: bool) -> Engine:
    if url.startswith("sqlite"):
        path = sa.engine.make_url(url).database
        if path and path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        engine = sa.create_engine(
            url,
            json_serializer=dumps_json,
            connect_args={"check_same_thread": False, "timeout": 30},
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            # WAL lets readers run beside the single writer; the busy timeout waits for it.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Any) -> None:
            # Take the write lock up front so two writers serialize instead of deadlocking.
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    # No pool_pre_ping: it costs a round trip per checkout, and every caller already retries
    # a whole transaction on a dropped connection (with_retry), which also covers a restart
    # and a failover (the first error invalidates the whole pool; the retry reconnects).
    engine = sa.create_engine(
        url,
        json_serializer=dumps_json,
        pool_size=5,
        max_overflow=10,
        pool_recycle=1800,
        connect_args={
            **connect_defaults(url),
            # None: never prepare (what a transaction-pooling PgBouncer before 1.21 needs).
            "prepare_threshold": PREPARE_THRESHOLD if prepare else None,
        },
    )
    event.listen(engine, "handle_error", _on_error)
    if prepare:
        event.listen(engine, "checkout", _refresh_plans)
    return engine


#: A prepared statement's plan is made once per connection and kept until a table it reads
#: is analyzed again. One made while the attempts table held a few dozen rows (a new
#: database) scans the table, and keeps scanning it as a scatter grows it to thousands of
#: rows before autovacuum's next look: a tick's commit then took 4 ms instead of 0.5. So a
#: pooled connection has its plans made anew (``DISCARD PLANS``: its prepared statements
#: stay, each is planned again at its next use, from the tables as they are) when it is
#: checked out at least this long after its last time: one round trip, and a planning of
#: each statement it then runs, per connection and period.
PLANS_REFRESHED_EVERY_S = 10.0


def _refresh_plans(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
    """Pool checkout (prepared statements on): ``PLANS_REFRESHED_EVERY_S``. A connection that
    fails it is handed to the pool as lost, which gives the caller a new one."""
    now = time.monotonic()
    made = record.info.setdefault("plans_made_at", now)
    if now - made < PLANS_REFRESHED_EVERY_S:
        return
    record.info["plans_made_at"] = now
    autocommit = dbapi_conn.autocommit
    try:
        # In autocommit for the one statement: a checked-out connection is idle, and must
        # stay so (no transaction left open behind the caller).
        dbapi_conn.autocommit = True
        dbapi_conn.execute("DISCARD PLANS", prepare=False)
        dbapi_conn.autocommit = autocommit
    except psycopg.Error as exc:
        raise sa.exc.DisconnectionError(f"refreshing plans: {exc}") from exc


# --- failover: finding the primary again (docs/reliability.md, "Database failover") --------

#: libpq connection settings ductor adds unless the URL sets them. A host that does not
#: answer (down, or cut off by the network) is given up after ``connect_timeout`` seconds, and
#: libpq goes on to the next host of a multi-host URL (psycopg's own default is 130 s per
#: host); keepalives and ``tcp_user_timeout`` (milliseconds) notice a server gone silent in
#: about a minute, where the OS defaults take two hours on an idle connection and some
#: fifteen minutes with data in flight.
CONNECT_DEFAULTS: dict[str, str] = {
    "connect_timeout": "5",
    "keepalives": "1",
    "keepalives_idle": "30",
    "keepalives_interval": "10",
    "keepalives_count": "3",
    "tcp_user_timeout": "30000",
}

#: A write on a server that is (now) a standby: "cannot execute ... in a read-only
#: transaction". The connection reached the old primary after it was demoted, or a DNS name
#: that still pointed at it: the pool must be dropped for the retry to find the new one.
_READ_ONLY_SQLSTATES = frozenset({"25006"})


def connect_defaults(url: str) -> dict[str, str]:
    """``CONNECT_DEFAULTS`` without the settings ``url`` chooses itself (PostgreSQL only)."""
    parsed = sa.engine.make_url(url)
    if parsed.get_backend_name() != "postgresql":
        return {}
    return {k: v for k, v in CONNECT_DEFAULTS.items() if k not in parsed.query}


def psycopg_connect_args(url: str) -> dict[str, Any]:
    """Keyword arguments for ``psycopg.connect`` to the database ``url`` names: SQLAlchemy's
    own translation (which passes several hosts and ports through as libpq's lists) plus
    ``connect_defaults``. For the connections ductor opens without SQLAlchemy (LISTEN)."""
    parsed = sa.engine.make_url(url)
    _args, kwargs = parsed.get_dialect()().create_connect_args(parsed)
    return {**connect_defaults(url), **kwargs}


#: How many times this process found the database gone (a dropped connection, a failed
#: connect, a write refused as read-only): ``outages()``.
_outages = 0


def outages() -> int:
    """A count that moves whenever this process has found its PostgreSQL database gone since
    it started: whoever remembers something written before can tell it may have been lost
    (``runtime/lost_outcomes.py``)."""
    return _outages


def _on_error(context: Any) -> None:
    """Every database error of a PostgreSQL engine. A write refused as read-only invalidates
    the connection (and the pool) as a dropped connection does, so ``with_retry`` retries it
    on a new one; a lost or refused connection counts as an outage."""
    global _outages
    if getattr(context.original_exception, "sqlstate", None) in _READ_ONLY_SQLSTATES:
        context.is_disconnect = True
    if context.is_disconnect or context.connection is None:  # None: the connect failed
        _outages += 1


#: PostgreSQL's "lock_timeout" error: a tick waited ``TICK_LOCK_TIMEOUT`` for a run's lock (the
#: statement failed as a whole, nothing written).
LOCK_NOT_AVAILABLE = "55P03"

#: psycopg's own errors, from a statement sent straight to its cursor, that mean "this
#: connection is no use": lost, idle too long in its transaction (25P03), or on a server that
#: became read-only (a demoted primary).
_LOST_CONNECTION_SQLSTATES = _READ_ONLY_SQLSTATES | {"25P03"}


@contextmanager
def driver_errors(conn: Connection) -> Iterator[None]:
    """Around a statement sent to psycopg's cursor directly (bypassing SQLAlchemy, whose
    ``_on_error`` would see it): a lost or read-only connection is invalidated, so the pool
    never hands it out again, and counted as an outage, as SQLAlchemy's path does; the error
    goes on to ``with_retry``, for which it is transient (``is_transient``).

    Lost means what SQLAlchemy's psycopg dialect means (psycopg found the connection closed
    or broken), or one of ``_LOST_CONNECTION_SQLSTATES``. Any other error, an
    ``OperationalError`` from a healthy connection included (a lock or statement timeout, a
    deadlock, a serialization failure), leaves the connection to the pool, where it is rolled
    back as any other, and counts no outage: an outage makes ``runtime/lost_outcomes.py``
    write again every outcome it keeps. A lost connection invalidates the pool, as
    SQLAlchemy's path does (``_on_error``)."""
    global _outages
    try:
        yield
    except psycopg.Error as exc:
        if exc.sqlstate in _LOST_CONNECTION_SQLSTATES or _broken(conn):
            _outages += 1
            # What SQLAlchemy's own path does on a disconnect: every connection the pool made
            # before now is replaced at its next check-out, not only this one (after a restart
            # or a failover they are all dead, and each would cost a retry of its own).
            conn.engine.pool._invalidate(conn.connection, exc)
            conn.invalidate(exc)
        raise


def _broken(conn: Connection) -> bool:
    """Whether psycopg found the connection under ``conn`` closed or lost."""
    dbapi: Any = conn.connection.dbapi_connection
    return dbapi is None or bool(dbapi.closed) or bool(dbapi.broken)


def driver_compiled(statement: Any) -> Any:
    """``statement`` compiled for psycopg's own cursor (``driver_cursor``): ``str()`` of it
    is the text with ``%(name)s`` parameters, ``.params`` the values it binds. Compile once
    per process (``functools.cache``) and send the text on every call."""
    from sqlalchemy.dialects.postgresql.psycopg import dialect

    return statement.compile(dialect=dialect())  # type: ignore[no-untyped-call]


@contextmanager
def driver_cursor(conn: Connection, row_factory: Any = None) -> Iterator[Any]:
    """psycopg's own cursor (with ``row_factory``, if given) on the connection of ``conn``,
    inside the transaction SQLAlchemy opened on it, for a hot statement whose text is fixed
    and whose values are plain (SQLAlchemy's execution path would cost more than the
    statement); its errors as ``driver_errors`` says.

    The cursor is the connection's own, kept with it for the next statement
    (``_kept_cursor``). Whoever takes it runs its statement and reads its rows inside the
    ``with``: they are dropped at its end."""
    with driver_errors(conn):  # a new cursor on a connection found closed raises too
        cursor = _kept_cursor(conn.connection, row_factory)
        try:
            yield cursor
        finally:
            # What its statement sent and got back (a run's state, a step's arguments) is
            # not kept with an idle connection: psycopg's own reset at the next execute, done
            # now (a private method: tests/integration/test_driver_cursor.py sees it works).
            reset = getattr(cursor, "_reset", None)
            if reset is not None:
                reset()


#: The key of a connection's kept cursors in its pool entry's ``info``.
_CURSORS = "ductor_cursors"


def _kept_cursor(proxied: Any, row_factory: Any) -> Any:
    """The cursor kept with this DBAPI connection for ``row_factory``, made at its first use.

    A new cursor for every statement cost psycopg 25-30 us of CPU more for a statement
    returning ten columns (benchmarks/README.md, eighth round): each new cursor looks up and
    builds the loader of every column of its first result again. The pool entry's ``info``
    lives as long as the DBAPI connection (it is cleared when the connection is replaced),
    and a checked-out connection is one thread's: the cursor goes with it. A cursor closed,
    or of another connection (never expected), is replaced."""
    cursors = proxied.info.get(_CURSORS)
    if cursors is None:
        cursors = proxied.info[_CURSORS] = {}
    dbapi = proxied.dbapi_connection
    cursor = cursors.get(row_factory)
    if cursor is None or cursor.closed or cursor.connection is not dbapi:
        cursor = dbapi.cursor() if row_factory is None else dbapi.cursor(row_factory=row_factory)
        cursors[row_factory] = cursor
    return cursor


def server_identity(engine: Engine) -> str:
    """Which PostgreSQL server answers, since when: it changes when a failover or a restart
    put another server (or the same one, started again) behind the URL, pooler or DNS name
    included. One round trip, nothing read from a table."""
    with autocommit(engine) as conn:
        row = conn.execute(
            sa.text(
                "SELECT concat_ws(' ', inet_server_addr(), inet_server_port(), "
                "pg_postmaster_start_time())"
            )
        ).scalar_one()
    return str(row)


def dispose_all() -> None:
    """Forget every engine of this process (used after fork and at shutdown)."""
    with _lock:
        for key, engine in list(_engines.items()):
            if key[0] == os.getpid():
                engine.dispose()
            del _engines[key]


#: Called with the URL by ``forget_engine``: this process's other connections to it go with
#: its engine (``store/finishes.py``'s idle listeners).
_forget_hooks: list[Callable[[str], None]] = []


def on_forget(hook: Callable[[str], None]) -> None:
    """Have ``forget_engine(url)`` call ``hook(url)`` too."""
    _forget_hooks.append(hook)


def forget_engine(url: str) -> None:
    """Dispose of this process's engine for ``url`` and drop it (a throwaway database), and
    close its other connections to ``url``."""
    with _lock:
        engines = [_engines.pop((os.getpid(), url, p), None) for p in (True, False)]
    for engine in engines:
        if engine is not None:
            engine.dispose()
    for hook in _forget_hooks:
        hook(url)


def db_now(engine: Engine) -> datetime:
    """The database's clock on PostgreSQL (the one ticks and the sweeper go by), this
    process's on SQLite (the same machine's clock there; the test harness's, when it injected
    one: store/clock.py)."""
    return dialect_of(engine).db_now(engine)


def aware(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every datetime we keep is UTC-aware."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


def is_transient(exc: BaseException) -> bool:
    """A dropped connection or a restarting server: worth retrying the whole transaction.
    SQLAlchemy's wrapped errors, and psycopg's own from the statements that go to its cursor
    directly (the tick's hot statements, store/load.py and store/pg_commit.py)."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    if isinstance(exc, psycopg.OperationalError):
        return True  # connection failures, restarts, serialization failures, deadlocks
    if isinstance(exc, psycopg.Error) and exc.sqlstate in _LOST_CONNECTION_SQLSTATES:
        return True  # a read-only server (a demoted primary), a transaction timed out idle
    if not isinstance(exc, OperationalError):
        return False
    if type(exc.orig).__module__.startswith("sqlite3"):
        # SQLite raises OperationalError for "no such table" too; only lock waits pass.
        text = str(exc.orig).lower()
        return "locked" in text or "busy" in text
    return True  # psycopg: connection failures, restarts, serialization failures, deadlocks


def brief(exc: BaseException) -> str:
    """An error for a log line: its first line (a failed multi-host connect lists every host
    on lines of its own; SQLAlchemy adds the statement and its parameters)."""
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:500]


#: The end (``time.monotonic()``) of every retry in this context, set by ``retry_deadline``.
_retry_end: ContextVar[float | None] = ContextVar("ductor_retry_end", default=None)


@contextmanager
def retry_deadline(seconds: float) -> Iterator[None]:
    """Within it (this thread or task), ``with_retry`` gives up with ``StoreUnavailable`` at
    most ``seconds`` from now, whatever deadline its caller asked for: for a request someone
    is waiting on (a webhook's delivery, an HTTP start), which is better answered 503 soon
    than held for minutes while the database is away. One end for every call inside; a
    nested one never extends it."""
    end = time.monotonic() + seconds
    outer = _retry_end.get()
    token = _retry_end.set(end if outer is None else min(outer, end))
    try:
        yield
    finally:
        _retry_end.reset(token)


def with_retry(
    fn: Callable[[], T],
    *,
    what: str,
    deadline_s: float = 120.0,
    first_delay: float = 0.1,
    max_delay: float = 2.0,
) -> T:
    """Run ``fn`` (a whole transaction), retrying transient database errors until a deadline
    (``deadline_s`` from now, or the end of an enclosing ``retry_deadline`` if sooner).

    Only for idempotent or conditional writes: a commit whose acknowledgement was lost is
    retried, so the write must be safe to apply twice (ours are guarded by tokens, versions
    and unique keys).
    """
    end = time.monotonic() + deadline_s
    cap = _retry_end.get()
    if cap is not None:
        end = min(end, cap)
    delay = first_delay
    while True:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - filtered just below
            if not is_transient(exc):
                raise
            left = end - time.monotonic()
            if left < 0:
                raise StoreUnavailable(f"{what}: database unreachable: {exc}") from exc
            log.warning("%s: database error, retrying in %.1fs: %s", what, delay, brief(exc))
            time.sleep(min(delay, left) if cap is not None else delay)
            delay = min(delay * 2, max_delay)
