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
from datetime import UTC, datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DataError, DBAPIError, OperationalError, StatementError

from ..engine.payloads import storable_text
from ..errors import StoreUnavailable
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
            raise ValuesRefused(_one_line_cause(exc)) from exc
        raise


def _one_line_cause(exc: StatementError) -> str:
    orig = exc.orig if isinstance(exc.orig, BaseException) else exc
    try:
        text = " ".join(str(orig).split())
    except Exception:  # noqa: BLE001 - a driver message that cannot be printed
        text = "<unprintable>"
    line = f"{type(orig).__name__}: {text}" if text else type(orig).__name__
    return storable_text(line)[:500]  # it is stored in an error


def autocommit(engine: Engine) -> Any:
    """A connection for one statement, one round trip: no BEGIN/COMMIT around it (a single
    statement is atomic by itself). psycopg switches autocommit on the client side."""
    return engine.connect().execution_options(isolation_level="AUTOCOMMIT")


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
    # a whole transaction on a dropped connection (with_retry), which also covers a restart.
    return sa.create_engine(
        url,
        json_serializer=dumps_json,
        pool_size=5,
        max_overflow=10,
        pool_recycle=1800,
        # None: never prepare (what a transaction-pooling PgBouncer before 1.21 needs).
        connect_args={"prepare_threshold": PREPARE_THRESHOLD if prepare else None},
    )


def dispose_all() -> None:
    """Forget every engine of this process (used after fork and at shutdown)."""
    with _lock:
        for key, engine in list(_engines.items()):
            if key[0] == os.getpid():
                engine.dispose()
            del _engines[key]


def forget_engine(url: str) -> None:
    """Dispose of this process's engine for ``url`` and drop it (a throwaway database)."""
    with _lock:
        engines = [_engines.pop((os.getpid(), url, p), None) for p in (True, False)]
    for engine in engines:
        if engine is not None:
            engine.dispose()


def is_postgres(engine: Engine) -> bool:
    return engine.dialect.name == "postgresql"


def db_now(engine: Engine) -> datetime:
    """The database's clock on PostgreSQL (the one ticks and the sweeper go by), this
    process's on SQLite (the same machine's clock there; the test harness's, when it injected
    one: store/clock.py)."""
    if is_postgres(engine):
        with engine.connect() as conn:
            value = conn.execute(sa.select(sa.func.now())).scalar_one()
        assert isinstance(value, datetime)
        return value
    from . import clock  # here: clock.py is a leaf, db.py is imported by everything

    return clock.now(engine)


def aware(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every datetime we keep is UTC-aware."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


def is_transient(exc: BaseException) -> bool:
    """A dropped connection or a restarting server: worth retrying the whole transaction."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    if not isinstance(exc, OperationalError):
        return False
    if type(exc.orig).__module__.startswith("sqlite3"):
        # SQLite raises OperationalError for "no such table" too; only lock waits pass.
        text = str(exc.orig).lower()
        return "locked" in text or "busy" in text
    return True  # psycopg: connection failures, restarts, serialization failures, deadlocks


def with_retry(
    fn: Callable[[], T],
    *,
    what: str,
    deadline_s: float = 120.0,
    first_delay: float = 0.1,
    max_delay: float = 2.0,
) -> T:
    """Run ``fn`` (a whole transaction), retrying transient database errors until a deadline.

    Only for idempotent or conditional writes: a commit whose acknowledgement was lost is
    retried, so the write must be safe to apply twice (ours are guarded by tokens, versions
    and unique keys).
    """
    start = time.monotonic()
    delay = first_delay
    while True:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - filtered just below
            if not is_transient(exc):
                raise
            if time.monotonic() - start > deadline_s:
                raise StoreUnavailable(f"{what}: database unreachable: {exc}") from exc
            log.warning("%s: database error, retrying in %.1fs: %s", what, delay, exc)
            time.sleep(delay)
            delay = min(delay * 2, max_delay)
