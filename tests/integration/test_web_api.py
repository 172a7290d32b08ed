"""The web console's JSON API, pages and /metrics over a real PostgreSQL store, with runs
driven by hand (ticks and attempt outcomes written the way workers write them), through
Starlette's TestClient."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from starlette.testclient import TestClient
from support import tick_once

from ductor_celery import ConcurrencyLimit, Ductor, StepContext, Workflow
from ductor_celery.store import attempts
from ductor_celery.store.db import forget_engine
from ductor_celery.web import create_app

TOKEN = "s3cret-token"
#: TestClient's Host: a name the console serves only when told to (never by default).
TESTSERVER = "testserver"


class World:
    """A Ductor on the test's database, its workflows, and a hand-driven 'worker'."""

    def __init__(self, url: str) -> None:
        self.app = Celery(f"web{id(self)}", broker="memory://", set_as_current=False)
        self.app.conf.ductor_max_payload_bytes = 5000
        self.d = Ductor(self.app, database_url=url)

        @self.d.step(name="web.echo")
        def echo(ctx: StepContext, value: Any = None) -> Any:
            return value

        flow = Workflow("web_flow")
        flow.step("a", echo, args={"value": "$.input.x"})
        flow.approval("review", after=["a"])
        flow.step("b", echo, after=["review"], args={"value": "$.nodes.a.output"})
        flow.output("$.nodes.b.output")
        self.d.register(flow)

        @self.d.step(name="web.limited", concurrency=ConcurrencyLimit(key="$.input.k", limit=1))
        def limited(ctx: StepContext, value: Any = None) -> Any:
            return value

        narrow = Workflow("web_narrow")
        narrow.scatter("each", limited, over="$.input.items", item_arg="value")
        self.d.register(narrow)
        child = Workflow("web_child")
        child.approval("ok")
        self.d.register(child)
        parent = Workflow("web_parent")
        parent.subworkflow("kid", workflow="web_child")
        self.d.register(parent)
        fan = Workflow("web_fan")
        fan.scatter("each", echo, over="$.input.items", item_arg="value", max_parallel=64)
        self.d.register(fan)

    @property
    def engine(self) -> Any:
        return self.d.client.engine

    def drive(self, run_id: str, *, rounds: int = 50, finish: int | None = None) -> None:
        """Tick the run and complete its open step attempts (at most ``finish`` of them in
        all, every one when None), until nothing is left to do."""
        done = 0
        for _ in range(rounds):
            rows = tick_once(self.engine, run_id, self.d.runtime.spec_for)
            with self.engine.connect() as conn:
                open_tokens = list(
                    conn.execute(
                        sa.text(
                            "SELECT token FROM eec_workflow_step_attempt "
                            "WHERE run_id = :r AND finished_at IS NULL ORDER BY token"
                        ),
                        {"r": run_id},
                    ).scalars()
                )
            if not rows and not open_tokens:
                return
            for token in open_tokens:
                if finish is not None and done >= finish:
                    tick_once(self.engine, run_id, self.d.runtime.spec_for)
                    return
                claimed = attempts.claim(self.engine, token, "w@test")
                if claimed is None:
                    continue
                attempts.finish(
                    self.engine, token, outcome="succeeded", output=claimed.args.get("value")
                )
                done += 1


@pytest.fixture
def world(database_url: str) -> World:
    return World(database_url)


@pytest.fixture
def api(world: World) -> Iterator[TestClient]:
    with TestClient(
        create_app(
            world.d, token=TOKEN, flower_url="http://flower:5555", allowed_hosts=[TESTSERVER]
        )
    ) as c:
        yield c


@pytest.fixture
def read_only(world: World) -> Iterator[TestClient]:
    with TestClient(create_app(world.d, allowed_hosts=[TESTSERVER])) as c:
        yield c


def _auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _waiting_run(world: World, workflow_id: str = "order-1") -> str:
    run_id = world.d.start("web_flow", input={"x": 7}, workflow_id=workflow_id).run_id
    world.drive(run_id)
    assert world.d.get(run_id).nodes["review"].status == "waiting"
    return run_id


# -- reading ------------------------------------------------------------------------------------


def test_runs_list_pages_and_filters(world: World, api: TestClient) -> None:
    ids = [world.d.start("web_flow", input={"x": i}, workflow_id=f"o-{i}").run_id for i in range(5)]
    first = api.get("/api/runs", params={"limit": 2})
    assert first.status_code == 200
    body = first.json()
    assert [r["run_id"] for r in body["runs"]] == ids[:-3:-1]
    assert body["runs"][0]["status"] == "pending" and "nodes" in body["runs"][0]
    second = api.get("/api/runs", params={"limit": 2, "cursor": body["next_cursor"]}).json()
    third = api.get("/api/runs", params={"limit": 2, "cursor": second["next_cursor"]}).json()
    assert [r["run_id"] for r in second["runs"] + third["runs"]] == [ids[2], ids[1], ids[0]]
    assert third["next_cursor"] is None
    one = api.get("/api/runs", params={"workflow_id": "o-3"}).json()
    assert [r["run_id"] for r in one["runs"]] == [ids[3]]
    assert api.get("/api/runs", params={"workflow": "web_fan"}).json()["runs"] == []
    assert (
        len(api.get("/api/runs", params={"since": "1h", "status": "pending"}).json()["runs"]) == 5
    )
    assert api.get("/api/runs", params={"until": "1h"}).json()["runs"] == []


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"limit": "0"}, "limit must be between 1 and 1000"),
        ({"limit": "1001"}, "limit must be between 1 and 1000"),
        ({"limit": "ten"}, "limit must be an integer"),
        ({"status": "done"}, "unknown run status 'done'"),
        ({"since": "last tuesday"}, "since 'last tuesday' is neither"),
        ({"since": "1h", "until": "2h"}, "is after until"),
        ({"cursor": "garbage"}, "not a cursor"),
        ({"workflow_id": "x" * 201}, "at most 200 characters"),
        ({"statsu": "running"}, "unknown query parameter 'statsu'"),
    ],
)
def test_bad_query_parameters_are_400_naming_them(
    api: TestClient, params: dict[str, str], needle: str
) -> None:
    answer = api.get("/api/runs", params=params)
    assert answer.status_code == 400
    assert needle in answer.json()["error"]


def test_one_run_as_json_and_404_when_unknown(world: World, api: TestClient) -> None:
    run_id = _waiting_run(world)
    got = api.get(f"/api/runs/{run_id}")
    assert got.status_code == 200
    view = got.json()
    assert view["run_id"] == run_id and view["status"] == "running"
    assert view["nodes"]["a"] == {**view["nodes"]["a"], "status": "succeeded", "output": 7}
    missing = api.get("/api/runs/no-such-run")
    assert missing.status_code == 404 and "no-such-run" in missing.json()["error"]
    assert api.get("/api/runs/" + "r" * 201).status_code == 400


# -- actions through the JSON API ---------------------------------------------------------------


def test_a_read_only_console_refuses_every_action(world: World, read_only: TestClient) -> None:
    run_id = _waiting_run(world)
    for action, body in [("pause", {}), ("approve", {"node": "review"}), ("nope", {})]:
        answer = read_only.post(f"/api/runs/{run_id}/{action}", json=body, headers=_auth())
        assert answer.status_code == 403 and "read-only" in answer.json()["error"]
    assert world.d.get(run_id).status == "running"
    page = read_only.get(f"/runs/{run_id}").text
    assert "read-only" in page and "data-action=" not in page


def test_actions_need_the_bearer_token(world: World, api: TestClient) -> None:
    run_id = _waiting_run(world)
    assert api.post(f"/api/runs/{run_id}/pause", json={}).status_code == 403
    assert api.post(f"/api/runs/{run_id}/pause", json={}, headers=_auth("wrong")).status_code == 403
    assert world.d.get(run_id).status == "running"


def test_approve_lets_the_run_finish_and_invalid_operations_are_409(
    world: World, api: TestClient
) -> None:
    run_id = _waiting_run(world)
    refused = api.post(f"/api/runs/{run_id}/resume", json={}, headers=_auth())
    assert refused.status_code == 409 and "cannot resume" in refused.json()["error"]
    approved = api.post(
        f"/api/runs/{run_id}/approve",
        json={"node": "review", "by": "alice", "comment": "ok"},
        headers=_auth(),
    )
    assert approved.status_code == 200 and approved.json()["run_id"] == run_id
    again = api.post(f"/api/runs/{run_id}/approve", json={"node": "review"}, headers=_auth())
    assert again.status_code == 409 and "already on its way" in again.json()["error"]
    world.drive(run_id)
    view = api.get(f"/api/runs/{run_id}").json()
    assert view["status"] == "succeeded" and view["output"] == 7
    # Who approved is the token's name (--token's is "token"), never the body's "by".
    assert view["nodes"]["review"]["output"]["by"] == "token"
    redrive = api.post(f"/api/runs/{run_id}/redrive", json={}, headers=_auth())
    assert redrive.status_code == 409 and "cannot redrive" in redrive.json()["error"]


def test_controls_and_signals_go_through_the_client(world: World, api: TestClient) -> None:
    run_id = _waiting_run(world)
    paused = api.post(f"/api/runs/{run_id}/pause", json={"reason": "lunch"}, headers=_auth())
    assert paused.status_code == 200
    world.drive(run_id)
    assert world.d.get(run_id).status == "paused"
    sent = api.post(
        f"/api/runs/{run_id}/signal",
        json={"name": "poke", "payload": {"n": 1}, "idempotency_key": "k1"},
        headers=_auth(),
    )
    assert sent.status_code == 200
    assert api.post(f"/api/runs/{run_id}/resume", headers=_auth()).status_code == 200
    cancelled = api.post(f"/api/runs/{run_id}/cancel", json={"reason": "no"}, headers=_auth())
    assert cancelled.status_code == 200
    world.drive(run_id)
    assert world.d.get(run_id).status == "cancelled"
    page = api.get(f"/runs/{run_id}").text
    assert 'data-signal="poke"' in page and 'data-control="cancel"' in page and "lunch" in page


@pytest.mark.parametrize(
    ("action", "body", "status", "needle"),
    [
        ("approve", {}, 400, "approve needs 'node'"),
        ("signal", {"payload": 1}, 400, "signal needs 'name'"),
        ("pause", {"reasn": "x"}, 400, "pause takes no key 'reasn'"),
        ("pause", [1, 2], 400, "must be a JSON object"),
        ("pause", {"reason": 5}, 400, "reason must be a string"),
        ("approve", {"node": "a" * 201}, 400, "at most 200 characters"),
        ("signal", {"name": "n\x00"}, 400, "NUL"),
        ("signal", {"name": "n", "payload": "x" * 6000}, 413, "ductor_max_payload_bytes"),
        ("approve", {"node": "a"}, 409, "'a' is not an approval node"),
        ("dance", {}, 400, "unknown action 'dance'"),
    ],
)
def test_bad_action_bodies_are_refused_and_change_nothing(
    world: World, api: TestClient, action: str, body: Any, status: int, needle: str
) -> None:
    run_id = _waiting_run(world)
    before = world.d.get(run_id)
    answer = api.post(f"/api/runs/{run_id}/{action}", json=body, headers=_auth())
    assert answer.status_code == status, answer.text
    assert needle in answer.json()["error"]
    assert world.d.get(run_id) == before


def test_json_too_deep_or_not_json_is_400(world: World, api: TestClient) -> None:
    run_id = _waiting_run(world)
    deep = "[" * 101 + "]" * 101
    for raw in (
        '{"name": "s", "payload": ' + deep + "}",
        "[" * 50_000,
        "{nope",
        '{"name": "s", "payload": NaN}',
    ):
        answer = api.post(
            f"/api/runs/{run_id}/signal",
            content=raw,
            headers={**_auth(), "content-type": "application/json"},
        )
        assert answer.status_code == 400, raw[:20]
        assert "error" in answer.json()
    huge = api.post(f"/api/runs/{run_id}/signal", content=b"x" * 200_000, headers=_auth())
    assert huge.status_code == 413


# -- pages --------------------------------------------------------------------------------------


def _csrf(html: str) -> str:
    found = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert found is not None, "no CSRF token in the page"
    return found.group(1)


def test_pages_log_in_with_csrf_and_act(world: World, api: TestClient) -> None:
    run_id = _waiting_run(world)
    page = api.get(f"/runs/{run_id}")
    assert page.status_code == 200
    html = page.text
    assert 'data-run-status="running"' in html
    assert 'data-node="a" data-status="succeeded"' in html
    assert 'data-node="review" data-status="waiting"' in html
    assert "http://flower:5555/task/" in html  # the attempt of a links to Flower
    # Not logged in: a page action is refused even with the right CSRF token.
    token = _csrf(api.get("/login").text)
    refused = api.post(
        f"/runs/{run_id}/actions/approve", data={"csrf_token": token, "node": "review"}
    )
    assert refused.status_code == 403
    wrong = api.post("/login", data={"csrf_token": token, "token": "nope", "next": "/"})
    assert wrong.status_code == 403 and "wrong token" in wrong.text
    logged = api.post(
        "/login",
        data={"csrf_token": token, "token": TOKEN, "next": f"/runs/{run_id}"},
        follow_redirects=False,
    )
    assert logged.status_code == 303 and logged.headers["location"] == f"/runs/{run_id}"
    # Logged in, but a form without the CSRF token: refused.
    no_csrf = api.post(f"/runs/{run_id}/actions/approve", data={"node": "review"})
    assert no_csrf.status_code == 403
    invalid = api.post(
        f"/runs/{run_id}/actions/resume", data={"csrf_token": token}, follow_redirects=False
    )
    assert invalid.status_code == 409 and "cannot resume run" in invalid.text
    done = api.post(
        f"/runs/{run_id}/actions/approve",
        data={"csrf_token": token, "node": "review", "by": "bob", "comment": ""},
        follow_redirects=False,
    )
    assert done.status_code == 303
    assert "approved review" in api.get(done.headers["location"]).text
    world.drive(run_id)
    assert world.d.get(run_id).status == "succeeded"


def test_runs_page_filters_counts_and_pages(world: World, api: TestClient) -> None:
    ids = [world.d.start("web_flow", input={"x": i}).run_id for i in range(3)]
    world.drive(ids[0])
    html = api.get("/", params={"limit": 2}).text
    assert html.count("data-run-id=") == 2 and f'data-run-id="{ids[2]}"' in html
    assert re.search(r'data-count="pending">pending <b>2</b>', html)
    assert re.search(r'data-count="running">running <b>1</b>', html)
    older = re.search(r'href="([^"]+)" data-next-page', html)
    assert older is not None
    rest = api.get(older.group(1).replace("&amp;", "&")).text
    assert [m for m in re.findall(r'data-run-id="([^"]+)"', rest)] == [ids[0]]
    running = api.get("/", params={"status": "running"}).text
    assert re.findall(r'data-run-id="([^"]+)"', running) == [ids[0]]
    bad = api.get("/", params={"limit": "0"})
    assert bad.status_code == 400 and "limit must be between 1 and 1000" in bad.text


def test_a_big_scatter_page_is_one_node_and_bounded(world: World, api: TestClient) -> None:
    run_id = world.d.start("web_fan", input={"items": list(range(1000))}).run_id
    world.drive(run_id, finish=100)
    live = api.get(f"/runs/{run_id}/live").json()
    counts = live["nodes"]["each"]["scatter"]
    assert counts["total"] == 1000 and counts["done"] >= 36 and counts["running"] == 64
    html = api.get(f"/runs/{run_id}").text
    assert html.count("data-node=") == 1 and html.count("data-attempt=") == 50
    assert "/1000 done" in html and len(html) < 200_000
    world.drive(run_id, rounds=500)
    assert world.d.get(run_id).status == "succeeded"
    html = api.get(f"/runs/{run_id}").text
    assert html.count("data-attempt=") == 50 and len(html) < 200_000


def test_metrics_read_open_runs_and_backlog_from_the_database(
    world: World, api: TestClient
) -> None:
    _waiting_run(world)
    world.d.start("web_flow", input={"x": 1})
    text = api.get("/metrics").text
    assert 'ductor_runs{status="running",workflow="web_flow"} 1.0' in text
    assert 'ductor_runs{status="pending",workflow="web_flow"} 1.0' in text
    backlog = re.search(r"^ductor_outbox_backlog (\S+)$", text, re.M)
    assert backlog is not None and float(backlog.group(1)) >= 1  # nobody sent them here
    assert "# TYPE ductor_lease_waiters gauge" in text
    narrow = world.d.start("web_narrow", input={"items": [1, 2, 3], "k": "c1"}).run_id
    tick_once(world.engine, narrow, world.d.runtime.spec_for)
    text = api.get("/metrics").text
    assert 'ductor_lease_waiters{step="web.limited"} 2.0' in text  # one holds the slot
    html = api.get(f"/runs/{narrow}").text
    assert html.count("waiting for a slot") == 2


def test_the_live_json_matches_the_run_view(world: World, api: TestClient) -> None:
    run_id = _waiting_run(world)
    live = api.get(f"/runs/{run_id}/live").json()
    view = api.get(f"/api/runs/{run_id}").json()
    assert live["status"] == view["status"]
    assert {n: v["status"] for n, v in live["nodes"].items()} == {
        n: v["status"] for n, v in view["nodes"].items()
    }
    assert json.dumps(live)  # plain JSON


def test_the_run_page_links_parent_children_predecessor_and_successor(
    world: World, api: TestClient
) -> None:
    parent = world.d.start("web_parent").run_id
    tick_once(world.engine, parent, world.d.runtime.spec_for)
    [child] = [v for v in world.d.list_runs(workflow="web_child")]
    assert child.parent_run_id == parent
    page = api.get(f"/runs/{parent}").text
    assert f'href="/runs/{child.run_id}" data-link="child"' in page
    assert f'href="/runs/{parent}" data-link="parent"' in api.get(f"/runs/{child.run_id}").text
    first = _waiting_run(world, "loop-1")
    world.d.continue_as_new(first)
    tick_once(world.engine, first, world.d.runtime.spec_for)
    successor = world.d.get(first).continued_to
    assert successor is not None
    assert f'href="/runs/{successor}" data-link="successor"' in api.get(f"/runs/{first}").text
    assert f'href="/runs/{first}" data-link="predecessor"' in api.get(f"/runs/{successor}").text
    # A workflow id in the URL: the page of its newest run.
    moved = api.get("/runs/loop-1", follow_redirects=False)
    assert moved.status_code == 303 and moved.headers["location"] == f"/runs/{successor}"
    assert api.get("/runs/nope").status_code == 404


def test_the_console_works_on_the_embedded_sqlite_database(tmp_path: Any) -> None:
    from ductor_celery.store.migrate import upgrade

    url = f"sqlite:///{tmp_path}/console.sqlite3"
    upgrade(url)
    world = World(url)
    run_id = _waiting_run(world)
    with TestClient(create_app(world.d, token=TOKEN, allowed_hosts=[TESTSERVER])) as client:
        assert f'data-run-id="{run_id}"' in client.get("/", params={"since": "1h"}).text
        page = client.get(f"/runs/{run_id}?node=a").text
        assert 'data-node="review" data-status="waiting"' in page and "data-attempt=" in page
        approved = client.post(
            f"/api/runs/{run_id}/approve", json={"node": "review"}, headers=_auth()
        )
        assert approved.status_code == 200
        world.drive(run_id)
        assert client.get(f"/api/runs/{run_id}").json()["status"] == "succeeded"
        assert 'ductor_runs{status="running"' not in client.get("/metrics").text


def test_redrive_from_a_node_with_an_input_through_the_api(world: World, api: TestClient) -> None:
    run_id = _waiting_run(world, workflow_id="order-redrive")
    world.d.approve(run_id, "review", by="alice")
    world.drive(run_id)
    assert world.d.get(run_id).status == "succeeded"
    unknown = api.post(f"/api/runs/{run_id}/redrive", json={"from_node": "nope"}, headers=_auth())
    assert unknown.status_code == 409 and "no such node" in unknown.json()["error"]
    redrive = api.post(
        f"/api/runs/{run_id}/redrive",
        json={"from_node": "b", "input": {"x": 9}},
        headers=_auth(),
    )
    assert redrive.status_code == 200, redrive.json()
    world.drive(run_id)
    view = api.get(f"/api/runs/{run_id}").json()
    assert view["status"] == "succeeded" and view["input"] == {"x": 9}
    assert view["nodes"]["b"]["attempts"] == 2 and view["nodes"]["a"]["attempts"] == 1
    assert view["version"] == 1


# -- times at the edge of the calendar (issue 22 item 7) -----------------------------------

CRAFTED_CURSOR = (
    "WyIwMDAxLTAxLTAxVDAwOjAwOjAwKzE0OjAwIiwicnJyciJd"  # ["0001-01-01T00:00:00+14:00","rrrr"]
)


@pytest.fixture(params=["sqlite", "postgresql"])
def edge_api(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[TestClient]:
    if request.param == "sqlite":
        from ductor_celery.store.migrate import upgrade

        url = f"sqlite:///{tmp_path}/edges.sqlite3"
        upgrade(url)
    else:
        url = request.getfixturevalue("database_url")
    world = World(url)
    world.d.start("web_flow", input={"x": 1})
    # raise_server_exceptions=False: a 500 is an answer here, not an exception in the test.
    with TestClient(
        create_app(world.d, token=TOKEN, allowed_hosts=[TESTSERVER]), raise_server_exceptions=False
    ) as c:
        yield c
    forget_engine(world.d.settings.database_url)  # its pooled connections back to the server


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"since": "0001-01-01T00:00:00+14:00"}, "since 0001-01-01T00:00:00+14:00 is out of"),
        ({"until": "9999-12-31T23:59:59-14:00"}, "until 9999-12-31T23:59:59-14:00 is out of"),
        ({"since": "99999999999w"}, "since '99999999999w' is more than ten years ago"),
        ({"until": "9" * 40 + "d"}, "is more than ten years ago"),
        ({"cursor": CRAFTED_CURSOR}, "is not a cursor that list_runs returned"),
    ],
)
def test_times_past_the_calendar_are_400_naming_the_parameter(
    edge_api: TestClient, params: dict[str, str], needle: str
) -> None:
    answer = edge_api.get("/api/runs", params=params)
    assert answer.status_code == 400, answer.text
    assert needle in answer.json()["error"]
    page = edge_api.get("/", params=params)
    assert page.status_code == 400
    assert needle.split(" ")[0] in page.text


def test_the_calendars_own_ends_in_utc_are_fine(edge_api: TestClient) -> None:
    answer = edge_api.get(
        "/api/runs", params={"since": "0001-01-01T00:00:00Z", "until": "9999-12-31T23:59:59Z"}
    )
    assert answer.status_code == 200 and len(answer.json()["runs"]) == 1
