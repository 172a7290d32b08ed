"""Through PgBouncer in transaction pooling mode (issue 24): with server-side prepares off
(``ductor_database_prepare = False``) every statement works through the pooler, and ``wait()``
LISTENs on ``ductor_listen_database_url``, a direct connection."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from celery import Celery
from servers import PgBouncer

from ductor_celery import Ductor, RunStatus, StepContext, Workflow
from ductor_celery.settings import Settings
from ductor_celery.store import finishes
from ductor_celery.store.db import forget_engine, get_engine


def _pooled(database_url: str, pgbouncer: PgBouncer) -> str:
    """The same database, through the pooler."""
    return pgbouncer.url(sa.engine.make_url(database_url).database or "postgres")


def _app(url: str, listen_url: str, tmp_path: Path) -> Ductor:
    app = Celery(f"pgb{tmp_path.name}", set_as_current=False)
    app.conf.update(ductor_listen_database_url=listen_url, ductor_database_prepare=False)
    d = Ductor(app, database_url=url)

    @d.step(name="pgb.inc")
    def inc(ctx: StepContext, value: int) -> int:
        return value + 1

    wf = Workflow("pgb_chain")
    wf.step("s0", inc, args={"value": "$.input.value"})
    for i in range(1, 5):
        wf.step(f"s{i}", inc, after=[f"s{i - 1}"], args={"value": f"$.nodes.s{i - 1}.output"})
    wf.output("$.nodes.s4.output")
    d.register(wf)
    return d


def test_the_settings_read_from_conf_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = Settings.from_conf({}, "postgresql://h/db")
    assert plain.database_prepare is True
    assert plain.listen_url == "postgresql+psycopg://h/db"
    conf = {"ductor_listen_database_url": "postgres://direct/db", "ductor_database_prepare": "0"}
    s = Settings.from_conf(conf, "postgresql://pooler/db")
    assert (s.database_prepare, s.listen_url) == (False, "postgresql+psycopg://direct/db")
    monkeypatch.setenv("DUCTOR_LISTEN_DATABASE_URL", "postgresql://direct/db")
    monkeypatch.setenv("DUCTOR_DATABASE_PREPARE", "false")
    s = Settings.from_conf({}, "postgresql://pooler/db")
    assert (s.database_prepare, s.listen_url) == (False, "postgresql+psycopg://direct/db")


def test_an_engine_without_prepares_never_prepares(database_url: str) -> None:
    engine = get_engine(database_url, prepare=False)
    with engine.connect() as conn:
        for _ in range(10):
            conn.execute(sa.text("SELECT 1 + :x"), {"x": 1})
        count = conn.execute(sa.text("SELECT count(*) FROM pg_prepared_statements")).scalar()
    assert count == 0
    with get_engine(database_url).connect() as conn:
        for _ in range(10):
            conn.execute(sa.text("SELECT 1 + :x"), {"x": 1})
        assert conn.execute(sa.text("SELECT count(*) FROM pg_prepared_statements")).scalar()


def test_workflows_run_through_the_pooler(
    database_url: str, pgbouncer: PgBouncer, tmp_path: Path
) -> None:
    pooled = _pooled(database_url, pgbouncer)
    d = _app(pooled, database_url, tmp_path)
    try:
        with d.local_workers(concurrency=4):
            handles = [d.start("pgb_chain", input={"value": i}) for i in range(30)]
            views = [d.wait(h.run_id, timeout=30) for h in handles]
        assert [(v.status, v.output) for v in views] == [
            (RunStatus.SUCCEEDED, i + 5) for i in range(30)
        ]
    finally:
        forget_engine(pooled)


def test_wait_listens_on_the_direct_url_and_is_told_at_once(
    database_url: str, pgbouncer: PgBouncer
) -> None:
    pooled = _pooled(database_url, pgbouncer)
    engine = get_engine(pooled, prepare=False)
    try:
        with finishes.listener(engine, database_url) as listener:
            with engine.begin() as conn:  # the tick's commit notifies through the pooler
                conn.execute(sa.select(sa.func.pg_notify(finishes.RUN_FINISHED_CHANNEL, "run-1")))
            began = time.monotonic()
            listener.wait_for("run-1", 5.0)
            took = time.monotonic() - began
        # Told, not the safety poll (1 s) running out.
        assert took < finishes.SAFETY_POLL_S / 2, took
    finally:
        forget_engine(pooled)
