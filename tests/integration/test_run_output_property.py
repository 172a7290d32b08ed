"""Issue 23, item 1: whatever finishes a run computes its output. A property over control
sequences on one run (steps that succeed, fail, fail for good, or cancel their own run while
they run; pause, resume, cancel, terminate, redrive, redrive from a node, continue-as-new)
through the real store and tick on SQLite: every time the run (or its successor) is
succeeded, its output is the workflow's output mapping over its input and its nodes' outputs.

The case that broke it: a step cancels its run and then succeeds within the cancel's grace, so
the run ends ``cancelled`` with every node succeeded; a redrive then reopened and finished it
in one tick, and the store, which wrote the output only on a move from open to terminal,
left ``output`` None.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from ductor_celery import Ductor, DuctorError, NonRetryableError, RetryPolicy, Workflow
from ductor_celery.runtime.steps import execute_attempt
from ductor_celery.runtime.tick_task import run_tick

RETRY = RetryPolicy(max_attempts=2, initial_interval=0, backoff=1, max_interval=0)


class World:
    """One SQLite database and Ductor; the test delivers every tick and step itself."""

    def __init__(self, url: str) -> None:
        app = Celery(f"outputs{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
        app.conf.ductor_inline_steps = 0  # each step runs when the sequence says
        self.d = Ductor(app, database_url=url)
        if url.startswith("sqlite"):
            self.d.migrate()
        self.behavior = "ok"
        rt = self.d.runtime
        rt.dispatcher.send = lambda rows: None  # type: ignore[method-assign]
        rt.dispatcher.wake = lambda run_id: None  # type: ignore[method-assign]
        rt.dispatcher.first_tick = lambda run_id: None  # type: ignore[method-assign]
        rt.dispatcher.wake_many = lambda run_ids: None  # type: ignore[method-assign]

        @self.d.step(name="outputs.work", retry=RETRY)
        def work(ctx: Any, n: Any = None) -> dict[str, Any]:
            behavior = self.behavior
            if behavior == "fail":
                raise RuntimeError("fails on purpose (retried)")
            if behavior == "fatal":
                raise NonRetryableError("fails for good, on purpose")
            if behavior == "cancel":
                try:  # while it runs: it then finishes within the cancel's grace
                    self.d.cancel(ctx.run_id, reason="from inside a step")
                except DuctorError:
                    pass
            return {"node": ctx.node, "attempt": ctx.attempt, "n": n}

        self.step = work
        wf = Workflow("outputs")
        wf.step("a", work, args={"n": "$.input.n"})
        wf.step("b", work, after=["a"], args={"n": "$.nodes.a.output.n"})
        wf.output({"a": "$.nodes.a.output", "b": "$.nodes.b.output.attempt", "in": "$.input"})
        self.d.register(wf)

    def settle(self, run_id: str) -> None:
        for _ in range(20):
            if run_tick(self.d.runtime, run_id) != "committed":
                return

    def open_attempt(self, run_id: str) -> str | None:
        with self.d.runtime.engine().connect() as conn:
            return conn.execute(
                sa.text(
                    "SELECT token FROM eec_workflow_step_attempt WHERE run_id = :r"
                    " AND finished_at IS NULL AND claimed_at IS NULL ORDER BY created_at"
                ),
                {"r": run_id},
            ).scalar()

    def newest(self, workflow_id: str) -> str:
        return self.d.get(workflow_id).run_id


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return World(f"sqlite:///{tmp_path_factory.mktemp('outputs') / 'outputs.sqlite3'}")


OPERATIONS = st.one_of(
    st.tuples(st.just("step"), st.sampled_from(["ok", "ok", "ok", "fail", "fatal", "cancel"])),
    st.tuples(
        st.just("control"),
        st.sampled_from(
            ["pause", "resume", "cancel", "terminate", "redrive", "redrive"]
            + ["from_a", "from_b", "can"]
        ),
    ),
)


def _expected(view: Any) -> dict[str, Any]:
    """The output mapping over the view, written out by hand (not the engine's resolver)."""
    b = view.nodes["b"].output
    return {
        "a": view.nodes["a"].output,
        "b": b["attempt"] if isinstance(b, dict) else None,
        "in": view.input,
    }


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(OPERATIONS, min_size=3, max_size=25), n=st.integers(0, 9))
def test_every_succeeded_run_has_its_workflows_output(
    world: World, ops: list[tuple[str, str]], n: int
) -> None:
    d = world.d
    workflow_id = f"w-{uuid.uuid4().hex[:10]}"
    world.settle(d.start("outputs", input={"n": n}, workflow_id=workflow_id).run_id)
    for op, arg in ops:
        run_id = world.newest(workflow_id)
        if op == "step":
            token = world.open_attempt(run_id)
            if token is not None:
                world.behavior = arg
                execute_attempt(d.runtime, world.step, token, hostname="outputs-test")
                world.behavior = "ok"
        else:
            try:
                if arg in ("from_a", "from_b"):
                    d.redrive(workflow_id, from_node=arg[-1])
                elif arg == "can":
                    d.continue_as_new(workflow_id)
                else:
                    getattr(d, arg)(workflow_id)
            except DuctorError:
                pass  # not allowed in the run's state: refused, nothing changed
        world.settle(world.newest(workflow_id))
        view = d.get(workflow_id)
        note(f"{op} {arg} -> {view.status.value} {view.output!r}")
        if view.status == "succeeded":
            assert view.output == _expected(view), view


@pytest.mark.parametrize("db", ["sqlite", "postgresql"])
def test_a_cancelled_run_whose_nodes_all_succeeded_redrives_to_its_output(
    db: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = (
        f"sqlite:///{tmp_path}/one.sqlite3"
        if db == "sqlite"
        else request.getfixturevalue("database_url")
    )
    world = World(url)
    d = world.d
    world.settle(d.start("outputs", input={"n": 3}, workflow_id="w").run_id)
    for behavior in ("ok", "cancel"):  # a succeeds; b cancels its run, then succeeds
        run_id = world.newest("w")
        token = world.open_attempt(run_id)
        assert token is not None
        world.behavior = behavior
        execute_attempt(d.runtime, world.step, token, hostname="outputs-test")
        world.settle(run_id)
    world.behavior = "ok"
    view = d.get("w")
    assert view.status == "cancelled"
    assert {n.status for n in view.nodes.values()} == {"succeeded"}

    d.redrive("w")
    world.settle(view.run_id)
    view = d.get("w")
    assert view.status == "succeeded"
    assert view.output == {"a": {"node": "a", "attempt": 1, "n": 3}, "b": 1, "in": {"n": 3}}
    assert view.finished_at is not None
