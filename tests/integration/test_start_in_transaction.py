"""Issue 15 item 3: ``start(..., connection=)`` inside the caller's own SQLAlchemy transaction.

Commit makes the run (with the caller's own rows) and only then sends its wake-up; rollback
leaves no run, no definition and no wake-up; a connection to another database is refused with
nothing written. On SQLite and PostgreSQL, with a Core ``Connection`` and an ORM ``Session``.
(Django's ``using=``: tests/integration/test_django_shop.py.)
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from sqlalchemy.orm import Session

from ductor_celery import Ductor, RunStatus, Workflow, WrongDatabase
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store.db import get_engine
from ductor_celery.store.migrate import upgrade

ORDERS = "CREATE TABLE shop_order (id varchar(64) PRIMARY KEY)"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/tx.sqlite3"
        upgrade(url)
    else:
        url = request.getfixturevalue("database_url")
    with get_engine(url).begin() as conn:
        conn.execute(sa.text(ORDERS))
    return url


class Shop:
    """A Ductor whose wake-ups are recorded, and the user's own engine on the same database."""

    def __init__(self, url: str) -> None:
        app = Celery(f"tx{id(self)}", broker="memory://", set_as_current=False)
        self.ductor = Ductor(app, database_url=url)
        self.wakes: list[str] = []
        self.ductor.client._wake = self.ductor.client._wake_started = self.wakes.append
        wf = Workflow("order")
        step = self.ductor.step(name="tx.reserve")(lambda ctx: {"ok": True})
        wf.step("reserve", step)
        self.ductor.register(wf)
        # The user's engine: their own pool, not ductor's.
        self.engine = sa.create_engine(url, poolclass=sa.pool.NullPool)

    def count(self, table: str) -> int:
        # The user's engine: ductor's begins IMMEDIATE on SQLite, and would wait for the writer.
        with self.engine.connect() as conn:
            return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())

    def woken(self, run_id: str, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while run_id not in self.wakes and time.monotonic() < deadline:
            time.sleep(0.005)
        return run_id in self.wakes


@pytest.fixture
def shop(db_url: str) -> Iterator[Shop]:
    made = Shop(db_url)
    yield made
    made.engine.dispose()


def _order(conn: Any, order_id: str) -> None:
    conn.execute(sa.text("INSERT INTO shop_order (id) VALUES (:id)"), {"id": order_id})


def test_commit_makes_the_run_and_then_wakes_it(shop: Shop) -> None:
    with shop.engine.connect() as conn:
        with conn.begin():
            _order(conn, "o-1")
            handle = shop.ductor.start(
                "order", input={"id": "o-1"}, workflow_id="order-o-1", connection=conn
            )
            # Inside the transaction: nothing sent, nothing visible to anyone else.
            assert shop.wakes == []
            assert shop.count("eec_workflow_run") == 0
        assert shop.woken(handle.run_id)
    assert shop.count("shop_order") == 1
    view = shop.ductor.get("order-o-1")
    assert (view.run_id, view.status, view.input) == (handle.run_id, "pending", {"id": "o-1"})
    # It is an ordinary run from here on: its first tick starts it.
    assert run_tick(shop.ductor.runtime, handle.run_id) == "committed"
    assert shop.ductor.get(handle.run_id).status == RunStatus.RUNNING


def test_rollback_leaves_no_run_no_definition_and_no_wake_up(shop: Shop) -> None:
    with shop.engine.connect() as conn:
        with pytest.raises(RuntimeError, match="payment declined"), conn.begin():
            _order(conn, "o-2")
            shop.ductor.start("order", input={"id": "o-2"}, connection=conn)
            raise RuntimeError("payment declined")
        # A later transaction on the same connection does not inherit the hook.
        with conn.begin():
            _order(conn, "o-3")
    time.sleep(0.1)
    assert shop.wakes == []
    assert shop.count("shop_order") == 1
    assert shop.count("eec_workflow_run") == 0
    assert shop.count("eec_workflow_definition") == 0


def test_session_commit_and_rollback(shop: Shop) -> None:
    with Session(shop.engine) as session:
        with session.begin():
            _order(session, "o-4")
            handle = shop.ductor.start("order", input={"id": "o-4"}, connection=session)
            assert shop.wakes == []
        # The session's after_commit event: sent by the commit itself, no waiting.
        assert shop.wakes == [handle.run_id]
        with pytest.raises(RuntimeError), session.begin():
            shop.ductor.start("order", input={"id": "o-5"}, connection=session)
            raise RuntimeError("no")
        # Closed without a commit: dropped too, and the session's next commit sends nothing.
        shop.ductor.start("order", input={"id": "o-6"}, connection=session)
        session.close()
        with session.begin():
            _order(session, "o-7")
        # A savepoint rolled back inside a committed transaction: the outer commit decides.
        with session.begin():
            with pytest.raises(RuntimeError), session.begin_nested():
                raise RuntimeError("inner")
            kept = shop.ductor.start("order", input={"id": "o-8"}, connection=session)
    assert shop.wakes == [handle.run_id, kept.run_id]
    assert {v.run_id for v in shop.ductor.list_runs()} == {handle.run_id, kept.run_id}


def test_an_open_workflow_id_returns_its_run_and_keeps_the_transaction_usable(
    shop: Shop,
) -> None:
    first = shop.ductor.start("order", workflow_id="order-9")
    shop.wakes.clear()
    with shop.engine.connect() as conn, conn.begin():
        again = shop.ductor.start("order", workflow_id="order-9", connection=conn)
        _order(conn, "o-9")  # the broken unique key rolled back to a savepoint only
    assert again == first
    time.sleep(0.1)
    assert shop.wakes == []
    assert shop.count("shop_order") == 1
    assert shop.count("eec_workflow_run") == 1


def test_a_connection_to_another_database_is_refused_with_nothing_written(
    shop: Shop, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if shop.engine.dialect.name == "sqlite":
        other_url = f"sqlite:///{tmp_path}/other.sqlite3"
    else:
        server = request.getfixturevalue("pg_server")
        name = f"other_{uuid.uuid4().hex[:12]}"
        server.create_database(name)  # on the same server as ductor's
        other_url = server.url(name)
    upgrade(other_url)
    other = sa.create_engine(other_url, poolclass=sa.pool.NullPool)
    with other.connect() as conn, conn.begin():
        with pytest.raises(WrongDatabase, match="another database"):
            shop.ductor.start("order", connection=conn)
        counted = conn.execute(sa.text("SELECT count(*) FROM eec_workflow_run")).scalar_one()
        assert counted == 0
    other.dispose()
    assert shop.count("eec_workflow_run") == 0
    assert shop.wakes == []


def test_bad_arguments_are_refused_before_any_query(shop: Shop) -> None:
    with pytest.raises(TypeError, match="SQLAlchemy Connection or Session, got str"):
        shop.ductor.start("order", connection="postgresql://elsewhere")
    with shop.engine.connect() as conn:
        with pytest.raises(ValueError, match="connection= or using=, not both"):
            shop.ductor.start("order", connection=conn, using="default")
    assert shop.count("eec_workflow_run") == 0
