"""A duplicate wake-up of a finished run (issue 10, item 5): the coordinator's tick ends after
one unlocked read that writes nothing (store/wakes.py, ``clear_wake``), on both databases. A
finished run that still has something to do (a late outcome to fold, a control, a timer row
come due) is not settled: its tick loads and commits as before."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from inline_support import url

from ductor_celery import Ductor, Workflow
from ductor_celery.engine.kinds import ControlKind
from ductor_celery.runtime.steps import execute_attempt
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store import attempts
from ductor_celery.store.db import get_engine
from ductor_celery.store.external import insert_control

__all__ = ["url"]  # the fixture: PostgreSQL and SQLite


@pytest.fixture
def ductor(url: str, tmp_path: Path) -> Any:
    app = Celery(f"settled{tmp_path.name}", set_as_current=False)
    app.conf.broker_url = "memory://"
    app.conf.ductor_inline_steps = 0
    d = Ductor(app, database_url=url)
    d.runtime.dispatcher.send = lambda rows: None  # type: ignore[method-assign]
    d.runtime.dispatcher.wake = lambda run_id: None  # type: ignore[method-assign]
    d.runtime.dispatcher.first_tick = lambda run_id: None  # type: ignore[method-assign]
    step = d.step(name="t.one")(lambda ctx: 1)
    wf = Workflow("one")
    wf.step("a", step)
    d.register(wf)
    d.step_fn = step
    return d


@pytest.fixture
def statements(url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every statement the test's own thread sends on the runtime's engine while it runs.
    Not the others': the dispatcher deletes a commit's sent outbox rows from a thread of its
    own, off the tick's path, and on a loaded machine that delete of the run's last commit can
    come after the test has started counting. On PostgreSQL what psycopg is sent, through
    SQLAlchemy or straight to its cursor (the settled read goes that way)."""
    seen: list[str] = []
    me = threading.get_ident()
    if url.startswith("postgresql"):
        import psycopg

        execute = psycopg.Cursor.execute

        def sent(cursor: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            # Not the pool's own ``DISCARD PLANS`` at a check-out (db._refresh_plans): it
            # comes every ``PLANS_REFRESHED_EVERY_S`` whatever the tick does.
            if threading.get_ident() == me and str(query) != "DISCARD PLANS":
                seen.append(" ".join(str(query).split()))
            return execute(cursor, query, *args, **kwargs)

        monkeypatch.setattr(psycopg.Cursor, "execute", sent)
        yield seen
        return
    engine = get_engine(url)

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if threading.get_ident() == me:
            seen.append(" ".join(statement.split()))

    sa.event.listen(engine, "before_cursor_execute", record)
    yield seen
    sa.event.remove(engine, "before_cursor_execute", record)


def _finished(d: Any) -> tuple[str, str]:
    """A run that succeeded, every wake-up delivered; (run id, its attempt's token)."""
    run_id = d.start("one").run_id
    assert run_tick(d.runtime, run_id) == "committed"
    [token] = _tokens(d, run_id)
    assert execute_attempt(d.runtime, d.step_fn, token, hostname="t") == "succeeded"
    run_tick(d.runtime, run_id)
    assert d.get(run_id).status == "succeeded"
    return run_id, token


def _tokens(d: Any, run_id: str) -> list[str]:
    with d.runtime.engine().connect() as conn:
        return list(
            conn.execute(
                sa.text("SELECT token FROM eec_workflow_step_attempt WHERE run_id = :r"),
                {"r": run_id},
            ).scalars()
        )


def _version(d: Any, run_id: str) -> int:
    with d.runtime.engine().connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT record_version FROM eec_workflow_run WHERE run_id = :r"),
                {"r": run_id},
            ).scalar_one()
        )


def test_a_duplicate_wake_up_of_a_finished_run_is_one_unlocked_read(
    ductor: Any, statements: list[str]
) -> None:
    run_id, _ = _finished(ductor)
    version = _version(ductor, run_id)
    statements.clear()
    for _ in range(3):
        assert run_tick(ductor.runtime, run_id) == "noop"
    # SQLite: every use of a connection begins with the engine's BEGIN IMMEDIATE (store/db.py).
    statements[:] = [s for s in statements if s != "BEGIN IMMEDIATE"]
    assert len(statements) == 3, statements
    for sql in statements:
        assert sql.lstrip().upper().startswith(("SELECT", "WITH")), sql
        assert "FOR UPDATE" not in sql.upper() and "UPDATE EEC_" not in sql.upper(), sql
    assert _version(ductor, run_id) == version


def test_a_finished_run_with_a_late_outcome_still_folds_it(ductor: Any, url: str) -> None:
    """A late outcome (the attempt was closed by a terminate while its worker still ran) is
    folded by the next coordinator tick, as before: the run is not settled until then."""
    run_id = ductor.start("one").run_id
    run_tick(ductor.runtime, run_id)
    [token] = _tokens(ductor, run_id)
    assert attempts.claim(ductor.runtime.engine(), token, "late-worker") is not None
    ductor.terminate(run_id)  # applied by the call (its own tick)
    assert ductor.get(run_id).status == "terminated"
    with get_engine(url).begin() as conn:
        # The closed attempt's outcome, as a worker that ran on would have left it.
        conn.execute(
            sa.text(
                "UPDATE eec_workflow_step_attempt SET folded = false, output = '1' WHERE token = :t"
            ),
            {"t": token},
        )
    version = _version(ductor, run_id)
    assert run_tick(ductor.runtime, run_id) == "committed"
    assert _version(ductor, run_id) == version + 1
    assert run_tick(ductor.runtime, run_id) == "noop"
    assert ductor.get(run_id).status == "terminated"


def test_a_finished_run_with_a_control_handles_it(ductor: Any) -> None:
    run_id, _ = _finished(ductor)
    # A control row no tick has handled (its caller could not tick: the coordinator does).
    insert_control(ductor.runtime.engine(), run_id=run_id, kind=ControlKind.REDRIVE, node="a")
    assert run_tick(ductor.runtime, run_id) == "committed"
    assert ductor.get(run_id).status == "running"


def test_a_finished_runs_due_timer_row_is_cleared(ductor: Any, url: str) -> None:
    run_id, _ = _finished(ductor)
    with get_engine(url).begin() as conn:
        conn.execute(
            sa.text("INSERT INTO eec_workflow_timer (run_id, fire_at) VALUES (:r, :at)"),
            {"r": run_id, "at": "2000-01-01 00:00:00+00:00"},
        )
    run_tick(ductor.runtime, run_id)
    with get_engine(url).connect() as conn:
        left = conn.execute(
            sa.text("SELECT count(*) FROM eec_workflow_timer WHERE run_id = :r"), {"r": run_id}
        ).scalar_one()
    assert left == 0
