"""A tick's hot statements go straight to psycopg's cursor (the timeouts, the run-row read, the
commit). After PostgreSQL restarts, the connections pooled before it are dead: a tick whose
first statement meets one must still be retried or fall back, as when SQLAlchemy sent it.
On a private server (the session's is shared by other tests)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from celery import Celery
from servers import PostgresServer

from ductor_celery import Ductor, RunStatus, Workflow
from ductor_celery.engine.status import AttemptOutcome
from ductor_celery.runtime.outcome import Outcome
from ductor_celery.runtime.steps import _record_and_advance
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store import attempts, load
from ductor_celery.store.db import (
    driver_cursor,
    driver_errors,
    forget_engine,
    get_engine,
    outages,
)
from ductor_celery.store.migrate import upgrade
from ductor_celery.store.schema import step_attempt


@pytest.fixture
def server() -> Iterator[PostgresServer]:
    with PostgresServer() as pg:
        pg.create_database("restart")
        upgrade(pg.url("restart"))
        yield pg


def _ductor(url: str, name: str) -> Any:
    app = Celery(f"restart{name}", set_as_current=False)
    app.conf.broker_url = "memory://"
    d = Ductor(app, database_url=url)
    d.runtime.dispatcher.send = lambda rows: None  # type: ignore[method-assign,assignment]
    d.runtime.dispatcher.wake = lambda run_id: None  # type: ignore[method-assign]
    d.runtime.dispatcher.first_tick = lambda run_id: None  # type: ignore[method-assign]
    d.step(name="restart.noop")(lambda ctx: 1)
    wf = Workflow("two")
    wf.step("a", "restart.noop")
    wf.step("b", "restart.noop", after=["a"])
    d.register(wf)
    return d


def _open_token(d: Any, run_id: str) -> str:
    with d.runtime.engine().connect() as conn:
        return str(
            conn.execute(
                sa.select(step_attempt.c.token).where(
                    step_attempt.c.run_id == run_id, step_attempt.c.finished_at.is_(None)
                )
            ).scalar_one()
        )


def test_coordinator_and_eager_ticks_survive_a_restart(
    server: PostgresServer, tmp_path: Path
) -> None:
    d = _ductor(server.url("restart"), tmp_path.name)
    rt, engine = d.runtime, d.runtime.engine()
    run_id = d.start("two").run_id
    assert run_tick(rt, run_id) == "committed"  # the pool now holds a connection
    token = _open_token(d, run_id)
    claimed = attempts.claim(engine, token, "w")
    assert isinstance(claimed, attempts.ClaimedAttempt)

    server.restart()
    # A coordinator tick: its first statement (the timeouts) meets a dead connection.
    assert run_tick(rt, run_id) in ("noop", "committed")

    server.restart()
    # An eager tick carrying the outcome, on a dead connection: the outcome is written and
    # folded all the same (retried, or written alone and ticked).
    step = rt.step_named("restart.noop")
    done = Outcome(AttemptOutcome.SUCCEEDED, output=1)
    assert _record_and_advance(rt, engine, step, claimed, done) == "succeeded"
    view = d.get(run_id)
    assert view.nodes["a"].status == "succeeded"
    assert view.status == RunStatus.RUNNING  # b started


@pytest.mark.parametrize("eager", [False, True])
def test_a_connection_lost_in_the_middle_of_a_tick_is_retried(
    server: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, eager: bool
) -> None:
    """The run-row read goes to psycopg's cursor too: its connection dropped after the tick's
    transaction began (the pool's pre-ping cannot see that) raises psycopg's own error, and
    the tick is retried on a new connection all the same."""
    d = _ductor(server.url("restart"), tmp_path.name)
    rt = d.runtime
    run_id = d.start("two").run_id
    real = load._fetch_on_driver
    killed: list[int] = []

    def killed_first(conn: Any, text: str, run: str) -> Any:
        if not killed:
            pid = conn.connection.dbapi_connection.info.backend_pid
            with server.connect("restart") as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            killed.append(pid)
        return real(conn, text, run)

    monkeypatch.setattr(load, "_fetch_on_driver", killed_first)
    assert run_tick(rt, run_id, eager=eager) == "committed"
    assert len(killed) == 1
    assert d.get(run_id).nodes["a"].status == "running"


@pytest.mark.parametrize("lost", ["read-only", "dropped"])
def test_a_lost_or_read_only_connection_on_the_driver_cursor_is_never_pooled_again(
    server: PostgresServer, lost: str
) -> None:
    """``db.driver_errors``: what SQLAlchemy's own error handling does for its statements
    (a demoted primary, a dropped connection), for the statements sent to psycopg directly."""
    engine = get_engine(server.url("restart"))
    before = outages()
    with pytest.raises(psycopg.Error), engine.begin() as conn:
        pid = conn.connection.dbapi_connection.info.backend_pid
        if lost == "read-only":
            with driver_errors(conn):
                raise psycopg.errors.ReadOnlySqlTransaction("cannot execute UPDATE in a read-only")
        with server.connect("restart") as admin:
            admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
        with driver_cursor(conn) as cursor:  # psycopg finds the connection gone: broken
            cursor.execute("SELECT 1")
    assert outages() == before + 1
    with engine.connect() as conn:
        assert conn.connection.dbapi_connection.info.backend_pid != pid
    forget_engine(server.url("restart"))


def test_a_refused_value_on_the_driver_cursor_keeps_its_connection(server: PostgresServer) -> None:
    engine = get_engine(server.url("restart"))
    before = outages()
    with pytest.raises(psycopg.DataError), engine.begin() as conn:
        pid = conn.connection.dbapi_connection.info.backend_pid
        with driver_errors(conn):
            raise psycopg.DataError("unsupported Unicode escape sequence")
    assert outages() == before
    with engine.connect() as conn:
        assert conn.connection.dbapi_connection.info.backend_pid == pid
    forget_engine(server.url("restart"))
