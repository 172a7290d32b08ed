"""Issue 23: every action named, an audit log. On the embedded SQLite as on PostgreSQL: an entry
per action and per source (api, cli, bulk, schedule, parent; the console's ``web`` is tested
with the console), written in the transaction of what it records, none for a refused control;
``audit()`` filters and pages; ``ductor audit``; prune and the audit retention."""

from __future__ import annotations

import getpass
import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from click.testing import CliRunner

from ductor_celery import AuditPage, Ductor, InvalidOperation, RunNotFound, Workflow
from ductor_celery.cli import ductor as ductor_cli
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store import audit as audit_rows
from ductor_celery.store import schedules as schedule_rows
from ductor_celery.store.external import insert_control
from ductor_celery.store.schema import audit as audit_table


@pytest.fixture(params=["sqlite", "postgresql"])
def d(request: pytest.FixtureRequest, tmp_path: Path) -> Ductor:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/audit.sqlite3"
    else:
        url = request.getfixturevalue("database_url")
    app = Celery(f"audit{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    found = Ductor(app, database_url=url)
    if request.param == "sqlite":
        found.migrate()
    for attr in ("send", "wake", "first_tick", "wake_many"):  # nothing consumes; we tick
        setattr(found.runtime.dispatcher, attr, lambda *_: None)
    held = Workflow("held")
    held.wait_signal("hold", signal="go")
    held.approval("ok", after=["hold"])
    found.register(held)
    kid = Workflow("kid")
    kid.wait_signal("hold", signal="go")
    found.register(kid)
    parent = Workflow("parent")
    parent.subworkflow("child", workflow="kid", parent_close="terminate")
    found.register(parent)
    return found


def _entries(d: Ductor, target: str | None = None, **filters: Any) -> list[tuple[Any, ...]]:
    """(actor, action, source, node) of the entries, oldest first."""
    page = d.audit(target, limit=1000, **filters)
    return [(e.actor, e.action, e.source, e.node) for e in reversed(page.entries)]


def _cli(d: Ductor, *args: str) -> Any:
    return CliRunner().invoke(ductor_cli, list(args), obj=SimpleNamespace(app=d.app))


def test_every_action_from_python_is_recorded_with_its_actor(d: Ductor) -> None:
    handle = d.start("held", workflow_id="w", by="alice")
    d.pause("w", reason="a look", by="bob")
    d.resume("w", by="bob")
    d.signal("w", "go", {"n": 1}, idempotency_key="k-1", by="carol")
    d.signal("w", "go", {"n": 1}, idempotency_key="k-1", by="carol")  # a repeat: no entry
    run_tick(d.runtime, handle.run_id)
    d.approve("w", "ok", by="dana", comment="fine")
    run_tick(d.runtime, handle.run_id)
    assert d.get("w").status == "succeeded"
    d.redrive("w", from_node="ok", by="erin")
    d.terminate("w", reason="stop", by="erin")
    assert _entries(d, "w") == [
        ("alice", "start", "api", None),
        ("bob", "pause", "api", None),
        ("bob", "resume", "api", None),
        ("carol", "signal", "api", None),
        ("dana", "approve", "api", "ok"),
        ("erin", "redrive", "api", "ok"),
        ("erin", "terminate", "api", None),
    ]
    entries = d.audit("w").entries
    assert entries[-2].detail == {"reason": "a look"}
    assert entries[-4].detail == {"signal": "go", "idempotency_key": "k-1"}
    assert all(e.run_id == handle.run_id and e.workflow_id == "w" for e in entries)
    assert entries[0].at >= entries[-1].at


def test_a_refused_control_writes_no_entry(d: Ductor) -> None:
    run_id = d.start("held", workflow_id="w").run_id
    with pytest.raises(InvalidOperation):
        d.resume("w", by="mallory")  # refused before anything is written
    # Refused when its tick gets to it: another caller's cancel was queued ahead of it.
    insert_control(d.runtime.engine(), run_id=run_id, kind="cancel", requested_by="other")
    with pytest.raises(InvalidOperation, match="run is cancelled"):
        d.pause("w", by="mallory")
    assert [e[:2] for e in _entries(d, "w")] == [(None, "start"), ("other", "cancel")]


def test_a_controls_entry_is_written_by_the_tick_that_applies_it(d: Ductor) -> None:
    run_id = d.start("held", workflow_id="w").run_id
    insert_control(d.runtime.engine(), run_id=run_id, kind="pause", requested_by="queued")
    assert [e[1] for e in _entries(d, "w")] == ["start"]  # queued, not applied: no entry
    run_tick(d.runtime, run_id)
    assert _entries(d, "w")[-1] == ("queued", "pause", "api", None)


def test_the_command_line_records_its_user_and_bulk_controls_their_source(d: Ductor) -> None:
    for i in range(3):
        run_tick(d.runtime, d.start("held", workflow_id=f"b-{i}").run_id)
    started = _cli(d, "start", "held", "--workflow-id", "c-1", "--by", "ops-bot")
    assert started.exit_code == 0, started.output
    paused = _cli(d, "pause", "c-1")  # --by defaults to the operating-system user
    assert paused.exit_code == 0, paused.output
    bulk = _cli(d, "cancel", "--workflow", "held", "--status", "running", "--yes", "--by", "sre")
    assert bulk.exit_code == 0, bulk.output
    assert _entries(d, "c-1") == [
        ("ops-bot", "start", "cli", None),
        (getpass.getuser(), "pause", "cli", None),
    ]
    cancels = _entries(d, action="cancel")
    assert sorted(cancels) == [("sre", "cancel", "bulk", None)] * 3  # b-0..2; c-1 is paused
    shown = _cli(d, "audit", "c-1", "--json")
    assert shown.exit_code == 0, shown.output
    lines = [json.loads(line) for line in shown.output.splitlines()]
    assert [(e["action"], e["source"]) for e in lines] == [("pause", "cli"), ("start", "cli")]
    table = _cli(d, "audit", "--actor", "sre")
    assert table.exit_code == 0 and "bulk" in table.output
    bad = _cli(d, "audit", "--action", "explode")
    assert bad.exit_code == 1 and "unknown audit action 'explode'" in bad.output


def test_schedules_and_their_fires_are_recorded(d: Ductor) -> None:
    d.schedule("nightly", workflow="held", every=60, by="planner")
    engine = d.runtime.engine()
    with engine.begin() as conn:  # due now, as the sweeper would find it
        conn.execute(
            sa.text("UPDATE eec_workflow_schedule SET next_fire_at = :t"),
            {"t": datetime.now(UTC) - timedelta(seconds=1)},
        )
    started = schedule_rows.fire_due(engine).started
    assert len(started) == 1
    d.unschedule("nightly", by="planner")
    rows = _entries(d)
    assert ("planner", "schedule", "api", None) in rows
    assert ("planner", "unschedule", "api", None) in rows
    assert ("nightly", "start", "schedule", None) in rows
    fired = d.audit(action="start").entries[0]
    assert fired.run_id == started[0] and fired.workflow_id.startswith("nightly@")


def test_a_parent_records_its_child_and_its_parent_close(d: Ductor) -> None:
    parent = d.start("parent", workflow_id="p", by="alice")
    run_tick(d.runtime, parent.run_id)
    [child] = [e for e in d.audit(action="start").entries if e.source == "parent"]
    assert child.actor == f"parent:{parent.run_id}" and child.node == "child"
    run_tick(d.runtime, child.run_id)
    d.terminate("p", by="bob")
    run_tick(d.runtime, child.run_id)  # the parent's control, applied by the child's tick
    assert d.get(child.run_id).status == "terminated"
    assert _entries(d, child.run_id)[-1] == (
        f"parent:{parent.run_id}",
        "terminate",
        "parent",
        None,
    )


def test_filters_pages_and_bad_arguments(d: Ductor) -> None:
    for i in range(5):
        d.start("held", workflow_id=f"w-{i}", by="a" if i % 2 else "b")
    first = d.audit(limit=2)
    assert isinstance(first, AuditPage) and len(first) == 2 and first.next_cursor
    second = d.audit(limit=2, cursor=first.next_cursor)
    third = d.audit(limit=2, cursor=second.next_cursor)
    ids = [e.workflow_id for page in (first, second, third) for e in page]
    assert ids == [f"w-{i}" for i in (4, 3, 2, 1, 0)] and third.next_cursor is None
    assert [e.workflow_id for e in d.audit(actor="a")] == ["w-3", "w-1"]
    assert len(d.audit(action="start", since=datetime.now(UTC) + timedelta(hours=1))) == 0
    with pytest.raises(RunNotFound):
        d.audit("no-such-run")
    with pytest.raises(ValueError, match="unknown audit action"):
        d.audit(action="explode")
    with pytest.raises(ValueError, match="not a cursor that audit"):
        d.audit(cursor="zzz")
    with pytest.raises(ValueError, match="limit"):
        d.audit(limit=0)
    with pytest.raises(ValueError, match="by"):
        d.pause("w-0", by="")


def test_prune_takes_a_runs_entries_but_keeps_bulk_ones_and_its_own(d: Ductor) -> None:
    d.start("held", workflow_id="gone", by="alice")
    bulked = d.start("held", workflow_id="bulked").run_id
    run_tick(d.runtime, bulked)
    d.cancel("gone", by="alice")
    result = _cli(d, "cancel", "--workflow", "held", "--status", "running", "--yes", "--by", "sre")
    assert result.exit_code == 0, result.output
    assert d.get("bulked").status == "cancelled"
    engine = d.runtime.engine()
    with engine.begin() as conn:  # both finished long ago
        conn.execute(
            sa.text("UPDATE eec_workflow_run SET finished_at = :t"),
            {"t": datetime.now(UTC) - timedelta(days=40)},
        )
    assert d.prune(older_than=timedelta(days=30), by="janitor") == 2
    rows = _entries(d)
    assert ("alice", "start", "api", None) not in rows  # went with its run
    assert ("sre", "cancel", "bulk", None) in rows  # kept past its run
    assert ("janitor", "prune", "api", None) in rows
    prune_entry = d.audit(action="prune").entries[0]
    assert prune_entry.detail["runs"] == 2 and prune_entry.run_id is None
    assert bulked not in {e.run_id for e in d.audit(action="start")}

    with engine.begin() as conn:
        conn.execute(sa.update(audit_table).values(at=datetime.now(UTC) - timedelta(days=400)))
    assert audit_rows.delete_older_than(engine, datetime.now(UTC) - timedelta(days=365)) >= 2
    assert len(d.audit()) == 0


def test_the_console_records_the_acting_tokens_name_and_shows_the_runs_entries(d: Ductor) -> None:
    from starlette.testclient import TestClient

    from ductor_celery.web import create_app

    run_id = d.start("held", workflow_id="w", by="alice").run_id
    tokens = {"ops-alice": {"secret": "s3cret-token-value", "role": "operator"}}
    app = create_app(d, tokens=tokens, allowed_hosts=["testserver"])
    with TestClient(app) as console:
        bearer = {"Authorization": "Bearer s3cret-token-value"}
        answer = console.post(f"/api/runs/{run_id}/pause", json={"reason": "look"}, headers=bearer)
        assert answer.status_code == 200, answer.text
        answer = console.post(
            f"/api/runs/{run_id}/signal", json={"name": "go", "payload": 1}, headers=bearer
        )
        assert answer.status_code == 200, answer.text
        refused = console.post(f"/api/runs/{run_id}/pause", json={}, headers=bearer)
        assert refused.status_code == 409  # paused already: no entry
        page = console.get(f"/runs/{run_id}")
    assert _entries(d, "w")[1:] == [
        ("ops-alice", "pause", "web", None),
        ("ops-alice", "signal", "web", None),
    ]
    assert page.status_code == 200
    assert page.text.count('data-audit-action="') == 3 and "ops-alice" in page.text
