"""Issue 15, retry policy fixes: a node's own ``retry=`` overrides the step decorator's in every
respect (its ``non_retryable`` too, which the worker used to ignore), and ``jitter`` spreads
each backoff, the same way every time a tick is computed.

Each test plays the coordinator by hand (start a run, one tick, so an attempt row exists),
then runs the attempt with ``execute_attempt`` in this process, as the step task does, and
reads what the worker wrote and what the next tick decided.
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from ductor_celery import Ductor, NonRetryableError, RetryPolicy, StepContext
from ductor_celery.definition import Workflow
from ductor_celery.definition.retry import backoff_delay
from ductor_celery.definition.spec import RetrySpec
from ductor_celery.engine.advance import _spread
from ductor_celery.errors import DefinitionError
from ductor_celery.runtime.steps import execute_attempt
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store.schema import step_attempt


class Declined(ValueError):
    """A subclass: listing ValueError covers it."""


@pytest.fixture
def ductor(database_url: str) -> Ductor:
    app = Celery("retry_policy", broker="memory://")
    app.conf.ductor_eager_ticks = False  # the test ticks by hand
    return Ductor(app, database_url=database_url)


def _raises(exc: BaseException) -> Any:
    def fail(ctx: StepContext) -> None:
        raise exc

    return fail


def _attempt_of(ductor: Ductor, run_id: str) -> Any:
    with ductor.runtime.engine().connect() as conn:
        return conn.execute(
            sa.select(step_attempt)
            .where(step_attempt.c.run_id == run_id)
            .order_by(step_attempt.c.created_at.desc())
        ).first()


def _run_once(ductor: Ductor, name: str, step: Any, retry: RetryPolicy | None) -> Any:
    """Start a one-node run whose node sets ``retry`` (None: the step's), run its first
    attempt, tick: (the attempt row, the node's status after the tick)."""
    wf = Workflow(name)
    wf.step("s", step, retry=retry)
    ductor.register(wf)
    run_id = ductor.start(name, input={}).run_id
    assert run_tick(ductor.runtime, run_id) == "committed"
    row = _attempt_of(ductor, run_id)
    execute_attempt(ductor.runtime, step, row.token)
    assert run_tick(ductor.runtime, run_id) == "committed"
    return _attempt_of(ductor, run_id), ductor.get(run_id).nodes["s"].status


def test_a_node_retry_without_non_retryable_retries_what_the_step_lists(ductor: Ductor) -> None:
    step = ductor.step(name="rp.listed", retry=RetryPolicy(non_retryable=(ValueError,)))(
        _raises(ValueError("no"))
    )
    row, status = _run_once(ductor, "override_list", step, RetryPolicy(max_attempts=3))
    assert row.retryable is True and status == "running"  # a retry is scheduled


def test_a_node_non_retryable_fails_the_node_at_once(ductor: Ductor) -> None:
    step = ductor.step(name="rp.plain")(_raises(Declined("no")))
    row, status = _run_once(
        ductor, "node_list", step, RetryPolicy(max_attempts=5, non_retryable=(ValueError,))
    )
    assert row.retryable is False and status == "failed"


def test_without_a_node_retry_the_step_policy_still_applies(ductor: Ductor) -> None:
    step = ductor.step(name="rp.step_list", retry=RetryPolicy(non_retryable=(KeyError,)))(
        _raises(KeyError("k"))
    )
    row, status = _run_once(ductor, "step_list", step, None)
    assert row.retryable is False and status == "failed"


def test_non_retryable_error_is_never_retried_whatever_the_node_says(ductor: Ductor) -> None:
    step = ductor.step(name="rp.fatal")(_raises(NonRetryableError("stop")))
    row, status = _run_once(ductor, "fatal", step, RetryPolicy(max_attempts=9))
    assert row.retryable is False and status == "failed"


def test_a_node_retry_overrides_the_step_max_attempts(ductor: Ductor) -> None:
    step = ductor.step(name="rp.once", retry=RetryPolicy(max_attempts=5))(
        _raises(RuntimeError("x"))
    )
    row, status = _run_once(ductor, "once", step, RetryPolicy(max_attempts=1))
    assert row.retryable is True and status == "failed"  # one attempt allowed by the node


# -- jitter --------------------------------------------------------------------------------


def test_jitter_spreads_each_backoff_within_its_fraction() -> None:
    spec = RetrySpec(initial_interval=10.0, backoff=1.0, jitter=0.1)
    assert backoff_delay(spec, 1, 0.0) == pytest.approx(9.0)
    assert backoff_delay(spec, 1, 1.0) == pytest.approx(11.0)
    assert backoff_delay(spec, 1, 0.5) == pytest.approx(10.0)
    assert backoff_delay(RetrySpec(initial_interval=10.0, backoff=1.0), 1, 0.0) == 10.0


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), "0.1", True])
def test_a_bad_jitter_is_refused_by_name(value: Any) -> None:
    with pytest.raises(DefinitionError, match="RetryPolicy.jitter must be a fraction"):
        RetryPolicy(jitter=value)


def test_a_definition_without_jitter_keeps_its_hash() -> None:
    """jitter=0 is left out of the stored definition: workflows registered before jitter
    existed hash the same, so runs in flight keep finding their definition."""

    plain = Workflow("h")
    plain.step("s", "x.step", retry=RetryPolicy())
    jittered = Workflow("h")
    jittered.step("s", "x.step", retry=RetryPolicy(jitter=0.2))
    assert "jitter" not in plain.build().canonical_json()
    assert '"jitter":0.2' in jittered.build().canonical_json()
    assert plain.build().spec_hash != jittered.build().spec_hash


def test_the_jittered_retry_time_is_fixed_by_the_failed_attempt_token(ductor: Ductor) -> None:
    """A run's first attempt fails: its retry falls within +-50% of the 100 s backoff, where
    the attempt's token puts it (the engine stays a pure function of its inputs)."""
    step = ductor.step(name="rp.jitter")(_raises(RuntimeError("x")))
    policy = RetryPolicy(max_attempts=3, initial_interval=100.0, max_interval=200.0, jitter=0.5)
    row, status = _run_once(ductor, "jit", step, policy)
    assert status == "running"
    expected = backoff_delay(policy.to_spec(), 1, _spread(row.token))
    assert 50 <= expected <= 150 and expected != 100.0
    with ductor.runtime.engine().connect() as conn:
        reasons = [
            r
            for (r,) in conn.execute(
                sa.text("SELECT reason FROM eec_workflow_history WHERE run_id = :r"),
                {"r": row.run_id},
            )
        ]
    assert any(f"retry in {expected:g}s" in r for r in reasons), reasons
