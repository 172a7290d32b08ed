"""The dialect object (store/dialect.py) against each real database: inserts that meet a key,
the clock, and locks (real on PostgreSQL, serialized by BEGIN IMMEDIATE on SQLite)."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from ductor_celery.store.db import aware, get_engine
from ductor_celery.store.dialect import POSTGRES, SQLITE, dialect_of
from ductor_celery.store.migrate import upgrade
from ductor_celery.store.schema import rate_bucket


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Engine:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/dialect.sqlite3"
        upgrade(url)
    else:
        url = request.getfixturevalue("database_url")
    return get_engine(url)


def _tats(engine: Engine) -> dict[str, object]:
    with engine.connect() as conn:
        rows = conn.execute(sa.select(rate_bucket.c.key, rate_bucket.c.tat)).all()
    return {r.key: aware(r.tat) for r in rows}


def test_an_engine_and_its_connections_share_one_dialect(engine: Engine) -> None:
    dialect = dialect_of(engine)
    assert dialect is (POSTGRES if engine.url.get_backend_name() == "postgresql" else SQLITE)
    with engine.connect() as conn:
        assert dialect_of(conn) is dialect


def test_an_insert_meeting_a_key_is_ignored_or_updates(engine: Engine) -> None:
    dialect = dialect_of(engine)
    with engine.begin() as conn:
        now = dialect.now_on(conn)
        later = now + timedelta(hours=1)
        for tat in (now, later):
            conn.execute(
                dialect.insert(rate_bucket)
                .values(key="kept", tat=tat, updated_at=now)
                .on_conflict_do_nothing()
            )
            upsert = dialect.insert(rate_bucket).values(key="moved", tat=tat, updated_at=now)
            conn.execute(
                upsert.on_conflict_do_update(
                    index_elements=[rate_bucket.c.key], set_={"tat": upsert.excluded.tat}
                )
            )
    assert _tats(engine) == {"kept": now, "moved": later}


def test_the_clock_is_aware_and_moves_forward(engine: Engine) -> None:
    dialect = dialect_of(engine)
    before = dialect.db_now(engine)
    with engine.begin() as conn:
        inside = dialect.now_on(conn)
        first, second = dialect.statement_now(conn), dialect.statement_now(conn)
    after = dialect.db_now(engine)
    for value in (before, inside, first, second, after):
        assert value.tzinfo is not None and value.utcoffset() == timedelta(0)
    assert before <= inside <= after
    assert first <= second, "the statement's clock, read twice in one transaction"


def test_a_locked_row_is_passed_by_and_a_held_key_is_not_taken(engine: Engine) -> None:
    dialect = dialect_of(engine)
    with engine.begin() as conn:
        now = dialect.now_on(conn)
        conn.execute(sa.insert(rate_bucket).values(key="row", tat=now, updated_at=now))
    query = sa.select(rate_bucket.c.key)
    if dialect is SQLITE:
        # No locks to take: BEGIN IMMEDIATE keeps a second writer out of the whole database.
        assert dialect.lock_rows(query, skip_locked=True) is query
        with engine.begin() as conn:
            assert dialect.try_advisory_lock(conn, 1, "key") is True
        return
    held = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with engine.begin() as conn:
            conn.execute(dialect.lock_rows(query))
            dialect.advisory_lock(conn, 1, "key")
            held.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(10)
        with engine.begin() as conn:
            assert conn.execute(dialect.lock_rows(query, skip_locked=True)).all() == []
            assert dialect.try_advisory_lock(conn, 1, "key") is False
            assert dialect.try_advisory_lock(conn, 1, "other") is True
    finally:
        release.set()
        thread.join(10)
    with engine.begin() as conn:
        assert conn.execute(dialect.lock_rows(query, skip_locked=True)).scalars().all() == ["row"]
        assert dialect.try_advisory_lock(conn, 1, "key") is True
