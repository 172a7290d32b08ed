"""``list_runs`` pages: newest first, filters by time and workflow id, a keyset cursor that
walks every run exactly once, and ``ductor runs`` printing the next cursor, on SQLite and
PostgreSQL alike."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from click.testing import CliRunner

from ductor_celery import Ductor, RunPage, Workflow
from ductor_celery.cli import ductor as ductor_cli
from ductor_celery.store.migrate import upgrade

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/pages.sqlite3"
        upgrade(url)
        return url
    found: str = request.getfixturevalue("database_url")
    return found


@pytest.fixture
def ductor(db_url: str) -> Ductor:
    app = Celery(f"pages{id(db_url)}", broker="memory://", set_as_current=False)
    d = Ductor(app, database_url=db_url)
    for name in ("alpha", "beta"):
        wf = Workflow(name)
        wf.approval("ok")
        d.register(wf)
    return d


def _started(d: Ductor, count: int, *, same_time: int = 0) -> list[str]:
    """Start ``count`` runs, run i created at T0 + i minutes (the first ``same_time`` of them
    all at T0, to exercise the run_id tie-break); returns their run ids, oldest first."""
    ids = []
    for i in range(count):
        h = d.start("alpha" if i % 2 == 0 else "beta", workflow_id=f"wf-{i}")
        at = T0 if i < same_time else T0 + timedelta(minutes=i)
        with d.client.engine.begin() as conn:
            conn.execute(
                sa.text("UPDATE eec_workflow_run SET created_at = :at WHERE run_id = :r"),
                {"at": at, "r": h.run_id},
            )
        ids.append(h.run_id)
    return ids


def _walk(d: Ductor, **filters: Any) -> list[list[str]]:
    pages, cursor = [], None
    while True:
        page = d.list_runs(cursor=cursor, **filters)
        assert isinstance(page, RunPage)
        pages.append([v.run_id for v in page])
        cursor = page.next_cursor
        if cursor is None:
            return pages


def test_pages_walk_every_run_once_newest_first(ductor: Ductor) -> None:
    ids = _started(ductor, 11, same_time=4)
    created = {v.run_id: (v.created_at, v.run_id) for v in ductor.list_runs(limit=1000)}
    newest_first = sorted(ids, key=lambda r: created[r], reverse=True)
    pages = _walk(ductor, limit=3)
    assert [len(p) for p in pages] == [3, 3, 3, 2]
    assert [r for p in pages for r in p] == newest_first
    # Exactly a page's worth left: the last full page says so, no empty page after it.
    assert [len(p) for p in _walk(ductor, limit=11)] == [11]


def test_a_run_started_meanwhile_does_not_shift_later_pages(ductor: Ductor) -> None:
    ids = _started(ductor, 6)
    first = ductor.list_runs(limit=2)
    assert [v.run_id for v in first] == ids[:-3:-1]
    ductor.start("alpha", workflow_id="late")  # newer than all: belongs before page one
    second = ductor.list_runs(limit=2, cursor=first.next_cursor)
    assert [v.run_id for v in second] == [ids[3], ids[2]]


def test_since_until_workflow_and_workflow_id_filter(ductor: Ductor) -> None:
    ids = _started(ductor, 8)
    window = ductor.list_runs(since=T0 + timedelta(minutes=2), until=T0 + timedelta(minutes=5))
    assert [v.run_id for v in window] == [ids[4], ids[3], ids[2]]  # since inclusive, until not
    iso = ductor.list_runs(since="2026-03-01T12:06:00+00:00")
    assert [v.run_id for v in iso] == [ids[7], ids[6]]
    betas = _walk(ductor, workflow="beta", limit=2)
    assert [r for p in betas for r in p] == [ids[7], ids[5], ids[3], ids[1]]
    assert [v.run_id for v in ductor.list_runs(workflow_id="wf-3")] == [ids[3]]
    assert ductor.list_runs(workflow_id="nope") == []
    assert ductor.list_runs(workflow="alpha", status="succeeded").next_cursor is None


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"since": datetime(2026, 1, 1)}, ValueError, "no time zone"),  # noqa: DTZ001
        ({"since": "yesterday"}, ValueError, "not an ISO 8601 time"),
        ({"until": 5}, TypeError, "until must be a datetime"),
        ({"since": T0, "until": T0 - timedelta(seconds=1)}, ValueError, "is after until"),
        ({"cursor": "bm90IGEgY3Vyc29y"}, ValueError, "not a cursor that list_runs returned"),
        ({"cursor": "%%%"}, ValueError, "not a cursor"),
        ({"cursor": 3}, TypeError, "cursor must be a string"),
        ({"workflow_id": ""}, ValueError, "workflow_id must not be empty"),
    ],
)
def test_bad_arguments_are_refused_naming_them(
    ductor: Ductor, kwargs: dict[str, Any], error: type[Exception], needle: str
) -> None:
    with pytest.raises(error, match=needle):
        ductor.list_runs(**kwargs)


def test_ductor_runs_pages_with_the_printed_cursor(ductor: Ductor) -> None:
    ids = _started(ductor, 5)

    def cli(*args: str) -> Any:
        return CliRunner().invoke(ductor_cli, ["runs", *args], obj=SimpleNamespace(app=ductor.app))

    first = cli("--limit", "3", "--json")
    assert first.exit_code == 0, first.output
    lines = first.stdout.splitlines()
    assert len(lines) == 3 and ids[4] in lines[0]
    cursor = first.stderr.split("next cursor: ", 1)[1].split()[0]
    rest = cli("--limit", "3", "--json", "--cursor", cursor)
    assert rest.exit_code == 0 and ids[1] in rest.stdout and ids[0] in rest.stdout
    assert "next cursor" not in rest.stderr
    table = cli("--limit", "2", "--since", "2026-03-01T12:01:00Z", "--until", "2026-03-01 12:04")
    assert table.exit_code == 0 and "next cursor: " in table.stdout
    bad = cli("--since", "soon")
    assert bad.exit_code == 1 and "--since 'soon' is neither" in bad.stderr
    bad_cursor = cli("--cursor", "xyz")
    assert bad_cursor.exit_code == 1 and "not a cursor" in bad_cursor.stderr
