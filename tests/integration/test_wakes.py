"""Coalesced wake-ups (store/wakes.py) on real PostgreSQL: one message per queued tick."""

from __future__ import annotations

import threading
from typing import Any

import sqlalchemy as sa

from ductor_celery.store import wakes
from ductor_celery.store.db import get_engine
from ductor_celery.store.schema import workflow_wake


def test_only_the_first_request_sends_until_a_tick_clears_it(database_url: str) -> None:
    engine = get_engine(database_url)
    assert wakes.request_wake(engine, "run-a") is True
    assert wakes.request_wake(engine, "run-a") is False
    assert wakes.request_wake(engine, "run-b") is True, "runs are independent"
    wakes.clear_wake(engine, "run-a")
    assert wakes.request_wake(engine, "run-a") is True


def test_a_stale_request_is_treated_as_lost_and_sends_again(database_url: str) -> None:
    engine = get_engine(database_url)
    assert wakes.request_wake(engine, "run-s") is True
    with engine.begin() as conn:
        conn.execute(
            sa.update(workflow_wake)
            .where(workflow_wake.c.run_id == "run-s")
            .values(requested_at=sa.func.now() - sa.text("interval '1 minute'"))
        )
    assert wakes.request_wake(engine, "run-s") is True
    assert wakes.request_wake(engine, "run-s") is False


def test_concurrent_requests_send_exactly_one(database_url: str) -> None:
    engine = get_engine(database_url)
    sent: list[bool] = []
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        sent.append(wakes.request_wake(engine, "run-c"))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(sent) == [False] * 7 + [True]


def test_sqlite_always_wakes(tmp_path: Any) -> None:
    from ductor_celery.store.migrate import upgrade

    url = f"sqlite:///{tmp_path}/w.sqlite3"
    upgrade(url)
    engine = get_engine(url)
    assert wakes.request_wake(engine, "r") is True
    assert wakes.request_wake(engine, "r") is True
    wakes.clear_wake(engine, "r")
