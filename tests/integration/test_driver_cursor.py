"""The hot statements' psycopg cursor is kept with its connection (``db.driver_cursor``):
one per row factory for as long as the DBAPI connection lives, holding nothing between
statements, and a new one with a new connection (PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
import sqlalchemy as sa
from psycopg.rows import namedtuple_row

from ductor_celery.store import db
from ductor_celery.store.db import autocommit, driver_cursor, get_engine, psycopg_connect_args


@pytest.fixture
def one_connection(database_url: str) -> Iterator[sa.Engine]:
    """An engine whose pool holds one connection: each checkout is the same pool entry."""
    engine = sa.create_engine(database_url, pool_size=1, max_overflow=0)
    yield engine
    engine.dispose()


def test_a_connection_runs_its_hot_statements_on_one_kept_cursor(database_url: str) -> None:
    engine = get_engine(database_url)
    with autocommit(engine) as conn:
        with driver_cursor(conn) as first:
            first.execute("SELECT repeat('x', 100000)")
            assert len(first.fetchone()[0]) == 100000
        # Nothing of the statement stays with the idle cursor: not its result, not its query.
        assert first.pgresult is None and first._query is None
        with driver_cursor(conn) as again:
            again.execute("SELECT %(n)s::int", {"n": 2})
            assert again.fetchone() == (2,)
        with driver_cursor(conn, row_factory=namedtuple_row) as named:
            named.execute("SELECT 3 AS n")
            assert named.fetchone().n == 3
        with driver_cursor(conn, row_factory=namedtuple_row) as named_again:
            pass
        assert again is first and named_again is named and named is not first
        assert first.connection is conn.connection.dbapi_connection

        first.close()  # a closed cursor (nothing of ductor's closes one) is replaced
        with driver_cursor(conn) as replaced:
            replaced.execute("SELECT 4")
            assert replaced.fetchone() == (4,) and replaced is not first


def test_a_connection_the_server_dropped_is_replaced_with_a_cursor_of_its_own(
    database_url: str, one_connection: sa.Engine
) -> None:
    """A statement on the kept cursor of a connection the server dropped fails as any
    statement would (the connection is invalidated, ``with_retry`` tries again); the same
    pool entry's new connection gets a new cursor, never the dead one's."""
    with autocommit(one_connection) as conn:
        entry = conn.connection._connection_record
        with driver_cursor(conn) as kept:
            kept.execute("SELECT pg_backend_pid()")
            (lost,) = kept.fetchone()
        with psycopg.connect(**psycopg_connect_args(database_url), autocommit=True) as admin:
            # Waits (up to 5 s) until the backend is gone.
            assert admin.execute("SELECT pg_terminate_backend(%s, 5000)", (lost,)).fetchone()[0]
        with pytest.raises(psycopg.OperationalError), driver_cursor(conn) as same:
            assert same is kept
            same.execute("SELECT 1")
        assert conn.invalidated
    with autocommit(one_connection) as conn:
        assert conn.connection._connection_record is entry
        with driver_cursor(conn) as fresh:
            fresh.execute("SELECT pg_backend_pid()")
            (now,) = fresh.fetchone()
    assert now != lost and fresh is not kept and fresh.connection is not kept.connection


def test_an_error_on_a_healthy_connection_leaves_it_to_the_pool(
    database_url: str, one_connection: sa.Engine
) -> None:
    """A statement timeout (an ``OperationalError``, as a lock timeout, a deadlock or a
    serialization failure are) on a connection that is still fine neither invalidates it
    nor counts as an outage (which would have every kept outcome written again); a write
    refused as read-only (a demoted primary) still does both."""
    with one_connection.connect() as conn:
        entry, dbapi = conn.connection._connection_record, conn.connection.dbapi_connection
        conn.exec_driver_sql("SET LOCAL statement_timeout = 10")
        seen = db.outages()
        with pytest.raises(psycopg.errors.QueryCanceled), driver_cursor(conn) as cursor:
            cursor.execute("SELECT pg_sleep(5)")
        assert not conn.invalidated and db.outages() == seen
        conn.rollback()
    with one_connection.connect() as conn:
        # The same DBAPI connection, healthy, back from the pool.
        assert conn.connection._connection_record is entry
        assert conn.connection.dbapi_connection is dbapi
        conn.exec_driver_sql("SET TRANSACTION READ ONLY")
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction), driver_cursor(conn) as cur:
            cur.execute("CREATE TABLE refused (id int)")
        assert conn.invalidated and db.outages() == seen + 1


def test_a_lost_connection_has_the_pool_replace_every_older_one(database_url: str) -> None:
    """As SQLAlchemy's own path does on a disconnect: after a restart or a failover every
    pooled connection is dead, so the first one found lost invalidates them all, and the next
    check-out of another is a new connection, not a second failure (and a second retry)."""
    engine = sa.create_engine(database_url, pool_size=2, max_overflow=0)
    try:
        first, second = engine.connect(), engine.connect()
        pids = [c.exec_driver_sql("SELECT pg_backend_pid()").scalar_one() for c in (first, second)]
        first.rollback()
        second.close()  # back in the pool, idle
        with psycopg.connect(**psycopg_connect_args(database_url), autocommit=True) as admin:
            for pid in pids:
                assert admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,)).fetchone()[0]
        with pytest.raises(psycopg.OperationalError), driver_cursor(first) as cursor:
            cursor.execute("SELECT 1")
        assert first.invalidated
        first.close()
        with engine.connect() as conn:  # the pooled one the server dropped too: replaced
            assert conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one() not in pids
    finally:
        engine.dispose()
