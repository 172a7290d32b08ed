"""Ductor(app) on a plain Celery app: task options, settings, client errors, embedded runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from ductor_celery import (
    DefinitionError,
    Ductor,
    PayloadTooLarge,
    RetryPolicy,
    RunNotFound,
    RunStatus,
    StepContext,
    Workflow,
    WorkflowNotFound,
)
from ductor_celery.settings import Settings


def _app(tmp_path: Path, **conf: Any) -> Celery:
    app = Celery(f"wiring{id(conf)}", set_as_current=False)
    app.conf.update(ductor_database_url=f"sqlite:///{tmp_path}/d.sqlite3", **conf)
    return app


def test_steps_are_late_acked_json_tasks_on_the_steps_queue(tmp_path: Path) -> None:
    app = _app(tmp_path)

    @app.task(name="user.own")
    def own() -> int:
        return 1

    d = Ductor(app)

    @d.step(name="shop.charge", retry=RetryPolicy(max_attempts=5), timeout=30.0)
    def charge(ctx: StepContext, amount: int) -> int:
        return amount

    task = app.tasks["shop.charge"]
    assert task.acks_late and task.reject_on_worker_lost
    assert task.ignore_result and task.serializer == "json"
    assert task.queue == "ductor-steps"
    tick = app.tasks["ductor.tick"]
    assert tick.queue == "ductor-coord" and tick.ignore_result and tick.serializer == "json"
    user = app.tasks["user.own"]
    assert not user.acks_late and getattr(user, "queue", None) is None  # left alone
    assert app.conf.worker_send_task_events is True
    assert charge(None, amount=3) == 3  # still callable as a function
    assert charge.retry.max_attempts == 5 and charge.timeout == 30.0


def test_user_configured_task_events_are_respected(tmp_path: Path) -> None:
    app = _app(tmp_path, worker_send_task_events=False)
    Ductor(app)
    assert app.conf.worker_send_task_events is False


def test_database_url_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUCTOR_DATABASE_URL", "postgresql://env/db")
    assert Settings.from_conf({}).database_url == "postgresql+psycopg://env/db"
    assert Settings.from_conf({"ductor_database_url": "sqlite:///conf.db"}).database_url == (
        "sqlite:///conf.db"
    )
    assert Settings.from_conf({"ductor_database_url": "x"}, "sqlite:///arg.db").database_url == (
        "sqlite:///arg.db"
    )
    monkeypatch.delenv("DUCTOR_DATABASE_URL")
    assert Settings.from_conf({}).embedded


def test_client_errors_name_the_problem_and_write_nothing(tmp_path: Path) -> None:
    app = _app(tmp_path, ductor_max_payload_bytes=100)
    d = Ductor(app)

    @d.step(name="t.echo")
    def echo(ctx: StepContext, value: Any = None) -> Any:
        return value

    wf = Workflow("w")
    wf.step("a", echo)
    d.register(wf)
    with pytest.raises(WorkflowNotFound, match="nope"):
        d.start("nope")
    with pytest.raises(PayloadTooLarge, match="ductor_max_payload_bytes=100"):
        d.start("w", input={"blob": "x" * 200})
    with pytest.raises(RunNotFound, match="missing-run"):
        d.get("missing-run")
    assert d.list_runs() == []


def test_register_rejects_a_step_from_another_ductor(tmp_path: Path) -> None:
    d1 = Ductor(_app(tmp_path))
    d2 = Ductor(_app(tmp_path / "other"))

    @d1.step(name="t.only_here")
    def only_here(ctx: StepContext) -> None:
        return None

    wf = Workflow("w")
    wf.step("a", only_here)
    with pytest.raises(DefinitionError, match="t.only_here"):
        d2.register(wf)
    wf2 = Workflow("w2")
    wf2.step("a", "t.unknown")
    with pytest.raises(DefinitionError, match="unknown step 't.unknown'"):
        d1.register(wf2)


def test_local_workers_run_a_workflow_end_to_end_on_sqlite(tmp_path: Path) -> None:
    d = Ductor(_app(tmp_path))

    @d.step(name="t.inc")
    def inc(ctx: StepContext, x: int) -> int:
        ctx.patch({ctx.node: x})
        return x + 1

    @d.step(name="t.bad", retry=RetryPolicy(max_attempts=2, initial_interval=0.05))
    def bad(ctx: StepContext) -> None:
        raise RuntimeError("nope")

    wf = Workflow("inc")
    wf.step("a", inc, args={"x": "$.input"})
    wf.step("b", inc, after=["a"], args={"x": "$.nodes.a.output"})
    wf.step("c", bad, after=["a"], continue_on_failure=True)
    wf.step("d", inc, after=["b", "c"], args={"x": "$.nodes.b.output"})
    wf.output("$.nodes.d.output")
    d.register(wf)
    with d.local_workers():
        view = d.wait(d.start("inc", input=1).run_id, timeout=30)
    assert view.status == RunStatus.SUCCEEDED
    assert view.output == 4
    assert view.context == {"a": 1, "b": 2, "d": 3}
    assert view.nodes["c"].status == "failed" and view.nodes["c"].attempts == 2
    assert view.nodes["c"].output is None


def test_leaving_local_workers_does_not_wait_out_the_consumer_loops_cycles(
    tmp_path: Path,
) -> None:
    """Celery's blocking consumer loop (the in-memory transport's) waits 2 s per cycle and
    runs one more cycle on its way out: every ``with local_workers()`` took 4 s to leave."""
    import time

    d = Ductor(_app(tmp_path))
    d.step(name="t.one")(lambda ctx: 1)
    wf = Workflow("one")
    wf.step("a", "t.one")
    d.register(wf)
    with d.local_workers():
        assert d.wait(d.start("one").run_id, timeout=30).status == RunStatus.SUCCEEDED
        leaving = time.monotonic()
    assert time.monotonic() - leaving < 1.5


def test_bad_step_options_are_refused_not_ignored(tmp_path: Path) -> None:
    from ductor_celery import ConcurrencyLimit

    d = Ductor(_app(tmp_path))
    with pytest.raises(DefinitionError, match="heartbeat_timeout must be positive"):

        @d.step(name="t.hb", heartbeat_timeout=0)
        def hb(ctx: StepContext) -> None:
            return None

    with pytest.raises(DefinitionError, match="concurrency= takes a ConcurrencyLimit"):

        @d.step(name="t.cc", concurrency={"key": "$.input.c", "limit": 2})
        def cc(ctx: StepContext) -> None:
            return None

    with pytest.raises(DefinitionError, match="limit must be >= 1"):
        ConcurrencyLimit(key="$.input.c", limit=0)

    @d.step(name="t.bad_key", concurrency=ConcurrencyLimit(key="$.nodes.nope.output", limit=1))
    def bad_key(ctx: StepContext) -> None:
        return None

    wf = Workflow("bad_key")
    wf.step("a", bad_key)
    with pytest.raises(DefinitionError, match="unknown node 'nope'"):
        d.register(wf)


def test_a_parent_registered_before_its_child_starts_the_newest_child(tmp_path: Path) -> None:
    from ductor_celery import WorkflowNotFound

    d = Ductor(_app(tmp_path))

    @d.step(name="t.double")
    def double(ctx: StepContext, x: int) -> int:
        return 2 * x

    parent = Workflow("parent_first")
    parent.subworkflow("sub", workflow="child_later", input={"x": "$.input.x"})
    parent.output("$.nodes.sub.output")
    d.register(parent)  # the child is not registered yet: resolved by name when a run starts
    with pytest.raises(WorkflowNotFound, match="starts workflow 'child_later'"):
        d.start("parent_first", input={"x": 2})

    child = Workflow("child_later")
    child.step("d", double, args={"x": "$.input.x"})
    child.output("$.nodes.d.output")
    d.register(child)
    with d.local_workers():
        view = d.wait(d.start("parent_first", input={"x": 21}).run_id, timeout=30)
    assert view.status == RunStatus.SUCCEEDED, view.error
    assert view.output == 42
