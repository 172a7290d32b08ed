"""The eager tick's outcome write (``attempts.finish_in_tick``, psycopg's own cursor) writes
exactly the row ``attempts.finish`` writes (SQLAlchemy's JSON type), value for value: an
attempt folded after one or the other cannot tell them apart (PostgreSQL: the prelude is a
PostgreSQL path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from ductor_celery import Ductor, Workflow
from ductor_celery.engine.status import AttemptOutcome
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store import attempts
from ductor_celery.store.schema import step_attempt

_COLUMNS = (
    "outcome",
    "retryable",
    "output IS NULL",
    "output::text",
    "error IS NULL",
    "error::text",
    "patch IS NULL",
    "patch::text",
    "tags IS NULL",
    "tags::text",
    "finished_at IS NOT NULL",
)


@pytest.fixture
def ductor(database_url: str, tmp_path: Path) -> Any:
    app = Celery(f"fit{tmp_path.name}", set_as_current=False)
    app.conf.broker_url = "memory://"
    d = Ductor(app, database_url=database_url)
    d.runtime.dispatcher.send = lambda rows: None  # type: ignore[method-assign,assignment]
    d.runtime.dispatcher.wake = lambda run_id: None  # type: ignore[method-assign]
    d.runtime.dispatcher.first_tick = lambda run_id: None  # type: ignore[method-assign]
    d.step(name="fit.noop")(lambda ctx: None)
    wf = Workflow("fit")
    wf.step("a", "fit.noop")
    d.register(wf)
    return d


def _open_attempt(d: Ductor) -> str:
    run_id = d.start("fit").run_id
    run_tick(d.runtime, run_id)
    with d.runtime.engine().connect() as conn:
        token = conn.execute(
            sa.select(step_attempt.c.token).where(step_attempt.c.run_id == run_id)
        ).scalar_one()
    assert attempts.claim(d.runtime.engine(), token, "w") is not None
    return str(token)


def _row(d: Ductor, token: str) -> tuple[Any, ...]:
    with d.runtime.engine().connect() as conn:
        return tuple(
            conn.execute(
                sa.text(
                    f"SELECT {', '.join(_COLUMNS)} FROM eec_workflow_step_attempt WHERE token = :t"
                ),
                {"t": token},
            ).one()
        )


@pytest.mark.parametrize(
    "values",
    [
        {"outcome": AttemptOutcome.SUCCEEDED, "output": None},
        {"outcome": AttemptOutcome.SUCCEEDED, "output": {"n": 1, "big": 1e16, "text": "é\u2028"}},
        {"outcome": AttemptOutcome.SUCCEEDED, "output": [1, "two", None], "patch": {"k": [1]}},
        {"outcome": AttemptOutcome.SUCCEEDED, "output": "x", "tags": [["k", "v"], ["a", "b"]]},
        {
            "outcome": AttemptOutcome.FAILED,
            "error": {"type": "E", "message": "m"},
            "retryable": False,
        },
        {"outcome": AttemptOutcome.CANCELLED, "error": {"type": "StepCancelled", "message": ""}},
    ],
)
def test_the_tick_and_finish_write_the_same_row(ductor: Ductor, values: dict[str, Any]) -> None:
    by_finish, in_tick = _open_attempt(ductor), _open_attempt(ductor)
    written, _ = attempts.finish(ductor.runtime.engine(), by_finish, **values)
    with ductor.runtime.engine().begin() as conn:
        assert attempts.finish_in_tick(conn, in_tick, **values)
    assert written
    assert _row(ductor, in_tick) == _row(ductor, by_finish)


def test_an_attempt_finished_already_or_leased_is_not_written(ductor: Ductor) -> None:
    token = _open_attempt(ductor)
    with ductor.runtime.engine().begin() as conn:
        assert attempts.finish_in_tick(conn, token, outcome=AttemptOutcome.SUCCEEDED, output=1)
    with ductor.runtime.engine().begin() as conn:
        assert not attempts.finish_in_tick(conn, token, outcome=AttemptOutcome.FAILED)
    assert _row(ductor, token)[:4] == ("succeeded", True, False, "1")
    leased = _open_attempt(ductor)
    with ductor.runtime.engine().begin() as conn:
        conn.execute(
            sa.update(step_attempt).where(step_attempt.c.token == leased).values(lease_key="k")
        )
        assert not attempts.finish_in_tick(conn, leased, outcome=AttemptOutcome.SUCCEEDED)
