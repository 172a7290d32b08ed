"""Run tags at the faces (docs/tags.md), on SQLite and PostgreSQL: ``GET /api/runs?tag=k:v``
(repeatable, split on the first ``:``, 400 naming a bad one), ``POST
/api/workflows/{name}/runs`` with ``tags``, the console's filter and run page (escaped), and
``ductor start/runs --tag k=v`` (one line and exit 1 for a bad one)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import sqlalchemy as sa
from celery import Celery
from click.testing import CliRunner, Result
from starlette.testclient import TestClient

from ductor_celery import Ductor, Workflow
from ductor_celery.cli import ductor as ductor_cli
from ductor_celery.store.schema import run_tag, workflow_run
from ductor_celery.web import create_app

TESTSERVER = "testserver"
TOKENS = {"otto": {"secret": "operator-secret-91bc", "role": "operator"}}
OPERATOR = {"Authorization": f"Bearer {TOKENS['otto']['secret']}"}
XSS = "<script>alert(1)</script>"


@pytest.fixture(params=["sqlite", "postgresql"])
def d(request: pytest.FixtureRequest, tmp_path: Path) -> Ductor:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/faces.sqlite3"
    else:
        url = request.getfixturevalue("database_url")
    app = Celery(f"faces{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    found = Ductor(app, database_url=url)
    if request.param == "sqlite":
        found.migrate()
    wf = Workflow("hold")
    wf.wait_signal("go", signal="go")
    found.register(wf)
    found.runtime.dispatcher.wake = lambda run_id: None  # type: ignore[method-assign]
    found.runtime.dispatcher.first_tick = lambda run_id: None  # type: ignore[method-assign]
    return found


@pytest.fixture
def api(d: Ductor) -> Iterator[TestClient]:
    with TestClient(create_app(d, tokens=TOKENS, allowed_hosts=[TESTSERVER])) as client:
        yield client


def _count(d: Ductor, table: sa.Table) -> int:
    with d.client.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def test_the_json_api_filters_on_every_tag_given(d: Ductor, api: TestClient) -> None:
    eu = d.start("hold", tags={"customer": "c-1", "region": "eu", "url": "http://x:1"})
    us = d.start("hold", tags={"customer": "c-1", "region": "us"})
    d.start("hold", tags={"customer": "c-2"})

    def ids(query: str) -> set[str]:
        answer = api.get(f"/api/runs?{query}")
        assert answer.status_code == 200, answer.text
        return {r["run_id"] for r in answer.json()["runs"]}

    assert ids("tag=customer:c-1") == {eu.run_id, us.run_id}
    assert ids("tag=customer:c-1&tag=region:eu") == {eu.run_id}
    assert ids("tag=url:http://x:1") == {eu.run_id}  # split on the first ':'
    assert ids("tag=customer:c-1&status=pending&limit=5") == {eu.run_id, us.run_id}
    assert ids("tag=customer:nobody") == set()
    body = api.get("/api/runs?tag=region:eu").json()
    assert body["runs"][0]["tags"] == {"customer": "c-1", "region": "eu", "url": "http://x:1"}


@pytest.mark.parametrize(
    ("query", "words"),
    [
        ("tag=customer", "tag 'customer' is not key:value"),
        ("tag=:v", "tag ':v': tag key '' must be 1..100 characters"),
        ("tag=k:" + "v" * 101, "tag value of 'k' must be 1..100 characters, it is 101"),
        ("tag=k:a&tag=k:b", "tag key 'k' is given twice"),
        ("&".join(f"tag=k{i}:v" for i in range(21)), "at most 20 tags per run, got 21"),
        ("tags=k:v", "unknown query parameter 'tags'"),
        ("tag=k:a%00b", "tag value of 'k' must not contain NUL characters"),
    ],
)
def test_a_bad_tag_filter_is_a_400_naming_it(api: TestClient, query: str, words: str) -> None:
    answer = api.get(f"/api/runs?{query}")
    assert answer.status_code == 400
    assert words in answer.json()["error"]


def test_an_http_start_takes_tags_and_a_bad_one_writes_nothing(d: Ductor, api: TestClient) -> None:
    answer = api.post(
        "/api/workflows/hold/runs", json={"tags": {"customer": "c-9"}}, headers=OPERATOR
    )
    assert answer.status_code == 201, answer.text
    assert d.get(answer.json()["run_id"]).tags == {"customer": "c-9"}
    bad = api.post("/api/workflows/hold/runs", json={"tags": {"k": "v" * 101}}, headers=OPERATOR)
    assert bad.status_code == 400
    assert "tag value of 'k' must be 1..100 characters" in bad.json()["error"]
    assert (_count(d, workflow_run), _count(d, run_tag)) == (1, 1)


def test_the_console_filters_by_tag_and_shows_tags_escaped(d: Ductor, api: TestClient) -> None:
    hostile = d.start("hold", tags={"note": XSS, "customer": "c-1"})
    plain = d.start("hold", tags={"customer": "c-2"})
    page = api.get("/?tag=customer:c-1")
    assert page.status_code == 200
    assert hostile.run_id in page.text and plain.run_id not in page.text
    assert XSS not in page.text and "&lt;script&gt;" in page.text
    assert 'name="tag" value="customer:c-1"' in page.text  # the filter is kept in the form
    run_page = api.get(f"/runs/{hostile.run_id}")
    assert run_page.status_code == 200
    assert "data-run-tags" in run_page.text and XSS not in run_page.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in run_page.text
    bad = api.get("/?tag=nocolon")
    assert bad.status_code == 400 and "tag &#39;nocolon&#39; is not key:value" in bad.text


def cli(d: Ductor, *args: str) -> Result:
    return CliRunner().invoke(ductor_cli, list(args), obj=SimpleNamespace(app=d.app))


def test_the_cli_starts_and_lists_by_tag(d: Ductor) -> None:
    started = cli(d, "start", "hold", "--tag", "customer=c-1", "--tag", "expr=a=b")
    assert started.exit_code == 0, started.output
    run_id = json.loads(started.output)["run_id"]
    assert d.get(run_id).tags == {"customer": "c-1", "expr": "a=b"}
    d.start("hold", tags={"customer": "c-2"})
    listed = cli(d, "runs", "--tag", "customer=c-1", "--json")
    assert listed.exit_code == 0, listed.output
    lines = [json.loads(line) for line in listed.output.splitlines()]
    assert [r["run_id"] for r in lines] == [run_id]
    assert lines[0]["tags"] == {"customer": "c-1", "expr": "a=b"}
    table = cli(d, "runs", "--tag", "customer=c-1", "--tag", "expr=a=b")
    # The table's columns wrap at 80 characters: the one run, and its tags in the last column.
    assert table.exit_code == 0 and "1 runs" in table.output and "expr=a=b" in table.output
    assert run_id not in cli(d, "runs", "--tag", "customer=c-2", "--json").output
    shown = cli(d, "show", run_id)
    assert shown.exit_code == 0 and "tags customer=c-1 expr=a=b" in shown.output, shown.output
    hostile = d.start("hold", tags={"note": "[red]x[/red]"})
    assert "tags note=[red]x[/red]" in cli(d, "show", hostile.run_id).output


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("runs", "--tag", "customer"), "--tag 'customer' is not KEY=VALUE"),
        (("runs", "--tag", "k=" + "v" * 101), "tag value of 'k' must be 1..100 characters"),
        (("start", "hold", "--tag", "k=a", "--tag", "k=b"), "--tag key 'k' is given twice"),
        (("start", "hold", "--tag", "=v"), "tag key '' must be 1..100 characters"),
    ],
)
def test_a_bad_tag_option_is_one_line_and_writes_nothing(
    d: Ductor, args: tuple[str, ...], words: str
) -> None:
    result = cli(d, *args)
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], lines
    assert _count(d, workflow_run) == 0
