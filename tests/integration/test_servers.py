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


# --- RabbitMQ --------------------------------------------------------------------------------

import contextlib  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import kombu  # noqa: E402
from servers import RabbitMQServer, _child_pids  # noqa: E402


def _listening(pids: set[int]) -> set[str]:
    """The addresses (``ip:port``) the given processes listen on, read from /proc."""
    inodes: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    found = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            if width == 8:
                ip = ".".join(str(b) for b in raw[::-1])
            else:  # four little-endian words
                words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
                ip = "[" + b"".join(words).hex() + "]"
            found.add(f"{ip}:{int(port, 16)}")
    return found


def _node_pids(server: RabbitMQServer) -> set[int]:
    """The start script, the Erlang VM under it, and the private epmd."""
    assert server._proc is not None and server._epmd is not None
    return {server._proc.pid, *_child_pids(server._proc.pid), server._epmd.pid}


@pytest.mark.slow
def test_rabbitmq_is_private_on_loopback_only_and_leaves_nothing_behind() -> None:
    server = RabbitMQServer()
    server.start()
    try:
        pids = _node_pids(server)
        listening = _listening(pids)
        # AMQP, the Erlang distribution port and epmd: loopback only (epmd also binds ::1).
        assert f"127.0.0.1:{server.port}" in listening, listening
        assert len(listening) >= 3, listening
        loopback = ("127.0.0.1:", "[00000000000000000000000000000001]:")
        assert all(a.startswith(loopback) for a in listening), listening

        # Vhosts keep clusters apart. (restart() and kill() with messages on quorum queues:
        # tests/e2e/test_rabbitmq_e2e.py and test_broker_restart_e2e.py.)
        first, second = server.new_vhost(), server.new_vhost()
        assert first != second
        queue = kombu.Queue("q", queue_arguments={"x-queue-type": "quorum"})
        with kombu.Connection(server.url(first), transport_options={"confirm_publish": True}) as c:
            c.Producer().publish({"n": 1}, routing_key="q", declare=[queue])
        assert server.queues(first)["q"]["type"] == "quorum"
        assert server.queues(second) == {}
    finally:
        pids = _node_pids(server)
        server.stop()
    assert all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in pids), pids


def _zombie(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    return True
