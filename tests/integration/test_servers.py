"""Smoke tests for the test-server fixtures (tests/servers.py, conftest.py).

If these fail, every database or broker test would fail too, with a less helpful message.
"""

from __future__ import annotations

import uuid

import pytest
import redis
import sqlalchemy as sa
from servers import PostgresServer, RedisServer


def _dbname(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def test_pg_listens_on_loopback_only(pg_server: PostgresServer) -> None:
    engine = sa.create_engine(pg_server.url())
    try:
        with engine.connect() as conn:
            assert conn.scalar(sa.text("SHOW listen_addresses")) == "127.0.0.1"
            assert conn.scalar(sa.text("SHOW fsync")) == "off"
            assert conn.scalar(sa.text("SHOW max_connections")) == "500"
    finally:
        engine.dispose()


def test_pg_create_database_from_template(pg_server: PostgresServer) -> None:
    template, copy = _dbname("tpl"), _dbname("copy")
    pg_server.create_database(template)
    # Keep a pooled connection to the template open: create_database must cope with it.
    tpl_engine = sa.create_engine(pg_server.url(template))
    copy_engine = sa.create_engine(pg_server.url(copy))
    try:
        with tpl_engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE item (id int PRIMARY KEY)"))
            conn.execute(sa.text("INSERT INTO item VALUES (1), (2)"))
        pg_server.create_database(copy, template=template)
        with copy_engine.connect() as conn:
            assert conn.scalars(sa.text("SELECT id FROM item ORDER BY id")).all() == [1, 2]
    finally:
        tpl_engine.dispose()
        copy_engine.dispose()
        pg_server.drop_database(copy)
        pg_server.drop_database(template)
    with pytest.raises(sa.exc.OperationalError):
        with sa.create_engine(pg_server.url(copy)).connect():
            pass


def test_pg_restart_keeps_url_and_data(pg_server: PostgresServer) -> None:
    name = _dbname("restart")
    pg_server.create_database(name)
    url_before = pg_server.url(name)
    engine = sa.create_engine(url_before, pool_pre_ping=True)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (v text)"))
            conn.execute(sa.text("INSERT INTO t VALUES ('kept')"))
        in_flight = engine.connect()
        in_flight.execute(sa.text("SELECT 1"))

        pg_server.restart()

        assert pg_server.url(name) == url_before
        # The session that was open across the restart is gone (fast shutdown)...
        with pytest.raises(sa.exc.OperationalError):
            in_flight.execute(sa.text("SELECT 1"))
        in_flight.close()
        # ...and new connections to the same URL work and see committed data.
        with engine.connect() as conn:
            assert conn.scalar(sa.text("SELECT v FROM t")) == "kept"
    finally:
        engine.dispose()
        pg_server.drop_database(name)


def test_pg_kill_then_start_recovers(pg_server: PostgresServer) -> None:
    name = _dbname("crash")
    pg_server.create_database(name)
    engine = sa.create_engine(pg_server.url(name), pool_pre_ping=True)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (v int)"))
            conn.execute(sa.text("INSERT INTO t VALUES (7)"))
        pg_server.kill()
        assert not pg_server.running
        pg_server.start()  # crash recovery
        with engine.connect() as conn:
            assert conn.scalar(sa.text("SELECT v FROM t")) == 7
    finally:
        engine.dispose()
        pg_server.drop_database(name)


def test_redis_ping_and_restart(redis_server: RedisServer) -> None:
    url = redis_server.url(1)
    client = redis.Redis.from_url(url)
    try:
        assert client.ping()
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        client.set("k", "v")
    finally:
        client.close()

    redis_server.restart()

    assert redis_server.url(1) == url
    client = redis.Redis.from_url(url)
    try:
        assert client.ping()
        assert client.get("k") is None  # no persistence: a restart is a lost broker
    finally:
        client.close()
