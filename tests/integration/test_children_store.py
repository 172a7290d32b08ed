"""Child runs in the store: the parent's commit inserts the child and wakes it; a recomputed
tick never starts two; a child's commit wakes its parent; parent-close writes child controls."""

from __future__ import annotations

import time
from typing import Any

import pytest
import sqlalchemy as sa
from support import CONFIG, FakeStep, commit_tick, load_tick, tick_once

from ductor_celery.definition import Workflow
from ductor_celery.engine import compute_tick
from ductor_celery.store import runs
from ductor_celery.store.db import get_engine
from ductor_celery.store.outbox import OutboxRow


def _specs() -> tuple[Any, Any]:
    child = Workflow("kid")
    child.step("a", FakeStep())
    child.checkpoint("cp", after=["a"])
    child_spec = child.build()
    parent = Workflow("mom")
    parent.subworkflow("sub", workflow="kid", input={"v": "$.input.x"}, until="cp")
    return parent.build(None, {"kid": child_spec}.get), child_spec


@pytest.fixture
def engine(database_url: str) -> Any:
    return get_engine(database_url)


def _tick(engine: Any, specs: dict[str, Any], run_id: str) -> list[OutboxRow]:
    return tick_once(engine, run_id, specs.__getitem__)


def test_the_parent_commit_inserts_and_wakes_the_child_once(engine: Any) -> None:
    parent, child = _specs()
    specs = {parent.spec_hash: parent, child.spec_hash: child}
    for spec in (child, parent):
        runs.save_definition(engine, spec)
    runs.insert_run(engine, run_id="p1", workflow_id="order-1", spec=parent, input={"x": 5})
    sent = _tick(engine, specs, "p1")
    kids = [r.run_id for r in sent if r.kind == "wakeup"]
    assert len(kids) == 1, sent
    with engine.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT workflow_id, parent_run_id, parent_node, input, state "
                "FROM eec_workflow_run WHERE run_id = :r"
            ),
            {"r": kids[0]},
        ).one()
    assert (row.workflow_id, row.parent_run_id, row.parent_node) == ("order-1/sub", "p1", "sub")
    assert row.input == {"v": 5}
    assert set(row.state["nodes"]) == {"a", "cp"}
    # the child ticks: its step starts; finishing it passes the checkpoint, which wakes p1
    from ductor_celery.store import attempts

    [step] = [r for r in _tick(engine, specs, kids[0]) if r.kind == "step"]
    attempts.claim(engine, step.payload["token"], "w")
    attempts.finish(engine, step.payload["token"], outcome="succeeded", output=1)
    woke = _tick(engine, specs, kids[0])
    assert [r.run_id for r in woke if r.kind == "wakeup"] == ["p1"]
    _tick(engine, specs, "p1")
    with engine.connect() as conn:
        state = conn.execute(
            sa.text("SELECT state FROM eec_workflow_run WHERE run_id = 'p1'")
        ).scalar_one()
    assert state["nodes"]["sub"]["status"] == "succeeded"
    assert state["status"] == "succeeded"


def test_a_recomputed_parent_tick_never_starts_a_second_child(engine: Any) -> None:
    parent, child = _specs()
    specs = {parent.spec_hash: parent, child.spec_hash: child}
    for spec in (child, parent):
        runs.save_definition(engine, spec)
    runs.insert_run(engine, run_id="p2", workflow_id="order-2", spec=parent, input={"x": 1})
    loaded, spec, inputs = load_tick(engine, "p2", specs.__getitem__, CONFIG)  # type: ignore[misc]
    payload = compute_tick(spec, loaded.state, inputs, loaded.now)
    commit_tick(engine, loaded, payload)
    # the same decision committed again (as if the first answer was lost): the version check
    # refuses it, and a fresh tick from the new state starts nothing either
    from ductor_celery.store.ticks import VersionConflict

    with pytest.raises(VersionConflict):
        commit_tick(engine, loaded, payload)
    assert _tick(engine, specs, "p2") == []
    with engine.connect() as conn:
        count = conn.execute(
            sa.text("SELECT count(*) FROM eec_workflow_run WHERE parent_run_id = 'p2'")
        ).scalar_one()
    assert count == 1


def test_cancelling_the_parent_writes_a_control_for_the_open_child(engine: Any) -> None:
    parent, child = _specs()
    specs = {parent.spec_hash: parent, child.spec_hash: child}
    for spec in (child, parent):
        runs.save_definition(engine, spec)
    runs.insert_run(engine, run_id="p3", workflow_id="order-3", spec=parent, input={"x": 1})
    [kid] = [r.run_id for r in _tick(engine, specs, "p3") if r.kind == "wakeup"]
    _tick(engine, specs, kid)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO eec_workflow_control (run_id, kind, has_input, created_at) "
                "VALUES ('p3', 'terminate', false, now())"
            )
        )
    sent = _tick(engine, specs, "p3")
    assert kid in [r.run_id for r in sent if r.kind == "wakeup"]
    with engine.connect() as conn:
        control = conn.execute(
            sa.text("SELECT kind, requested_by FROM eec_workflow_control WHERE run_id = :r"),
            {"r": kid},
        ).one()
    assert tuple(control) == ("terminate", "parent:p3")
    _tick(engine, specs, kid)
    with engine.connect() as conn:
        status = conn.execute(
            sa.text("SELECT status FROM eec_workflow_run WHERE run_id = :r"), {"r": kid}
        ).scalar_one()
    assert status == "terminated"


def test_the_sweeper_finds_a_parent_whose_child_wake_up_was_lost(engine: Any) -> None:
    from ductor_celery.store import attempts, sweep

    parent, child = _specs()
    specs = {parent.spec_hash: parent, child.spec_hash: child}
    for spec in (child, parent):
        runs.save_definition(engine, spec)
    runs.insert_run(engine, run_id="p4", workflow_id="order-4", spec=parent, input={"x": 1})
    [kid] = [r.run_id for r in _tick(engine, specs, "p4") if r.kind == "wakeup"]
    assert sweep.parents_behind_children(engine, older_than=0) == []
    [step] = [r for r in _tick(engine, specs, kid) if r.kind == "step"]
    attempts.claim(engine, step.payload["token"], "w")
    attempts.finish(engine, step.payload["token"], outcome="succeeded", output=1)
    woke = _tick(engine, specs, kid)  # passes the checkpoint: this wake-up is "lost"
    assert [r.run_id for r in woke if r.kind == "wakeup"] == ["p4"]
    assert sweep.parents_behind_children(engine, older_than=0) == ["p4"]
    assert sweep.parents_behind_children(engine, older_than=60) == [], "only once it is late"
    _tick(engine, specs, "p4")  # the parent catches up
    assert sweep.parents_behind_children(engine, older_than=0) == []


def test_a_child_whose_workflow_id_is_taken_fails_the_node_instead_of_hanging(
    engine: Any,
) -> None:
    parent, child = _specs()
    specs = {parent.spec_hash: parent, child.spec_hash: child}
    for spec in (child, parent):
        runs.save_definition(engine, spec)
    # an open run (say, a child an earlier parent abandoned) holds the child's workflow id
    runs.insert_run(engine, run_id="old", workflow_id="order-9/sub", spec=child, input={})
    runs.insert_run(engine, run_id="p9", workflow_id="order-9", spec=parent, input={"x": 1})
    sent = _tick(engine, specs, "p9")
    assert [r.run_id for r in sent if r.kind == "wakeup"] == ["p9"], "the parent looks again"
    _tick(engine, specs, "p9")
    with engine.connect() as conn:
        state = conn.execute(
            sa.text("SELECT state FROM eec_workflow_run WHERE run_id = 'p9'")
        ).scalar_one()
    assert state["status"] == "failed"
    assert "could not be started" in state["nodes"]["sub"]["error"]["message"]


def test_a_control_for_a_child_that_continues_as_new_moves_to_its_successor(
    engine: Any,
) -> None:
    _, child = _specs()
    runs.save_definition(engine, child)
    runs.insert_run(engine, run_id="k1", workflow_id="kid-1", spec=child, input={})
    with engine.begin() as conn:
        for kind in ("continue_as_new", "terminate"):
            conn.execute(
                sa.text(
                    "INSERT INTO eec_workflow_control (run_id, kind, has_input, created_at) "
                    "VALUES ('k1', :k, false, now())"
                ),
                {"k": kind},
            )
    specs = {child.spec_hash: child}
    _tick(engine, specs, "k1")  # drains continue_as_new (nothing in flight yet: continues)
    for _ in range(3):
        _tick(engine, specs, "k1")
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT run_id, kind, handled_at IS NOT NULL AS handled "
                "FROM eec_workflow_control ORDER BY id"
            )
        ).all()
        succ = conn.execute(
            sa.text("SELECT continued_to FROM eec_workflow_run WHERE run_id = 'k1'")
        ).scalar_one()
    assert succ is not None
    assert [(r.run_id, r.kind) for r in rows] == [("k1", "continue_as_new"), (succ, "terminate")]


# --- parent-close reaches a child past its checkpoint (issue 23) ----------------------------
# Through the Ductor facade on both databases: controls are applied by the call; the child's
# and parent's wake-ups are recorded (inline_support.RecordingDispatcher) and ticked by hand.

from inline_support import RecordingDispatcher, deliver, make_ductor, url  # noqa: E402

from ductor_celery import Ductor, RunStatus, StepContext  # noqa: E402
from ductor_celery.runtime.tick_task import run_tick  # noqa: E402

__all__ = ["url"]  # the fixture: PostgreSQL and SQLite


def _checkpointing(ductor: Ductor, policy: str) -> None:
    """``kid``: a step, the checkpoint ``cp``, then waits for the signal ``go``. ``mom``: waits
    for ``kid`` until ``cp`` (``parent_close=policy``), then for the signal ``hold``."""

    def label(ctx: StepContext) -> str:
        ctx.patch({"label": "L1"})
        return "L1"

    kid = Workflow("kid")
    kid.step("a", ductor.step(name="pc.label")(label))
    kid.checkpoint("cp", after=["a"])
    kid.wait_signal("go", signal="go", after=["cp"])
    ductor.register(kid)
    mom = Workflow("mom")
    mom.subworkflow("sub", workflow="kid", until="cp", parent_close=policy)
    mom.wait_signal("hold", signal="hold", after=["sub"])
    ductor.register(mom)


def _child_past_its_checkpoint(
    ductor: Ductor, recorder: RecordingDispatcher, **start: Any
) -> tuple[str, str]:
    """Start ``mom`` and drive it until its child passed ``cp`` and waits for ``go``."""
    rt = ductor.runtime
    mom = ductor.start("mom", **start).run_id
    assert run_tick(rt, mom) == "committed"
    [kid] = [r.run_id for r in recorder.rows if r.kind == "wakeup"]
    recorder.rows.clear()
    assert run_tick(rt, kid) == "committed"
    [step] = [r for r in recorder.rows if r.kind == "step"]
    recorder.rows.clear()
    deliver(ductor, step)  # "a", then the child's eager tick passes the checkpoint
    assert ductor.get(kid).nodes["cp"].status == "succeeded"
    run_tick(rt, mom)
    view = ductor.get(mom)
    assert view.nodes["sub"].status == "succeeded" and view.status == RunStatus.RUNNING
    recorder.rows.clear()
    return mom, kid


def _settle(ductor: Ductor, recorder: RecordingDispatcher) -> None:
    """Tick every run a recorded wake-up names (the parent's control to its child)."""
    for row in list(recorder.rows):
        if row.kind == "wakeup":
            run_tick(ductor.runtime, row.run_id)
    recorder.rows.clear()


@pytest.mark.parametrize(
    ("policy", "control", "child_after"),
    [
        ("terminate", "terminate", RunStatus.TERMINATED),
        ("terminate", "cancel", RunStatus.TERMINATED),
        ("cancel", "terminate", RunStatus.CANCELLED),
        ("cancel", "cancel", RunStatus.CANCELLED),
        ("abandon", "terminate", RunStatus.RUNNING),
        ("abandon", "cancel", RunStatus.RUNNING),
    ],
)
def test_stopping_a_parent_closes_its_child_past_the_checkpoint_by_the_policy(
    url: str, policy: str, control: str, child_after: RunStatus
) -> None:
    ductor, recorder = make_ductor(url)
    _checkpointing(ductor, policy)
    mom, kid = _child_past_its_checkpoint(ductor, recorder)
    getattr(ductor, control)(mom, reason="stop")
    assert ductor.get(mom).status in (RunStatus.TERMINATED, RunStatus.CANCELLED)
    _settle(ductor, recorder)
    assert ductor.get(kid).status == child_after


def test_a_parent_timing_out_closes_its_child_past_the_checkpoint(url: str) -> None:
    ductor, recorder = make_ductor(url)
    _checkpointing(ductor, "terminate")
    # The parent's deadline leaves room for the set-up (four ticks and a step) on a loaded
    # machine: with 1 s a slow set-up timed the parent out before its child passed ``cp``.
    mom, kid = _child_past_its_checkpoint(ductor, recorder, deadline=3.0)
    deadline = time.monotonic() + 15
    while ductor.get(mom).status != RunStatus.TIMED_OUT:  # the sweeper's wake-up, by hand
        assert time.monotonic() < deadline
        time.sleep(0.1)
        run_tick(ductor.runtime, mom)
    _settle(ductor, recorder)
    assert ductor.get(kid).status == RunStatus.TERMINATED


def test_a_parent_that_succeeds_leaves_its_child_past_the_checkpoint_running(url: str) -> None:
    ductor, recorder = make_ductor(url)
    _checkpointing(ductor, "terminate")
    mom, kid = _child_past_its_checkpoint(ductor, recorder)
    ductor.signal(mom, "hold")
    run_tick(ductor.runtime, mom)
    assert ductor.get(mom).status == RunStatus.SUCCEEDED
    _settle(ductor, recorder)
    assert ductor.get(kid).status == RunStatus.RUNNING
    ductor.signal(kid, "go")
    run_tick(ductor.runtime, kid)
    assert ductor.get(kid).status == RunStatus.SUCCEEDED


def test_a_child_past_its_checkpoint_that_finished_gets_no_control(url: str) -> None:
    ductor, recorder = make_ductor(url)
    _checkpointing(ductor, "terminate")
    mom, kid = _child_past_its_checkpoint(ductor, recorder)
    ductor.signal(kid, "go")
    run_tick(ductor.runtime, kid)
    assert ductor.get(kid).status == RunStatus.SUCCEEDED
    recorder.rows.clear()
    ductor.terminate(mom)
    with get_engine(url).connect() as conn:
        controls = conn.execute(
            sa.text("SELECT count(*) FROM eec_workflow_control WHERE run_id = :r"), {"r": kid}
        ).scalar_one()
    assert controls == 0
