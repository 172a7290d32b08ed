"""``Client.wait`` keeps its LISTEN connection for the next wait (store/finishes.py): a wait
LISTENs on an idle one instead of opening a connection, an idle one listens to nothing (the
server's notification queue never waits on it), one lost while idle is replaced, and a forked
process never uses its parent's."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from servers import PostgresServer

from ductor_celery.store import finishes
from ductor_celery.store.db import forget_engine, get_engine
from ductor_celery.store.migrate import upgrade


@pytest.fixture
def server() -> Iterator[PostgresServer]:
    with PostgresServer() as pg:
        pg.create_database("listen")
        upgrade(pg.url("listen"))
        yield pg


def _backends(pg: PostgresServer) -> set[int]:
    """The server's client backends other than the one asking."""
    with pg.connect("listen") as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'client backend' "
            "AND datname = 'listen' AND pid <> pg_backend_pid()"
        ).fetchall()
    return {r[0] for r in rows}


def _settled_backends(pg: PostgresServer, expect: Callable[[set[int]], bool]) -> set[int]:
    """The backends once ``expect`` holds of them, or after 5 s: a server process ends a
    moment after its client closed the connection."""
    deadline = time.monotonic() + 5
    while not expect(found := _backends(pg)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return found


def _listener_pid(listener: Any) -> int:
    conn: psycopg.Connection[Any] = listener._conn
    return int(conn.info.backend_pid)


def _notify(url: str, payload: str) -> None:
    with get_engine(url).begin() as conn:
        conn.execute(sa.select(sa.func.pg_notify(finishes.RUN_FINISHED_CHANNEL, payload)))


def _told_within(listener: Any, payload: str, url: str) -> float:
    _notify(url, payload)
    began = time.monotonic()
    listener.wait_for(payload, 5.0)
    return time.monotonic() - began


def test_a_second_wait_listens_on_the_first_ones_connection(server: PostgresServer) -> None:
    url = server.url("listen")
    engine = get_engine(url)
    try:
        with finishes.listener(engine, url) as first:
            pid = _listener_pid(first)
            assert _told_within(first, "run-1", url) < finishes.SAFETY_POLL_S / 2
        with finishes.listener(engine, url) as second:
            assert _listener_pid(second) == pid, "no new connection for the second wait"
            # Told at once: it LISTENs again (the notification from the first wait is left
            # behind or read, and only ever cuts a wait short).
            assert _told_within(second, "run-2", url) < finishes.SAFETY_POLL_S / 2
    finally:
        forget_engine(url)
    backends = _settled_backends(server, lambda found: pid not in found)
    assert pid not in backends, "forget_engine closes the idle listeners too"


def test_an_idle_listener_listens_to_nothing(server: PostgresServer) -> None:
    url = server.url("listen")
    engine = get_engine(url)
    try:
        with finishes.listener(engine, url) as listener:
            conn: psycopg.Connection[Any] = listener._conn
        channels = conn.execute("SELECT count(*) FROM pg_listening_channels()").fetchone()
        assert channels == (0,)
    finally:
        forget_engine(url)


def test_at_most_a_few_idle_listeners_are_kept(server: PostgresServer) -> None:
    url = server.url("listen")
    engine = get_engine(url)
    others = _backends(server)  # the migration's pooled connection
    try:
        with contextlib.ExitStack() as stack:
            for _ in range(finishes.MAX_IDLE_LISTENERS + 3):
                stack.enter_context(finishes.listener(engine, url))
            assert len(_backends(server) - others) == finishes.MAX_IDLE_LISTENERS + 3
        limit = finishes.MAX_IDLE_LISTENERS
        kept = _settled_backends(server, lambda found: len(found - others) <= limit) - others
        assert len(kept) == limit, "the others are closed"
    finally:
        forget_engine(url)


def test_a_listener_lost_while_idle_is_replaced(server: PostgresServer) -> None:
    url = server.url("listen")
    engine = get_engine(url)
    try:
        with finishes.listener(engine, url) as first:
            pid = _listener_pid(first)
        server.restart()
        engine.dispose()
        with finishes.listener(engine, url) as second:
            assert second._conn is not None
            assert _listener_pid(second) != pid
            assert _told_within(second, "run-3", url) < finishes.SAFETY_POLL_S / 2
    finally:
        forget_engine(url)


def test_a_forked_process_never_takes_its_parents_idle_listener(
    server: PostgresServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = server.url("listen")
    engine = get_engine(url)
    try:
        with finishes.listener(engine, url) as parent:
            pid = _listener_pid(parent)
        monkeypatch.setattr(finishes.os, "getpid", lambda: -7)  # "another process"
        with finishes.listener(engine, url) as child:
            assert _listener_pid(child) != pid
        monkeypatch.undo()
        with finishes.listener(engine, url) as again:
            assert _listener_pid(again) == pid, "the parent's is still there for the parent"
    finally:
        forget_engine(url)
        for conn, _ in finishes.IDLE_LISTENERS._idle.pop((-7, url), []):
            conn.close()


def _idle_count(url: str) -> int:
    return len(finishes.IDLE_LISTENERS._idle.get((os.getpid(), url), []))


def test_an_idle_listener_past_its_age_is_closed_not_reused(
    server: PostgresServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = server.url("listen")
    engine = get_engine(url)
    try:
        with finishes.listener(engine, url) as first:
            pid = _listener_pid(first)
        monkeypatch.setattr(finishes, "IDLE_LISTENER_MAX_AGE_S", 0.0)
        time.sleep(0.01)
        with finishes.listener(engine, url) as second:
            assert _listener_pid(second) != pid
        assert pid not in _settled_backends(server, lambda found: pid not in found)
    finally:
        forget_engine(url)


def test_one_idle_listener_found_dead_drops_them_all(server: PostgresServer) -> None:
    url = server.url("listen")
    engine = get_engine(url)
    try:
        with finishes.listener(engine, url), finishes.listener(engine, url):
            pass
        assert _idle_count(url) == 2
        server.restart()
        engine.dispose()
        began = time.monotonic()
        with finishes.listener(engine, url) as fresh:
            assert fresh._conn is not None
            assert _idle_count(url) == 0, "the other dead one is gone too"
        assert time.monotonic() - began < finishes.SAFETY_POLL_S
        assert _idle_count(url) == 1
    finally:
        forget_engine(url)


def test_a_wait_that_ends_in_an_error_does_not_hand_its_connection_back(
    server: PostgresServer,
) -> None:
    url = server.url("listen")
    engine = get_engine(url)
    try:
        with pytest.raises(RuntimeError), finishes.listener(engine, url) as listener:
            pid = _listener_pid(listener)
            raise RuntimeError("the wait failed")
        assert _idle_count(url) == 0
        assert pid not in _settled_backends(server, lambda found: pid not in found)
    finally:
        forget_engine(url)


def test_a_listener_in_use_when_its_url_is_forgotten_is_closed_when_its_wait_ends(
    server: PostgresServer,
) -> None:
    url = server.url("listen")
    engine = get_engine(url)
    with finishes.listener(engine, url) as listener:
        pid = _listener_pid(listener)
        forget_engine(url)
    assert _idle_count(url) == 0
    assert pid not in _settled_backends(server, lambda found: pid not in found)
