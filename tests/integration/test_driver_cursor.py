"""The hot statements' psycopg cursor is kept with its connection (``db.driver_cursor``):
one per row factory for as long as the DBAPI connection lives, a new one with a new
connection (PostgreSQL)."""

from __future__ import annotations

import psycopg
import pytest
from psycopg.rows import namedtuple_row

from ductor_celery.store.db import autocommit, driver_cursor, get_engine, psycopg_connect_args


def test_a_connection_runs_its_hot_statements_on_one_kept_cursor(database_url: str) -> None:
    engine = get_engine(database_url)
    with autocommit(engine) as conn:
        with driver_cursor(conn) as first:
            first.execute("SELECT 1")
            assert first.fetchone() == (1,)
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
    database_url: str,
) -> None:
    """A statement on the kept cursor of a connection the server dropped fails as any
    statement would (the connection is invalidated, ``with_retry`` tries again); the pool's
    new connection gets a new cursor, never the dead one's."""
    engine = get_engine(database_url)
    with autocommit(engine) as conn:
        with driver_cursor(conn) as kept:
            kept.execute("SELECT pg_backend_pid()")
            (lost,) = kept.fetchone()
        with psycopg.connect(**psycopg_connect_args(database_url), autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (lost,))
        with pytest.raises(psycopg.OperationalError), driver_cursor(conn) as same:
            assert same is kept
            same.execute("SELECT 1")
        assert conn.invalidated
    with autocommit(engine) as conn:
        with driver_cursor(conn) as fresh:
            fresh.execute("SELECT pg_backend_pid()")
            (now,) = fresh.fetchone()
    assert now != lost and fresh is not kept
