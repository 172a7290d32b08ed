"""Issue 14 items 4, 9, 10 at the command line: schedules, prune, start --delay and bulk
controls (the count first, action only with --yes). Errors are one line, exit 1, nothing
written."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import sqlalchemy as sa
from celery import Celery
from click.testing import CliRunner, Result

from ductor_celery import Ductor, RunStatus, Workflow
from ductor_celery.cli import ductor as ductor_cli
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store.migrate import upgrade
from ductor_celery.store.schema import workflow_control, workflow_run, workflow_schedule


@pytest.fixture(params=["sqlite", "postgresql"])
def d(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ductor]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/cli.sqlite3"
        upgrade(url)
    else:
        url = request.getfixturevalue("database_url")
    app = Celery(f"cli{id(request)}", broker="memory://", set_as_current=False)
    found = Ductor(app, database_url=url)
    for name in ("report", "other"):
        wf = Workflow(name)
        wf.wait_signal("hold", signal="go")
        found.register(wf)
    found.runtime.dispatcher.wake = lambda run_id: None  # type: ignore[method-assign]
    found.runtime.dispatcher.first_tick = lambda run_id: None  # type: ignore[method-assign]
    yield found


def cli(d: Ductor, *args: str) -> Result:
    return CliRunner().invoke(ductor_cli, list(args), obj=SimpleNamespace(app=d.app))


def _count(d: Ductor, table: sa.Table) -> int:
    with d.runtime.engine().connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def _one_line_error(result: Result, words: str) -> None:
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], lines


def test_schedule_commands(d: Ductor) -> None:
    added = cli(
        d,
        "schedule",
        "add",
        "nightly",
        "--workflow",
        "report",
        "--cron",
        "0 2 * * *",
        "--timezone",
        "Europe/Paris",
        "--input",
        '{"day": 1}',
        "--overlap",
        "buffer_one",
    )
    assert added.exit_code == 0, added.output
    assert json.loads(added.output)["overlap"] == "buffer_one"
    assert (
        cli(d, "schedule", "add", "often", "--workflow", "report", "--every", "5m").exit_code == 0
    )
    listed = cli(d, "schedules", "--json")
    views = [json.loads(line) for line in listed.output.splitlines()]
    assert [(v["name"], v["every"]) for v in views] == [("nightly", None), ("often", 300.0)]
    assert all(v["next_fire_at"] for v in views)
    assert "nightly" in cli(d, "schedules").output
    assert cli(d, "schedule", "pause", "often").output.strip() == "schedule often paused"
    assert "paused" in cli(d, "schedules").output
    assert cli(d, "schedule", "resume", "often").exit_code == 0
    triggered = cli(d, "schedule", "trigger", "often")
    assert triggered.exit_code == 0, triggered.output
    ids = json.loads(triggered.output)
    assert ids["workflow_id"].startswith("often@")
    assert d.get(ids["run_id"]).status == RunStatus.PENDING
    assert cli(d, "schedule", "remove", "often").exit_code == 0
    assert [s.name for s in d.list_schedules()] == ["nightly"]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--cron", "nope"), "bad cron expression"),
        (("--cron", "0 2 * * *", "--timezone", "Nowhere/Land"), "unknown time zone"),
        (("--every", "0.5"), "at least 1 second"),
        (("--every", "soon"), "--every must be a duration"),
        (("--every", "60", "--overlap", "stack"), "unknown overlap policy"),
        (("--every", "60", "--input", "{bad"), "--input is not valid JSON"),
        ((), "exactly one of cron= or every="),
    ],
)
def test_bad_schedule_add_is_one_line_and_writes_nothing(
    d: Ductor, args: tuple[str, ...], words: str
) -> None:
    result = cli(d, "schedule", "add", "bad", "--workflow", "report", *args)
    _one_line_error(result, words)
    assert _count(d, workflow_schedule) == 0


def test_schedule_actions_on_an_unknown_name_fail(d: Ductor) -> None:
    for verb in ("remove", "pause", "resume", "trigger"):
        _one_line_error(cli(d, "schedule", verb, "ghost"), "no schedule named 'ghost'")


def test_start_with_a_delay(d: Ductor) -> None:
    result = cli(d, "start", "report", "--delay", "600")
    assert result.exit_code == 0, result.output
    view = d.get(json.loads(result.output)["run_id"])
    assert view.status == RunStatus.PENDING and view.start_at is not None
    before = _count(d, workflow_run)
    _one_line_error(cli(d, "start", "report", "--delay", "-5"), "delay must be >= 0")
    assert _count(d, workflow_run) == before


def test_prune_command(d: Ductor) -> None:
    run_id = d.start("report").run_id
    d.terminate(run_id)
    run_tick(d.runtime, run_id)
    with d.runtime.engine().begin() as conn:
        conn.execute(
            sa.update(workflow_run)
            .where(workflow_run.c.run_id == run_id)
            .values(finished_at=sa.func.now() - timedelta(days=40))
        )
    dry = cli(d, "prune", "--older-than", "30d", "--dry-run")
    assert dry.output.strip() == "1 runs would be deleted"
    assert cli(d, "prune", "--older-than", "30d", "--status", "failed").output.strip() == (
        "0 runs deleted"
    )
    _one_line_error(cli(d, "prune", "--older-than", "30d", "--status", "running"), "only finished")
    _one_line_error(cli(d, "prune", "--older-than", "a while"), "--older-than must be a duration")
    assert _count(d, workflow_run) == 1
    assert cli(d, "prune", "--older-than", "30d").output.strip() == "1 runs deleted"
    assert _count(d, workflow_run) == 0


def _start(d: Ductor, workflow: str, n: int) -> list[str]:
    ids = [d.start(workflow).run_id for _ in range(n)]
    for run_id in ids:
        run_tick(d.runtime, run_id)
    return ids


def test_bulk_controls_count_first_and_act_with_yes(d: Ductor) -> None:
    reports = _start(d, "report", 3)
    others = _start(d, "other", 2)
    counted = cli(d, "cancel", "--workflow", "report", "--status", "running")
    assert counted.exit_code == 0, counted.output
    assert counted.output.strip() == "3 runs match; nothing done (add --yes to cancel them)"
    assert _count(d, workflow_control) == 0, "without --yes nothing is written"
    done = cli(
        d,
        "cancel",
        "--workflow",
        "report",
        "--status",
        "running",
        "--limit",
        "2",
        "--reason",
        "cleanup",
        "--yes",
    )
    assert done.exit_code == 0, done.output
    assert done.output.strip() == "cancel requested for 2 of 2 runs"
    for run_id in reports + others:
        run_tick(d.runtime, run_id)
    assert sorted(d.get(r).status.value for r in reports) == ["cancelled", "cancelled", "running"]
    assert [d.get(r).status for r in others] == ["running", "running"]
    paused = cli(d, "pause", "--status", "running", "--since", "1h", "--yes")
    assert paused.output.strip() == "pause requested for 3 of 3 runs"
    for run_id in reports + others:
        run_tick(d.runtime, run_id)
    assert cli(d, "resume", "--workflow", "other", "--yes").output.strip() == (
        "resume requested for 2 of 2 runs"
    )
    redriven = cli(d, "redrive", "--workflow", "report", "--status", "cancelled", "--yes")
    assert redriven.output.strip() == "redrive requested for 2 of 2 runs"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("cancel",), "give a TARGET, or --workflow/--status"),
        (("cancel", "some-run", "--status", "running"), "not both"),
        (("cancel", "--status", "succeeded", "--yes"), "cannot cancel succeeded runs"),
        (("resume", "--status", "running", "--yes"), "cannot resume running runs"),
        (("cancel", "--status", "sleepy", "--yes"), "unknown run status"),
        (("cancel", "--workflow", "report", "--limit", "0", "--yes"), "limit must be between"),
        (("cancel", "--workflow", "report", "--since", "yesterday"), "--since must be"),
        (("cancel", "some-run", "--yes"), "--yes goes with"),
    ],
)
def test_bad_bulk_controls_are_one_line_and_write_nothing(
    d: Ductor, args: tuple[str, ...], words: str
) -> None:
    _start(d, "report", 1)
    _one_line_error(cli(d, *args), words)
    assert _count(d, workflow_control) == 0
