"""Issue 14 items 6-8 through the real store and step task (``local_workers``), on the
embedded SQLite and on PostgreSQL: pause on exhaustion and resume, rerun from a node,
versions."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from ductor_celery import (
    Ductor,
    InvalidOperation,
    NodeNotFound,
    NodeStatus,
    RetryPolicy,
    RunStatus,
    StepContext,
    Workflow,
)
from ductor_celery.store.schema import workflow_control


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/lifecycle.sqlite3"
    url: str = request.getfixturevalue("database_url")
    return url


def _ductor(url: str) -> Ductor:
    d = Ductor(Celery(f"lifecycle{time.monotonic_ns()}", set_as_current=False), database_url=url)
    if url.startswith("sqlite"):
        d.migrate()
    return d


def _until(d: Ductor, run_id: str, status: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while (view := d.get(run_id)).status != status:
        assert time.monotonic() < deadline, f"run is {view.status}, not {status}"
        time.sleep(0.05)
    return view


class _Shop:
    """reserve -> charge -> ship, with a bug in charge that the test can fix."""

    def __init__(self, url: str, on_exhausted: Any = "fail") -> None:
        self.d = _ductor(url)
        self.calls: dict[str, int] = {}
        self.bug = False

        def count(ctx: StepContext) -> None:
            self.calls[ctx.node] = self.calls.get(ctx.node, 0) + 1

        @self.d.step(name="shop.reserve")
        def reserve(ctx: StepContext, order: Any) -> dict[str, Any]:
            count(ctx)
            return {"reserved": order}

        @self.d.step(
            name="shop.charge",
            retry=RetryPolicy(max_attempts=2, initial_interval=0.01, on_exhausted=on_exhausted),
        )
        def charge(ctx: StepContext, total: int) -> dict[str, Any]:
            count(ctx)
            if self.bug:
                raise RuntimeError("charge bug")
            return {"charged": total}

        @self.d.step(name="shop.ship")
        def ship(ctx: StepContext, charged: Any) -> Any:
            count(ctx)
            return {"shipped": charged, "seen_total": ctx.input["total"]}

        wf = Workflow("shop")
        wf.step("reserve", reserve, args={"order": "$.input.id"})
        wf.step("charge", charge, after=["reserve"], args={"total": "$.input.total"})
        wf.step("ship", ship, after=["charge"], args={"charged": "$.nodes.charge.output"})
        wf.output({"ship": "$.nodes.ship.output", "reserve": "$.nodes.reserve.output"})
        self.d.register(wf)


def test_pause_on_exhaustion_then_resume_after_the_fix(db_url: str) -> None:
    shop = _Shop(db_url, on_exhausted="pause")
    shop.bug = True
    with shop.d.local_workers():
        handle = shop.d.start("shop", input={"id": 7, "total": 30})
        view = _until(shop.d, handle.run_id, RunStatus.PAUSED)
        assert view.nodes["charge"].status == NodeStatus.FAILED
        assert view.nodes["charge"].error["message"] == "charge bug"
        assert view.nodes["ship"].status == NodeStatus.PENDING
        assert shop.calls == {"reserve": 1, "charge": 2}
        shop.bug = False  # the fix is deployed
        shop.d.resume(handle.run_id)
        done = shop.d.wait(handle.run_id, timeout=30)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert done.output == {
        "ship": {"shipped": {"charged": 30}, "seen_total": 30},
        "reserve": {"reserved": 7},
    }
    assert shop.calls == {"reserve": 1, "charge": 3, "ship": 1}
    reasons = [t.reason for t in shop.d.client.history(handle.run_id)[1]]
    assert any("on_exhausted='pause'" in r for r in reasons)
    assert "resume: fresh retry budget" in reasons


def _controls(d: Ductor) -> int:
    with d.client.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(workflow_control)).scalar())


def test_redrive_from_a_node_of_a_succeeded_run_with_a_new_input(db_url: str) -> None:
    shop = _Shop(db_url)
    with shop.d.local_workers():
        handle = shop.d.start("shop", input={"id": 7, "total": 30})
        first = shop.d.wait(handle.run_id, timeout=30)
        assert first.status == RunStatus.SUCCEEDED
        shop.d.redrive(handle.workflow_id, from_node="charge", input={"id": 7, "total": 50})
        again = shop.d.wait(handle.run_id, timeout=30)
    assert again.status == RunStatus.SUCCEEDED, again.error
    assert again.output == {
        "ship": {"shipped": {"charged": 50}, "seen_total": 50},
        "reserve": {"reserved": 7},  # upstream output kept: reserve did not run again
    }
    assert shop.calls == {"reserve": 1, "charge": 2, "ship": 2}
    assert again.input == {"id": 7, "total": 50}
    assert again.nodes["charge"].attempts == 2 and again.nodes["reserve"].attempts == 1
    history = [
        (t.node, t.from_status, t.to_status, t.reason)
        for t in shop.d.client.history(handle.run_id)[1]
    ]
    assert ("charge", "succeeded", "pending", "redrive from 'charge'") in history
    assert ("ship", "succeeded", "pending", "redrive from 'charge'") in history
    assert (None, "succeeded", "running", "redrive from 'charge'") in history


def test_a_redrive_from_a_failed_node_keeps_upstream(db_url: str) -> None:
    shop = _Shop(db_url)
    shop.bug = True
    with shop.d.local_workers():
        handle = shop.d.start("shop", input={"id": 1, "total": 5})
        assert shop.d.wait(handle.run_id, timeout=30).status == RunStatus.FAILED
        shop.bug = False
        shop.d.redrive(handle.run_id, from_node="charge")
        again = shop.d.wait(handle.run_id, timeout=30)
    assert again.status == RunStatus.SUCCEEDED and again.input == {"id": 1, "total": 5}
    assert shop.calls == {"reserve": 1, "charge": 3, "ship": 1}


def test_bad_redrives_raise_one_clear_error_and_write_nothing(db_url: str) -> None:
    shop = _Shop(db_url)
    with shop.d.local_workers():
        handle = shop.d.start("shop", input={"id": 7, "total": 30})
        assert shop.d.wait(handle.run_id, timeout=30).status == RunStatus.SUCCEEDED
        before = _controls(shop.d)
        with pytest.raises(NodeNotFound, match=r"'nope'.*no such node.*reserve, charge, ship"):
            shop.d.redrive(handle.run_id, from_node="nope")
        with pytest.raises(InvalidOperation, match="succeeded"):
            shop.d.redrive(handle.run_id)  # a plain redrive of a succeeded run
        with pytest.raises(ValueError, match="from_node"):
            shop.d.redrive(handle.run_id, from_node="")
        with pytest.raises(TypeError, match="from_node"):
            shop.d.redrive(handle.run_id, from_node=5)  # type: ignore[arg-type]
        with pytest.raises(Exception, match="redrive input"):
            shop.d.redrive(handle.run_id, from_node="charge", input={"x": float("nan")})
        assert _controls(shop.d) == before
        assert shop.d.get(handle.run_id).status == RunStatus.SUCCEEDED


def _cli(d: Ductor, *args: str) -> Any:
    from types import SimpleNamespace

    from click.testing import CliRunner

    from ductor_celery.cli import ductor as ductor_cli

    return CliRunner().invoke(ductor_cli, list(args), obj=SimpleNamespace(app=d.app))


def _one_line_error(result: Any, words: str) -> None:
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], lines


def test_the_cli_redrives_from_a_node_with_an_input(db_url: str) -> None:
    shop = _Shop(db_url)
    with shop.d.local_workers():
        handle = shop.d.start("shop", input={"id": 3, "total": 1})
        assert shop.d.wait(handle.run_id, timeout=30).status == RunStatus.SUCCEEDED
        before = _controls(shop.d)
        _one_line_error(_cli(shop.d, "redrive", handle.run_id, "--from-node", "nope"), "nope")
        _one_line_error(
            _cli(shop.d, "redrive", handle.run_id, "--from-node", "ship", "--input", "{bad"),
            "--input",
        )
        assert _controls(shop.d) == before
        done = _cli(
            shop.d,
            "redrive",
            handle.run_id,
            "--from-node",
            "ship",
            "--input",
            '{"id": 3, "total": 9}',
        )
        assert done.exit_code == 0, done.output
        again = shop.d.wait(handle.run_id, timeout=30)
    assert again.status == RunStatus.SUCCEEDED
    assert again.output["ship"] == {"shipped": {"charged": 1}, "seen_total": 9}
    assert shop.calls == {"reserve": 1, "charge": 1, "ship": 2}


def _deploy(url: str, version: int, register_older: bool = False) -> Ductor:
    """One deploy of the "order" workflow: version 1 is a -> hold -> b; version 2 adds c
    after b and changes the output."""
    d = _ductor(url)

    @d.step(name="v.a")
    def a(ctx: StepContext) -> str:
        return "a"

    @d.step(name="v.b")
    def b(ctx: StepContext) -> str:
        return "b"

    @d.step(name="v.c")
    def c(ctx: StepContext) -> str:
        return "c"

    def build(v: int) -> Workflow:
        wf = Workflow("order", version=v)
        wf.step("a", a)
        wf.wait_signal("hold", signal="go", after=["a"])
        wf.step("b", b, after=["hold"])
        if v == 1:
            wf.output({"v": 1, "b": "$.nodes.b.output"})
        else:
            wf.step("c", c, after=["b"])
            wf.output({"v": 2, "c": "$.nodes.c.output"})
        return wf

    if register_older:
        d.register(build(1))
    d.register(build(version))
    return d


def _runs(d: Ductor) -> int:
    with d.client.engine.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT count(*) FROM eec_workflow_run")  # every run, any status
            ).scalar_one()
        )


def test_a_run_keeps_its_version_while_a_new_one_is_deployed(db_url: str) -> None:
    old = _deploy(db_url, 1)
    with old.local_workers():
        first = old.start("order")
        _until(old, first.run_id, RunStatus.RUNNING)
        deadline = time.monotonic() + 30
        while old.get(first.run_id).nodes["hold"].status != NodeStatus.WAITING:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    new = _deploy(db_url, 2)  # the new deploy knows only version 2
    with new.local_workers():
        second = new.start("order")
        pinned = new.start("order", version=1)  # stored by the old deploy's start
        assert new.get(second.run_id).version == 2 and new.get(pinned.run_id).version == 1
        for handle in (first, second, pinned):
            _until(new, handle.run_id, RunStatus.RUNNING)
        time.sleep(0.3)
        for handle in (first, second, pinned):
            new.signal(handle.run_id, "go")
        views = [new.wait(h.run_id, timeout=30) for h in (first, second, pinned)]
    assert [v.status for v in views] == [RunStatus.SUCCEEDED] * 3
    assert [v.version for v in views] == [1, 2, 1]
    assert views[0].output == {"v": 1, "b": "b"} and "c" not in views[0].nodes
    assert views[1].output == {"v": 2, "c": "c"}
    assert views[2].output == {"v": 1, "b": "b"}


def test_continue_as_new_moves_a_run_to_the_newest_version(db_url: str) -> None:
    d = _deploy(db_url, 2, register_older=True)
    with d.local_workers():
        handle = d.start("order", workflow_id="order-1", version=1)
        deadline = time.monotonic() + 30
        while d.get(handle.run_id).nodes["hold"].status != NodeStatus.WAITING:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        d.continue_as_new("order-1", version="latest")
        moved = _until(d, handle.run_id, RunStatus.CONTINUED)
        assert moved.continued_to is not None
        successor = d.get(moved.continued_to)
        assert successor.version == 2 and successor.continued_from == handle.run_id
        # a and hold are unchanged in version 2: carried, a does not run again
        assert successor.nodes["a"].status == NodeStatus.SUCCEEDED
        assert successor.nodes["hold"].status == NodeStatus.WAITING
        d.signal("order-1", "go")
        done = d.wait("order-1", timeout=30)
    assert done.run_id == moved.continued_to and done.version == 2
    assert done.output == {"v": 2, "c": "c"}


def test_unknown_versions_raise_one_clear_error_and_write_nothing(db_url: str) -> None:
    from ductor_celery import VersionNotFound, WorkflowNotFound

    d = _deploy(db_url, 2, register_older=True)
    with pytest.raises(VersionNotFound, match=r"no version 3 \(registered: 1, 2\)"):
        d.start("order", version=3)
    with pytest.raises(WorkflowNotFound):
        d.start("nope", version=1)
    with pytest.raises(TypeError, match="version"):
        d.start("order", version="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="version"):
        d.start("order", version=0)
    assert _runs(d) == 0
    with d.local_workers():
        handle = d.start("order", version=1)
        _until(d, handle.run_id, RunStatus.RUNNING)
        before = _controls(d)
        with pytest.raises(VersionNotFound, match="no version 7"):
            d.continue_as_new(handle.run_id, version=7)
        with pytest.raises(TypeError, match="'latest'"):
            d.continue_as_new(handle.run_id, version="newest")
        assert _controls(d) == before
        d.cancel(handle.run_id)
        d.wait(handle.run_id, timeout=30)
    assert _runs(d) == 1


def test_the_cli_starts_a_version_moves_a_run_and_shows_versions(db_url: str) -> None:
    d = _deploy(db_url, 2, register_older=True)
    _one_line_error(_cli(d, "start", "order", "--version", "9"), "no version 9")
    _one_line_error(_cli(d, "start", "order", "--version", "two"), "--version")
    assert _runs(d) == 0
    with d.local_workers():
        started = _cli(d, "start", "order", "--version", "1", "--workflow-id", "o-1")
        assert started.exit_code == 0, started.output
        run_id = json.loads(started.output)["run_id"]
        assert d.get(run_id).version == 1
        deadline = time.monotonic() + 30
        while d.get(run_id).nodes["hold"].status != NodeStatus.WAITING:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        listed = _cli(d, "runs")
        assert listed.exit_code == 0 and "order v1" in listed.output
        shown = _cli(d, "show", run_id)
        assert shown.exit_code == 0 and "order v1" in shown.output
        before = _controls(d)
        _one_line_error(_cli(d, "continue-as-new", "o-1", "--version", "5"), "no version 5")
        assert _controls(d) == before
        moved = _cli(d, "continue-as-new", "o-1", "--version", "latest")
        assert moved.exit_code == 0, moved.output
        view = _until(d, run_id, RunStatus.CONTINUED)
        assert view.continued_to is not None and d.get(view.continued_to).version == 2
        d.cancel("o-1")
        d.wait("o-1", timeout=30)
    listed = _cli(d, "runs")
    assert "order v2" in listed.output and "order v1" in listed.output


def test_a_bulk_redrive_from_a_node_takes_succeeded_runs(db_url: str) -> None:
    shop = _Shop(db_url)
    with shop.d.local_workers():
        handles = [shop.d.start("shop", input={"id": i, "total": i}) for i in (1, 2)]
        for h in handles:
            assert shop.d.wait(h.run_id, timeout=30).status == RunStatus.SUCCEEDED
        counted = _cli(shop.d, "redrive", "--workflow", "shop", "--status", "succeeded")
        _one_line_error(counted, "cannot redrive succeeded runs")
        args = ("redrive", "--workflow", "shop", "--status", "succeeded", "--from-node", "ship")
        counted = _cli(shop.d, *args)
        assert counted.exit_code == 0 and "2 runs match; nothing done" in counted.output
        done = _cli(shop.d, *args, "--yes")
        assert done.exit_code == 0 and "for 2 of 2 runs" in done.output, done.output
        views = [shop.d.wait(h.run_id, timeout=30) for h in handles]
    assert [v.status for v in views] == [RunStatus.SUCCEEDED] * 2
    assert shop.calls == {"reserve": 2, "charge": 2, "ship": 4}


def test_pause_on_exhaustion_in_the_testing_harness_with_its_clock(tmp_path: Path) -> None:
    """The same cycle a user's own test writes: retries with backoff in one advance(), the
    run paused, the fix (a stub), resume."""
    from ductor_celery import testing

    shop = _Shop(f"sqlite:///{tmp_path}/user.sqlite3", on_exhausted="pause")
    with testing.harness(shop.d) as h:
        h.stub("shop.charge", raises=RuntimeError("card service down"))
        handle = h.start("shop", input={"id": 1, "total": 3})
        h.advance(seconds=60)
        view = h.run(handle)
        assert view.status == RunStatus.PAUSED
        assert view.nodes["charge"].attempts == 2
        h.stub("shop.charge", returns={"charged": 3})
        shop.d.resume(handle.run_id)
        done = h.run(handle)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert done.nodes["charge"].attempts == 3
