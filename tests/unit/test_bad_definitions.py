"""Issue 9, definition side: a value that would make every tick raise (so the run stays pending
forever) or stop a worker from starting is refused by ``register()`` / ``@ductor.step`` at once,
with a DefinitionError naming the node (or step) and the field."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from pydantic import ValidationError

from ductor_celery import Ductor, RunStatus, StepContext
from ductor_celery.definition import RetryPolicy, Workflow, WorkflowSpec
from ductor_celery.definition.retry import ConcurrencyLimit
from ductor_celery.definition.spec import RetrySpec, StepNodeSpec
from ductor_celery.errors import DefinitionError
from ductor_celery.limits import MAX_ATTEMPTS, MAX_ID_LENGTH, MAX_INT, MAX_LEASE_KEY_LENGTH

NAN = float("nan")
INF = float("inf")
TOO_LONG = "x" * (MAX_ID_LENGTH + 1)
#: Not finite, or over ten years, or a bool (not a number): never a usable duration.
BAD_DURATIONS = [NAN, INF, -INF, 1e20, True, "10"]


def refused(wf: Workflow) -> str:
    with pytest.raises(DefinitionError) as info:
        wf.build()
    return str(info.value)


def assert_names(message: str, *parts: str) -> None:
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"


@pytest.fixture
def ductor(tmp_path: Path) -> Ductor:
    app = Celery("t", set_as_current=False)
    return Ductor(app, database_url=f"sqlite:///{tmp_path}/d.sqlite3")


def _noop(ctx: StepContext, x: int = 0) -> int:
    return x


# --- 1. durations -------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["timeout", "heartbeat_timeout"])
@pytest.mark.parametrize("value", [*BAD_DURATIONS, 0, -1])
def test_timeout_nan_on_a_step_is_refused_at_decoration(
    ductor: Ductor, field: str, value: Any
) -> None:
    with pytest.raises(DefinitionError) as info:
        ductor.step(name="t.slow", **{field: value})(_noop)
    assert_names(str(info.value), "'t.slow'", field)
    assert "t.slow" not in ductor.app.tasks  # nothing registered


@pytest.mark.parametrize("kind", ["step", "scatter"])
@pytest.mark.parametrize("value", [*BAD_DURATIONS, 0, -1])
def test_timeout_nan_on_a_node_is_refused_at_register(kind: str, value: Any) -> None:
    wf = Workflow("w")
    if kind == "step":
        wf.step("slow", "s", timeout=value)
    else:
        wf.scatter("slow", "s", over="$.input.xs", timeout=value)
    assert_names(refused(wf), "'slow'", "timeout")


@pytest.mark.parametrize("value", [*BAD_DURATIONS, -1, None])
def test_sleep_of_nan_inf_huge_or_negative_seconds_is_refused_at_register(value: Any) -> None:
    assert_names(refused(Workflow("w").sleep("nap", seconds=value)), "'nap'", "seconds")


def test_sleep_of_zero_seconds_is_allowed() -> None:
    assert Workflow("w").sleep("nap", seconds=0).build().nodes[0].seconds == 0


@pytest.mark.parametrize("kind", ["wait_signal", "approval", "event_set"])
@pytest.mark.parametrize("value", [1e20, NAN, INF, 0, -1, True])
def test_wait_timeout_nan_huge_or_not_positive_is_refused_at_register(
    kind: str, value: Any
) -> None:
    wf = Workflow("w")
    if kind == "wait_signal":
        wf.wait_signal("park", signal="go", timeout=value)
    elif kind == "approval":
        wf.approval("park", timeout=value)
    else:
        wf.event_set("park", events=["a", "b"], timeout=value)
    assert_names(refused(wf), "'park'", "timeout")


@pytest.mark.parametrize("field", ["initial_interval", "max_interval"])
@pytest.mark.parametrize("value", [INF, NAN, 1e12, -1, True, "1"])
def test_retry_interval_inf_or_huge_is_refused(field: str, value: Any) -> None:
    with pytest.raises(DefinitionError) as info:
        RetryPolicy(**{field: value})
    assert_names(str(info.value), f"RetryPolicy.{field}")


def test_retry_intervals_of_zero_are_allowed() -> None:
    spec = RetryPolicy(initial_interval=0, max_interval=0).to_spec()
    assert (spec.initial_interval, spec.max_interval) == (0, 0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("timeout", NAN),
        ("timeout", INF),
        ("timeout", 1e20),
        ("heartbeat_timeout", INF),
        ("id", TOO_LONG),
        ("step", ""),
        ("queue", TOO_LONG),
    ],
)
def test_a_spec_read_back_from_the_database_cannot_carry_unusable_values(
    field: str, value: Any
) -> None:
    good = Workflow("w").step("a", "s", timeout=5.0).build()
    stored = json.loads(good.canonical_json())
    stored["nodes"][0][field] = value
    text = json.dumps(stored)  # nan and inf are written as NaN / Infinity
    with pytest.raises(ValidationError, match=field):
        WorkflowSpec.model_validate_json(text)
    with pytest.raises(ValidationError):
        StepNodeSpec.model_validate(stored["nodes"][0])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_interval": NAN},
        {"max_interval": INF},
        {"backoff": NAN},
        {"backoff": 1e9},
        {"max_attempts": MAX_ATTEMPTS + 1},
    ],
)
def test_a_stored_retry_spec_cannot_carry_unusable_values(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        RetrySpec(**kwargs)


# --- 2. RetryPolicy numbers ---------------------------------------------------------------------


@pytest.mark.parametrize("value", [NAN, 1.5, 3.0, True, 0, -1, 10**9, "3"])
def test_retry_max_attempts_not_an_integer_in_range_is_refused(value: Any) -> None:
    with pytest.raises(DefinitionError) as info:
        RetryPolicy(max_attempts=value)
    assert_names(str(info.value), "RetryPolicy.max_attempts")


@pytest.mark.parametrize("value", [NAN, INF, 0.5, 0, 1001, 1e9, True, "2"])
def test_retry_backoff_not_finite_in_range_is_refused(value: Any) -> None:
    with pytest.raises(DefinitionError) as info:
        RetryPolicy(backoff=value)
    assert_names(str(info.value), "RetryPolicy.backoff")


def test_a_node_retry_that_is_not_a_retry_policy_is_refused() -> None:
    wf = Workflow("w").step("a", "s", retry={"max_attempts": 2})  # type: ignore[arg-type]
    assert_names(refused(wf), "'a'", "retry")


# --- 3. what @ductor.step decorates -------------------------------------------------------------


@pytest.mark.parametrize("value", [5, "shop.charge", None])
def test_step_decorator_on_a_non_function_is_refused(ductor: Ductor, value: Any) -> None:
    with pytest.raises(DefinitionError, match="takes a function"):
        if value is None:
            ductor.step(name="t.none")(value)
        else:
            ductor.step(value)


def test_step_decorator_on_a_string_hints_at_name(ductor: Ductor) -> None:
    with pytest.raises(DefinitionError, match=r"name=") as info:
        ductor.step("shop.charge")
    assert "'shop.charge'" in str(info.value)


@pytest.mark.parametrize(
    "fn",
    [lambda ctx: None, functools.partial(_noop, x=1)],
    ids=["lambda", "partial"],
)
def test_lambda_or_partial_step_without_name_is_refused(ductor: Ductor, fn: Any) -> None:
    with pytest.raises(DefinitionError, match=r"name=") as info:
        ductor.step(fn)
    assert "step" in str(info.value)
    assert not [n for n in ductor.app.tasks if "lambda" in n or "partial" in n]


@pytest.mark.parametrize("name", ["", TOO_LONG, "a\x00b", 5])
def test_step_name_that_is_not_an_id_is_refused(ductor: Ductor, name: Any) -> None:
    with pytest.raises(DefinitionError, match="name"):
        ductor.step(name=name)(_noop)


@pytest.mark.parametrize("queue", ["", TOO_LONG, "q\x00", 5])
def test_step_queue_that_is_not_an_id_is_refused(ductor: Ductor, queue: Any) -> None:
    with pytest.raises(DefinitionError) as info:
        ductor.step(name="t.q", queue=queue)(_noop)
    assert_names(str(info.value), "'t.q'", "queue")


def test_step_retry_that_is_not_a_retry_policy_is_refused(ductor: Ductor) -> None:
    with pytest.raises(DefinitionError) as info:
        ductor.step(name="t.r", retry=3)(_noop)  # type: ignore[arg-type]
    assert_names(str(info.value), "'t.r'", "retry")


@pytest.mark.parametrize(
    "fn",
    [lambda ctx, x=0: x + 1, functools.partial(_noop, x=1)],
    ids=["lambda", "partial"],
)
def test_lambda_and_partial_steps_with_name_are_tasks_a_worker_can_load(
    ductor: Ductor, fn: Any
) -> None:
    # Before the fix, finalizing the app (what every worker does first) raised SyntaxError:
    # Celery exec'd "def <lambda>(task, token): ..." to build the argument checker.
    ductor.step(name="t.anon")(fn)
    task = ductor.app.tasks["t.anon"]  # finalizes the app
    task.__header__("a-token")  # Celery's argument check for delay("a-token")
    with pytest.raises(TypeError):
        task.__header__()


def test_a_lambda_step_runs_to_success_under_local_workers(ductor: Ductor) -> None:
    inc = ductor.step(name="t.inc")(lambda ctx, x: x + 1)
    wf = Workflow("lam").step("a", inc, args={"x": "$.input"}).output("$.nodes.a.output")
    ductor.register(wf)
    with ductor.local_workers(concurrency=1):
        view = ductor.wait(ductor.start("lam", input=1).run_id, timeout=30)
    assert view.status == RunStatus.SUCCEEDED, view.error
    assert view.output == 2


# --- 4. workflow numbers ------------------------------------------------------------------------


@pytest.mark.parametrize("version", [2**70, MAX_INT + 1, 0, -1, True, 1.5, "1", None])
def test_workflow_version_not_an_integer_in_range_is_refused(version: Any) -> None:
    with pytest.raises(DefinitionError) as info:
        Workflow("w", version=version)
    assert_names(str(info.value), "'w'", "version")


@pytest.mark.parametrize("name", ["", TOO_LONG, "a\x00b", 5, None])
def test_workflow_name_that_is_not_an_id_is_refused(name: Any) -> None:
    with pytest.raises(DefinitionError, match="workflow name"):
        Workflow(name)


@pytest.mark.parametrize("children", [False, True], ids=["scatter", "child_scatter"])
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_parallel", 0),
        ("max_parallel", MAX_INT + 1),
        ("max_parallel", True),
        ("max_parallel", 1.5),
        ("max_parallel", NAN),
        ("tolerated_failures", -1),
        ("tolerated_failures", MAX_INT + 1),
        ("tolerated_failures", True),
        ("tolerated_failures", 2.0),
        ("tolerated_failure_ratio", NAN),
        ("tolerated_failure_ratio", INF),
        ("tolerated_failure_ratio", -0.1),
        ("tolerated_failure_ratio", 1.5),
        ("tolerated_failure_ratio", True),
        ("tolerated_failure_ratio", "0.5"),
    ],
)
def test_scatter_bounds_out_of_range_are_refused(children: bool, field: str, value: Any) -> None:
    wf = Workflow("w")
    if children:
        wf.scatter("fan", workflow="child", as_child_runs=True, over="$.input.xs", **{field: value})
    else:
        wf.scatter("fan", "s", over="$.input.xs", **{field: value})
    assert_names(refused(wf), "'fan'", field)


# --- 5. ids that do not fit their columns -------------------------------------------------------


@pytest.mark.parametrize("kind", ["step", "sleep", "checkpoint", "wait_signal"])
def test_node_id_over_200_characters_is_refused_at_register(kind: str) -> None:
    wf = Workflow("w")
    if kind == "step":
        wf.step(TOO_LONG, "s")
    elif kind == "sleep":
        wf.sleep(TOO_LONG, seconds=1)
    elif kind == "checkpoint":
        wf.checkpoint(TOO_LONG)
    else:
        wf.wait_signal(TOO_LONG, signal="go")
    message = refused(wf)
    assert_names(message, "node id", "xxxxxxxx", f"at most {MAX_ID_LENGTH} characters")
    assert len(message) < 300  # the id is cut short, not repeated in full


def test_node_id_of_exactly_200_characters_is_allowed() -> None:
    assert Workflow("w").step("x" * MAX_ID_LENGTH, "s").build().nodes[0].id == "x" * 200


def test_signal_and_event_names_over_200_characters_are_refused_at_register() -> None:
    assert_names(
        refused(Workflow("w").wait_signal("wait", signal=TOO_LONG)), "'wait'", "signal", "200"
    )
    assert_names(
        refused(Workflow("w").event_set("evs", events=["ok", TOO_LONG])),
        "'evs'",
        "events[1]",
        "200",
    )


@pytest.mark.parametrize("kind", ["subworkflow", "child_scatter"])
@pytest.mark.parametrize("name", [TOO_LONG, "", "a\x00b", 5])
def test_child_workflow_name_that_is_not_an_id_is_refused_at_register(kind: str, name: Any) -> None:
    wf = Workflow("w")
    if kind == "subworkflow":
        wf.subworkflow("kid", workflow=name)
    else:
        wf.scatter("kid", workflow=name, as_child_runs=True, over="$.input.xs")
    assert_names(refused(wf), "'kid'", "workflow")


# --- 6. signal names a node would wait for forever ----------------------------------------------


@pytest.mark.parametrize("signal", ["", "ductor.go", "ductor.approval:wait", None, 5])
def test_wait_signal_on_an_empty_or_reserved_name_is_refused_at_register(signal: Any) -> None:
    assert_names(refused(Workflow("w").wait_signal("wait", signal=signal)), "'wait'", "signal")


@pytest.mark.parametrize("events", ["abc", b"ab", 5, {"a", "b"}, None])
def test_event_set_events_that_are_not_a_list_are_refused_at_register(events: Any) -> None:
    assert_names(refused(Workflow("w").event_set("evs", events=events)), "'evs'", "events")


@pytest.mark.parametrize(
    "events", [[], ["a", "a"], ["a", ""], ["a", "ductor.x"], ["a", 5]], ids=str
)
def test_event_set_duplicate_empty_or_reserved_event_names_are_refused_at_register(
    events: list[Any],
) -> None:
    message = refused(Workflow("w").event_set("evs", events=events))
    assert_names(message, "'evs'", "event")


@pytest.mark.parametrize("mode", [0, 3, True, "some", 1.0])
def test_event_set_mode_out_of_range_is_refused_at_register(mode: Any) -> None:
    message = refused(Workflow("w").event_set("evs", events=["a", "b"], mode=mode))
    assert_names(message, "'evs'", "mode")


def test_a_list_or_tuple_of_events_is_allowed() -> None:
    spec = Workflow("w").event_set("evs", events=["a", "b"], mode=2).build()
    assert spec.nodes[0].events == ("a", "b")
    assert Workflow("w").event_set("evs", events=("a",)).build().nodes[0].events == ("a",)


# --- 7. concurrency limits ----------------------------------------------------------------------


@pytest.mark.parametrize("limit", [0, -1, True, 1.5, MAX_INT + 1, NAN, "2", None])
def test_concurrency_limit_not_an_integer_in_range_is_refused(limit: Any) -> None:
    with pytest.raises(DefinitionError, match="ConcurrencyLimit.limit"):
        ConcurrencyLimit(key="$.input.c", limit=limit)


@pytest.mark.parametrize("key", ["", "k" * (MAX_LEASE_KEY_LENGTH + 1), "a\x00", None, 5])
def test_concurrency_key_empty_or_over_500_characters_is_refused(key: Any) -> None:
    with pytest.raises(DefinitionError, match="ConcurrencyLimit.key"):
        ConcurrencyLimit(key=key, limit=1)


def test_concurrency_key_of_500_characters_is_allowed() -> None:
    assert ConcurrencyLimit(key="k" * MAX_LEASE_KEY_LENGTH, limit=MAX_INT).limit == MAX_INT


# --- when= --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["step", "sleep", "subworkflow"])
@pytest.mark.parametrize("when", [5, 1.5, ["$.input.x"]])
def test_when_that_is_neither_a_path_nor_a_bool_is_refused_at_register(
    kind: str, when: Any
) -> None:
    wf = Workflow("w")
    if kind == "step":
        wf.step("cond", "s", when=when)
    elif kind == "sleep":
        wf.sleep("cond", seconds=1, when=when)
    else:
        wf.subworkflow("cond", workflow="child", when=when)
    message = refused(wf)
    assert_names(message, "'cond'", "when")
    assert "input_type" not in message  # ours, not a pydantic dump
