"""Issue 9, the worker's side: whatever a step does, its attempt's outcome is written at once.

Each test plays the coordinator by hand (start a run, one tick, so an attempt row exists), then
calls ``execute_attempt`` with a real Ductor built in this process (broker ``memory://``) and
reads the attempt row right after it returns, or raises. Before these fixes every case below
left the attempt open: its node failed only after the step timeout, as "worker lost".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from support import CONFIG, commit_tick, load_tick

from ductor_celery import Ductor, RetryPolicy, StepContext
from ductor_celery.definition import Workflow
from ductor_celery.engine import compute_tick
from ductor_celery.payloads import JsonCheck
from ductor_celery.runtime import step_errors as step_errors_module
from ductor_celery.runtime.step_context import Step
from ductor_celery.runtime.steps import execute_attempt
from ductor_celery.store import runs
from ductor_celery.store.db import get_engine
from ductor_celery.store.schema import step_attempt


class Stop(BaseException):
    """A BaseException that is neither SystemExit nor KeyboardInterrupt."""


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")

    def __repr__(self) -> str:
        raise RuntimeError("__repr__ is broken")


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


@pytest.fixture
def ductor(database_url: str) -> Ductor:
    return Ductor(Celery("bad_steps", broker="memory://"), database_url=database_url)


def _prepare(ductor: Ductor, step: Step, run_id: str = "r1") -> str:
    """A run of one node calling ``step``, ticked once: the token of its open attempt."""
    wf = Workflow(f"wf_{run_id}")
    wf.step("s", step)
    wf.output("$.nodes.s.output")
    spec = wf.build()
    engine = ductor.runtime.engine()
    runs.save_definition(engine, spec)
    runs.insert_run(engine, run_id=run_id, workflow_id=run_id, spec=spec, input={})
    loaded, spec2, inputs = load_tick(engine, run_id, lambda _h: spec, CONFIG)  # type: ignore[misc]
    [row] = commit_tick(engine, loaded, compute_tick(spec2, loaded.state, inputs, loaded.now))
    return str(row.payload["token"])


def _step(ductor: Ductor, name: str, fn: Callable[..., Any], **kw: Any) -> Step:
    step: Step = ductor.step(name=name, **kw)(fn)
    return step


def _attempt(ductor: Ductor, token: str) -> Any:
    with ductor.runtime.engine().connect() as conn:
        return conn.execute(sa.select(step_attempt).where(step_attempt.c.token == token)).one()


def _run(ductor: Ductor, step: Step, run_id: str = "r1") -> tuple[str, Any]:
    token = _prepare(ductor, step, run_id)
    return execute_attempt(ductor.runtime, step, token), _attempt(ductor, token)


# -- row 1: SystemExit, KeyboardInterrupt and other BaseExceptions -----------------------------


@pytest.mark.parametrize("exc_type", [SystemExit, KeyboardInterrupt])
def test_a_step_raising_system_exit_records_its_failure_then_exits(
    ductor: Ductor, exc_type: type[BaseException]
) -> None:
    def stop(ctx: StepContext) -> None:
        raise exc_type(3)

    step = _step(ductor, "bad.exit", stop)
    token = _prepare(ductor, step)
    with pytest.raises(exc_type):
        execute_attempt(ductor.runtime, step, token)
    row = _attempt(ductor, token)
    assert row.outcome == "failed" and row.finished_at is not None
    assert row.retryable is True  # the step's policy decides, as for any exception
    assert row.error["type"] == exc_type.__name__


def test_a_step_raising_system_exit_listed_as_non_retryable_is_not_retried(
    ductor: Ductor,
) -> None:
    def stop(ctx: StepContext) -> None:
        raise SystemExit(1)

    step = _step(ductor, "bad.exit2", stop, retry=RetryPolicy(non_retryable=(SystemExit,)))
    token = _prepare(ductor, step)
    with pytest.raises(SystemExit):
        execute_attempt(ductor.runtime, step, token)
    assert _attempt(ductor, token).retryable is False


def test_a_step_raising_another_base_exception_fails_and_the_worker_carries_on(
    ductor: Ductor,
) -> None:
    def stop(ctx: StepContext) -> None:
        raise Stop("halt")

    outcome, row = _run(ductor, _step(ductor, "bad.base", stop))
    assert outcome == "failed"
    assert (row.outcome, row.retryable) == ("failed", True)
    assert row.error["type"] == "Stop" and row.error["message"] == "halt"


# -- row 2: an exception that cannot be printed ------------------------------------------------


def test_a_step_raising_an_unprintable_exception_fails_its_attempt_at_once(
    ductor: Ductor,
) -> None:
    def broken(ctx: StepContext) -> None:
        raise Unprintable()

    outcome, row = _run(ductor, _step(ductor, "bad.unprintable", broken))
    assert outcome == "failed"
    assert (row.outcome, row.retryable) == ("failed", True)
    assert row.error["type"] == "Unprintable"
    assert row.error["message"] == "<unprintable Unprintable>"
    assert "Unprintable" in row.error["traceback"]


def test_an_exception_message_with_nul_and_surrogates_is_stored(ductor: Ductor) -> None:
    def odd(ctx: StepContext) -> None:
        raise ValueError("bad \x00 and \ud800")

    outcome, row = _run(ductor, _step(ductor, "bad.odd_message", odd))
    assert outcome == "failed" and row.outcome == "failed"
    assert row.error["type"] == "ValueError"
    assert row.error["message"] == "bad \\x00 and \\ud800"


# -- row 3: a result nested too deep to serialize ----------------------------------------------


def test_a_result_nested_3000_deep_fails_its_attempt_without_retry(ductor: Ductor) -> None:
    def deep(ctx: StepContext) -> Any:
        return _nested(3000)

    outcome, row = _run(ductor, _step(ductor, "bad.deep", deep))
    assert outcome == "failed"
    assert (row.outcome, row.retryable) == ("failed", False)
    assert row.error["type"] == "InvalidResult"
    assert "'bad.deep' result" in row.error["message"]
    assert row.output is None


def test_a_result_check_that_raises_still_fails_the_attempt(
    ductor: Ductor, monkeypatch: pytest.MonkeyPatch
) -> None:
    def raising(value: Any, what: str, limit: int, *, door: Any = None) -> Any:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(step_errors_module, "check_json", raising)
    outcome, row = _run(ductor, _step(ductor, "bad.check", lambda ctx: 1))
    assert (outcome, row.retryable) == ("failed", False)
    assert row.error["type"] == "InvalidResult"
    assert "'bad.check' result" in row.error["message"]
    assert "RecursionError" in row.error["message"]


# -- row 4: values PostgreSQL refuses (NaN, NUL, a lone surrogate) ------------------------------

REFUSED = [float("nan"), float("inf"), "a\x00b", "\ud800", {"k\x00": 1}]


def _accept_everything(value: Any, what: str, limit: int, *, door: Any = None) -> Any:
    """A check that lets every value through, as the check before issue 9 did for these."""
    return JsonCheck(value)


@pytest.mark.parametrize("value", REFUSED, ids=repr)
@pytest.mark.parametrize("where", ["result", "context patch"])
@pytest.mark.parametrize("check", ["real", "lenient"])
def test_a_result_or_patch_postgres_refuses_fails_the_attempt_without_retry(
    ductor: Ductor, monkeypatch: pytest.MonkeyPatch, value: Any, where: str, check: str
) -> None:
    # "lenient": the payload check lets the value through, so the database refuses it and
    # the last line of defence must still close the attempt.
    if check == "lenient":
        monkeypatch.setattr(step_errors_module, "check_json", _accept_everything)

    def bad(ctx: StepContext) -> Any:
        if where == "result":
            return {"v": value}
        ctx.patch({"v": value})
        return 1

    outcome, row = _run(ductor, _step(ductor, "bad.refused", bad))
    assert outcome == "failed"
    assert (row.outcome, row.retryable) == ("failed", False)
    assert row.error["type"] == "InvalidResult"
    assert "'bad.refused'" in row.error["message"]
    assert row.output is None and row.patch is None


def test_a_refused_outcome_of_a_leased_step_still_releases_its_lease(
    ductor: Ductor, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ductor_celery import ConcurrencyLimit

    monkeypatch.setattr(step_errors_module, "check_json", _accept_everything)
    step = _step(
        ductor,
        "bad.leased",
        lambda ctx: float("nan"),
        concurrency=ConcurrencyLimit(key="k", limit=1),
    )
    outcome, row = _run(ductor, step)
    assert (outcome, row.retryable) == ("failed", False)
    with ductor.runtime.engine().connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM eec_concurrency_lease")).scalar() == 0


# -- heartbeats ----------------------------------------------------------------------------------


def _raise_recursion(value: Any, what: str, limit: int, *, door: Any = None) -> Any:
    raise RecursionError("maximum recursion depth exceeded")


CHECKS: dict[str, Any] = {
    "real": step_errors_module.check_json,
    "lenient": _accept_everything,
    "raising": _raise_recursion,
}


@pytest.mark.parametrize("check", list(CHECKS))
def test_heartbeat_details_the_database_refuses_never_break_the_step(
    ductor: Ductor, monkeypatch: pytest.MonkeyPatch, check: str
) -> None:
    real = step_errors_module.check_json

    def beat(ctx: StepContext) -> str:
        # Only the heartbeats see the patched check; the result is checked for real.
        monkeypatch.setattr(step_errors_module, "check_json", CHECKS[check])
        for details in (float("nan"), "\x00", "\ud800", _nested(3000)):
            ctx.heartbeat(details)
        monkeypatch.setattr(step_errors_module, "check_json", real)
        return "done"

    outcome, row = _run(ductor, _step(ductor, "bad.beat", beat))
    assert outcome == "succeeded" and row.output == "done"
    assert row.heartbeat_at is not None  # recorded, without the details
    assert row.heartbeat_details is None


# -- row 8: a message naming another step's task ------------------------------------------------


def _wrong_step_case(ductor: Ductor, caplog: pytest.LogCaptureFixture) -> None:
    ran: list[str] = []

    def right(ctx: StepContext) -> str:
        ran.append("right")
        return "right"

    def other(ctx: StepContext) -> str:
        ran.append("other")
        return "other"

    right_step = _step(ductor, "bad.right", right)
    other_step = _step(ductor, "bad.other", other)
    token = _prepare(ductor, right_step)
    # As app.send_task("bad.other", args=[token]) would deliver it.
    with caplog.at_level(logging.WARNING, logger="ductor_celery.step"):
        assert execute_attempt(ductor.runtime, other_step, token) == "wrong-step"
    assert ran == []
    row = _attempt(ductor, token)
    assert row.claimed_at is None and row.finished_at is None and row.outcome is None
    [warning] = [r.getMessage() for r in caplog.records if r.name == "ductor_celery.step"]
    assert token in warning and "'bad.right'" in warning and "'bad.other'" in warning
    # The attempt's own message still claims and runs it.
    assert execute_attempt(ductor.runtime, right_step, token) == "succeeded"
    assert ran == ["right"] and _attempt(ductor, token).output == "right"
    # Once claimed, a wrong-step message is still refused as such, and a duplicate as one.
    assert execute_attempt(ductor.runtime, other_step, token) == "wrong-step"
    assert execute_attempt(ductor.runtime, right_step, token) == "duplicate"
    assert ran == ["right"]


def test_a_message_for_another_steps_task_runs_nothing_and_leaves_the_attempt_claimable(
    ductor: Ductor, caplog: pytest.LogCaptureFixture
) -> None:
    _wrong_step_case(ductor, caplog)


def test_a_message_for_another_steps_task_is_dropped_on_sqlite_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from ductor_celery.store.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'ductor.db'}"
    upgrade(url)
    get_engine(url)
    _wrong_step_case(Ductor(Celery("bad_steps", broker="memory://"), database_url=url), caplog)
