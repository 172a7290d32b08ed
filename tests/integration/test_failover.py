"""The store's side of a database failover (issue 24), against a real primary and a streaming
standby (``StandbyServer``), no workers: a multi-host URL reconnects to whichever server is
the primary, a write that reaches a standby drops the pool instead of retrying on it, and
``wait()``'s LISTEN connection comes back after it is lost. The whole story with workers is
tests/e2e/test_failover_e2e.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from servers import LOOPBACK, PostgresServer, StandbyServer
from sqlalchemy.exc import InternalError

from ductor_celery.settings import normalize_url
from ductor_celery.store import finishes
from ductor_celery.store.db import forget_engine, get_engine, is_transient, outages, with_retry


@pytest.fixture
def pair() -> Iterator[tuple[PostgresServer, StandbyServer]]:
    with PostgresServer() as primary:
        with primary.connect() as conn:
            conn.execute("CREATE TABLE t (v int)")
        with StandbyServer(primary) as standby:
            yield primary, standby


def _multi_host(primary: PostgresServer, standby: StandbyServer) -> str:
    return normalize_url(
        f"postgresql://postgres@{LOOPBACK}:{primary.port},{LOOPBACK}:{standby.port}/postgres"
    )


def _port_of(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT inet_server_port()")).scalar_one())


def test_a_write_that_reaches_a_standby_drops_the_connection_and_is_retried(
    pair: tuple[PostgresServer, StandbyServer],
) -> None:
    """What a DNS name still pointing at the demoted primary looks like: the connection
    works, every write is refused as read-only. It must not stay in the pool."""
    _primary, standby = pair
    url = standby.url()
    engine = get_engine(url)
    try:
        before = outages()
        with pytest.raises(InternalError) as info, engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO t VALUES (1)"))
        assert "read-only transaction" in str(info.value)
        assert info.value.connection_invalidated
        assert is_transient(info.value)
        assert outages() > before
    finally:
        forget_engine(url)


def test_a_multi_host_url_finds_the_promoted_standby_by_itself(
    pair: tuple[PostgresServer, StandbyServer],
) -> None:
    primary, standby = pair
    url = _multi_host(primary, standby)
    engine = get_engine(url)
    try:
        assert _port_of(engine) == primary.port
        standby.wait_caught_up()
        primary.kill()
        # The standby alone for a second: it answers, but refuses to be the read-write host.
        threading.Timer(1.0, standby.promote).start()
        began = time.monotonic()

        def insert() -> None:
            with engine.begin() as conn:
                conn.execute(sa.text("INSERT INTO t VALUES (2)"))

        with_retry(insert, what="insert", deadline_s=30)
        assert 0.8 < time.monotonic() - began < 15
        assert _port_of(engine) == standby.port
    finally:
        forget_engine(url)


def test_wait_s_listen_connection_comes_back_after_a_failover(
    pair: tuple[PostgresServer, StandbyServer],
) -> None:
    primary, standby = pair
    url = _multi_host(primary, standby)
    engine = get_engine(url)
    try:
        with finishes.listener(engine, url) as listener:
            primary.kill()
            listener.wait_for("run-1", 2.0)  # the connection is lost: no error, a short wait
            standby.promote()
            deadline = time.monotonic() + 20
            told = False
            while not told and time.monotonic() < deadline:
                # Once it listens again, a finish notified on the new primary cuts a wait short.
                with engine.begin() as conn:
                    conn.execute(sa.select(sa.func.pg_notify(finishes.RUN_FINISHED_CHANNEL, "r")))
                began = time.monotonic()
                listener.wait_for("r", 5.0)
                told = time.monotonic() - began < finishes.SAFETY_POLL_S / 2
        assert told
    finally:
        forget_engine(url)


def test_doctor_names_the_server_that_answered_and_fails_on_a_standby(
    pair: tuple[PostgresServer, StandbyServer],
) -> None:
    from celery import Celery

    from ductor_celery import Ductor
    from ductor_celery.doctor import run_checks

    primary, standby = pair
    for url, ok, said in [
        (_multi_host(primary, standby), True, f"answered by {LOOPBACK}:{primary.port}"),
        (standby.url(), False, f"{LOOPBACK}:{standby.port} is a standby (read-only)"),
    ]:
        app = Celery(f"doctor{ok}", set_as_current=False, broker="memory://")
        try:
            database = run_checks(Ductor(app, database_url=url), timeout=0.1)[0]
            assert (database.name, database.ok) == ("database", ok), database
            assert said in database.detail
        finally:
            forget_engine(normalize_url(url))


def test_a_host_that_accepts_and_never_answers_is_given_up_after_connect_timeout(
    pg_server: PostgresServer,
) -> None:
    """A host that does not answer (here: accepts, then says nothing; a partition looks the
    same) costs ``connect_timeout`` (ductor's default 5 s; psycopg's own is 130 s), then
    libpq goes on to the next host."""
    import socket

    silent = socket.socket()
    silent.bind((LOOPBACK, 0))
    silent.listen(16)
    url = normalize_url(
        f"postgresql://postgres@{LOOPBACK}:{silent.getsockname()[1]},"
        f"{LOOPBACK}:{pg_server.port}/postgres"
    )
    try:
        engine = get_engine(url)
        began = time.monotonic()
        assert _port_of(engine) == pg_server.port
        assert 4 < time.monotonic() - began < 20
    finally:
        silent.close()
        forget_engine(url)
