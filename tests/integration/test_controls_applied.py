"""Issue 23, item 2: every control is applied, or refused with ``InvalidOperation``, before the
call returns. ``pause()`` returned before the pause was applied; a ``resume()`` right after it
was refused (the run was still running), then the pause applied and the run stayed paused for
good. Here no worker and no coordinator run at all: whatever a control does, its caller's
process did it before the call returned."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from celery import Celery

from ductor_celery import Ductor, InvalidOperation, RunStatus, StepContext, Workflow
from ductor_celery.store.external import insert_control
from ductor_celery.store.schema import workflow_control


@pytest.fixture(params=["sqlite", "postgresql"])
def d(request: pytest.FixtureRequest, tmp_path: Path) -> Ductor:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/controls.sqlite3"
    else:
        url = request.getfixturevalue("database_url")
    app = Celery(f"applied{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    found = Ductor(app, database_url=url)
    if request.param == "sqlite":
        found.migrate()
    # No broker: nothing that is sent is ever consumed, so only this process applies anything.
    found.runtime.dispatcher.send = lambda rows: None  # type: ignore[method-assign]
    found.runtime.dispatcher.wake = lambda run_id: None  # type: ignore[method-assign]
    found.runtime.dispatcher.first_tick = lambda run_id: None  # type: ignore[method-assign]

    @found.step(name="applied.work")
    def work(ctx: StepContext) -> int:
        return 1

    wf = Workflow("held")
    wf.wait_signal("hold", signal="go")
    wf.step("after", work, after=["hold"])
    wf.output({"hold": "$.nodes.hold.output"})
    found.register(wf)
    return found


def _unhandled(d: Ductor) -> int:
    with d.runtime.engine().connect() as conn:
        query = sa.select(sa.func.count()).where(workflow_control.c.handled_at.is_(None))
        return int(conn.execute(query).scalar_one())


def test_each_control_shows_its_effect_when_the_call_returns(d: Ductor) -> None:
    run_id = d.start("held", workflow_id="w").run_id
    d.pause("w")  # a pending run's first tick and the pause, both here
    assert d.get("w").status == RunStatus.PAUSED
    d.resume("w")  # refused before: "it is running (allowed when paused)"
    assert d.get("w").status == RunStatus.RUNNING
    d.pause("w")
    d.resume("w")
    d.cancel("w", reason="enough")
    view = d.get("w")
    assert view.status == RunStatus.CANCELLED and view.error["message"] == "cancel: enough"
    d.redrive("w")
    assert d.get("w").status == RunStatus.RUNNING
    d.terminate("w")
    assert d.get("w").status == RunStatus.TERMINATED
    d.redrive("w")
    d.continue_as_new("w")
    first = d.get(run_id)
    assert first.status == RunStatus.CONTINUED and first.continued_to is not None
    assert d.get("w").run_id == first.continued_to
    assert _unhandled(d) == 0


def test_a_control_the_run_refuses_when_it_gets_to_it_raises(d: Ductor) -> None:
    """Another caller's cancel is queued ahead (inserted, not applied yet): the run is still
    running when pause() checks it, and cancelled by the time the pause is drained."""
    run_id = d.start("held", workflow_id="w").run_id
    insert_control(d.runtime.engine(), run_id=run_id, kind="cancel", reason="elsewhere")
    with pytest.raises(InvalidOperation, match=f"cannot pause run {run_id}: run is cancelled"):
        d.pause("w")
    assert d.get("w").status == RunStatus.CANCELLED
    assert _unhandled(d) == 0


def test_a_pause_and_a_resume_in_a_row_from_two_clients_leave_the_run_running(d: Ductor) -> None:
    app = Celery(f"other{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    other = Ductor(app, database_url=d.settings.database_url)  # another process, same database
    other.runtime.dispatcher.send = lambda rows: None  # type: ignore[method-assign]
    d.start("held", workflow_id="w")
    for _ in range(5):
        d.pause("w")
        other.resume("w")
        assert d.get("w").status == RunStatus.RUNNING
    assert _unhandled(d) == 0
