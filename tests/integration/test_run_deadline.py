"""Issue 14 item 2: run deadlines (``start(deadline=)``, ``Workflow(deadline=)``).

On the harness's controlled clock: a run past its deadline ends ``timed_out`` with its hung
attempt closed and its message revoked with terminate, its child run closed by the node's
parent-close policy; the workflow's default deadline; a redrive of a timed-out run. On both
databases: a short real deadline, ``RunView.deadline_at``, the timer row, and bad deadlines
refused before anything is written.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from ductor_celery import Ductor, NodeStatus, RunStatus, StepContext, Workflow, testing
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store.migrate import upgrade
from ductor_celery.store.schema import workflow_control, workflow_run

T0 = datetime(2030, 1, 1, 9, 0, tzinfo=UTC)


def _make(url: str, name: str) -> Ductor:
    app = Celery(name, broker="memory://", set_as_current=False)
    app.conf.ductor_eager_ticks = False
    d = Ductor(app, database_url=url)

    @d.step(name="dl.slow", timeout=7200)
    def slow(ctx: StepContext) -> str:
        return "done"

    wf = Workflow("report")
    wf.step("a", slow)
    d.register(wf)
    child = Workflow("child")
    child.step("c", slow)
    d.register(child)
    parent = Workflow("parent", deadline=600)
    parent.subworkflow("kid", workflow="child", parent_close="cancel")
    d.register(parent)
    quick = Workflow("quick_child", deadline=30)
    quick.step("c", slow)
    d.register(quick)
    waiting = Workflow("waits_for_quick")
    waiting.subworkflow("kid", workflow="quick_child")
    d.register(waiting)
    return d


@pytest.fixture
def local(tmp_path: Path) -> Ductor:
    return _make(f"sqlite:///{tmp_path}/user.sqlite3", f"dl{id(tmp_path)}")


def test_a_run_past_its_deadline_times_out_and_its_attempt_is_killed(local: Ductor) -> None:
    with testing.harness(local, start_at=T0) as h:
        h.stub("dl.slow", hangs=True)
        handle = h.start("report", deadline=3600)
        view = h.get(handle)
        assert view.status == RunStatus.RUNNING
        assert view.deadline_at == T0 + timedelta(seconds=3600)
        h.advance(seconds=3599)
        assert h.get(handle).status == RunStatus.RUNNING
        h.advance(seconds=1)
        view = h.get(handle)
        assert view.status == RunStatus.TIMED_OUT
        assert view.nodes["a"].status == NodeStatus.CANCELLED
        assert view.error["type"] == "RunTimeout"
        assert view.finished_at is not None
        revokes = [m for m in h.messages if m.kind == "revoke"]
        assert [m.token for m in revokes] == [f"{handle.run_id}:a:1"]


def test_the_workflows_deadline_closes_its_children_by_their_policy(local: Ductor) -> None:
    with testing.harness(local, start_at=T0) as h:
        h.stub("dl.slow", hangs=True)
        handle = h.start("parent")
        assert h.get(handle).deadline_at == T0 + timedelta(seconds=600)
        h.advance(seconds=600)
        assert h.get(handle).status == RunStatus.TIMED_OUT
        (child,) = local.list_runs(workflow="child")
        # parent_close="cancel": a cooperative cancel, so the child's step (which never
        # stops) gets ductor_cancel_grace (30 s) before it is closed.
        assert child.status == RunStatus.RUNNING
        h.advance(seconds=30)
        assert local.get(child.run_id).status == RunStatus.CANCELLED


def test_a_child_times_out_by_its_own_workflows_deadline_and_fails_its_parent(
    local: Ductor,
) -> None:
    with testing.harness(local, start_at=T0) as h:
        h.stub("dl.slow", hangs=True)
        handle = h.start("waits_for_quick")
        assert h.get(handle).deadline_at is None
        (child,) = local.list_runs(workflow="quick_child")
        assert child.deadline_at == T0 + timedelta(seconds=30)
        h.advance(seconds=30)
        assert local.get(child.run_id).status == RunStatus.TIMED_OUT
        view = h.get(handle)
        assert view.status == RunStatus.FAILED
        assert view.nodes["kid"].status == NodeStatus.FAILED


def test_a_delayed_or_scheduled_run_counts_its_deadline_from_its_start(local: Ductor) -> None:
    with testing.harness(local, start_at=T0) as h:
        h.stub("dl.slow", hangs=True)
        delayed = h.start("report", delay=60, deadline=30)
        assert h.get(delayed).deadline_at == T0 + timedelta(seconds=90)
        local.schedule("every_hour", workflow="parent", every=3600)
        h.advance(seconds=3600)
        assert h.get(delayed).status == RunStatus.TIMED_OUT
        (scheduled,) = [r for r in local.list_runs(workflow="parent")]
        # Started by the sweeper at its fire time: the workflow's 600 s count from then.
        assert scheduled.deadline_at == T0 + timedelta(seconds=3600 + 600)


def test_a_timed_out_run_is_redriven_like_a_failed_one(local: Ductor) -> None:
    with testing.harness(local, start_at=T0) as h:
        stub = h.stub("dl.slow", hangs=True)
        handle = h.start("report", deadline=60)
        h.advance(seconds=60)
        assert h.get(handle).status == RunStatus.TIMED_OUT
        h.unstub(stub.name)
        local.redrive(handle.run_id)
        h.run(handle)
        # Its deadline has passed: the redrive drops it (or the run would time out again in
        # the redrive's own tick), and the cancelled node runs again.
        view = h.get(handle)
        assert view.status == RunStatus.SUCCEEDED
        assert view.deadline_at is None


@pytest.fixture(params=["sqlite", "postgresql"])
def ductor(request: pytest.FixtureRequest, tmp_path: Path) -> Ductor:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/deadline.sqlite3"
        upgrade(url)
    else:
        url = request.getfixturevalue("database_url")
    return _make(url, f"dlboth{id(request)}")


def _rows(d: Ductor) -> tuple[int, int]:
    with d.runtime.engine().connect() as conn:
        runs = conn.execute(sa.select(sa.func.count()).select_from(workflow_run)).scalar_one()
        controls = conn.execute(
            sa.select(sa.func.count()).select_from(workflow_control)
        ).scalar_one()
    return int(runs), int(controls)


def test_a_short_deadline_times_the_run_out_on_the_database_clock(ductor: Ductor) -> None:
    before = datetime.now(UTC)
    handle = ductor.start("report", deadline=0.5)
    view = ductor.get(handle.run_id)
    assert view.deadline_at is not None
    assert before < view.deadline_at < before + timedelta(seconds=5)
    assert run_tick(ductor.runtime, handle.run_id) == "committed"
    assert ductor.get(handle.run_id).status == RunStatus.RUNNING
    time.sleep(0.6)
    assert run_tick(ductor.runtime, handle.run_id) == "committed"
    view = ductor.get(handle.run_id)
    assert view.status == RunStatus.TIMED_OUT
    assert view.nodes["a"].status == NodeStatus.CANCELLED


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (0, ValueError, "in the past"),
        (-30, ValueError, "in the past"),
        (float("inf"), ValueError, "finite"),
        (float("nan"), ValueError, "finite"),
        ("1h", TypeError, "number of seconds"),
        (True, TypeError, "number of seconds"),
    ],
)
def test_a_bad_deadline_is_refused_and_writes_nothing(
    ductor: Ductor, bad: Any, error: type[Exception], match: str
) -> None:
    before = _rows(ductor)
    with pytest.raises(error, match=match):
        ductor.start("report", deadline=bad)
    assert _rows(ductor) == before


def test_start_with_a_deadline_at_the_command_line(ductor: Ductor) -> None:
    import json
    from types import SimpleNamespace

    from click.testing import CliRunner

    from ductor_celery.cli import ductor as ductor_cli

    ductor.runtime.dispatcher.wake = lambda run_id: None  # type: ignore[method-assign]
    ductor.runtime.dispatcher.first_tick = lambda run_id: None  # type: ignore[method-assign]

    def cli(*args: str) -> Any:
        return CliRunner().invoke(ductor_cli, list(args), obj=SimpleNamespace(app=ductor.app))

    result = cli("start", "report", "--deadline", "3600")
    assert result.exit_code == 0, result.output
    view = ductor.get(json.loads(result.output)["run_id"])
    assert view.deadline_at is not None
    before = _rows(ductor)
    refused = cli("start", "report", "--deadline", "0")
    assert refused.exit_code == 1 and "in the past" in refused.output
    assert _rows(ductor) == before
