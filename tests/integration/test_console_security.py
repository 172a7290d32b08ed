"""The console's defences, through Starlette's TestClient over a real PostgreSQL store: the
Host check that keeps a rebinding page from reading the console."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from starlette.testclient import TestClient

from ductor_celery import Ductor, StepContext, Workflow
from ductor_celery.web import create_app

TOKEN = "s3cret-token"
#: TestClient's Host: allowed explicitly, as a deployment names its own host.
TESTSERVER = "testserver"


@pytest.fixture
def ductor(database_url: str) -> Ductor:
    app = Celery("security", broker="memory://", set_as_current=False)
    d = Ductor(app, database_url=database_url)

    @d.step(name="sec.echo")
    def echo(ctx: StepContext, value: Any = None) -> Any:
        return value

    flow = Workflow("sec_flow")
    flow.step("a", echo, args={"value": "$.input.x"})
    flow.approval("review", after=["a"])
    d.register(flow)
    return d


@pytest.fixture
def client(ductor: Ductor) -> Iterator[TestClient]:
    with TestClient(create_app(ductor, token=TOKEN, allowed_hosts=[TESTSERVER])) as c:
        yield c


# -- the Host header ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    [
        "evil.example",
        "evil.example:8080",
        "localhost.evil.example",
        "127.0.0.1.nip.io",
        "testserver.evil",
        "localhost:8080@evil.example",
        "localhost:80x",
        "[::1",
        "[::2]:8080",
        "",
    ],
)
def test_an_unknown_host_is_400(ductor: Ductor, client: TestClient, host: str) -> None:
    run_id = ductor.start("sec_flow", input={"x": 1}).run_id
    for path in ("/", f"/runs/{run_id}", f"/api/runs/{run_id}", "/metrics", "/static/console.js"):
        answer = client.get(path, headers={"host": host})
        assert answer.status_code == 400, (path, host, answer.text)
        assert answer.headers["content-type"].startswith("text/plain")
        assert "--allowed-host" in answer.text
        assert "set-cookie" not in answer.headers  # refused before the session is made
        assert run_id not in answer.text


@pytest.mark.parametrize(
    "host",
    [
        "localhost",
        "LOCALHOST:8080",
        "localhost.",
        "127.0.0.1",
        "127.0.0.1:8080",
        "[::1]",
        "[::1]:80",
    ],
)
def test_loopback_names_are_served_by_default(ductor: Ductor, host: str) -> None:
    with TestClient(create_app(ductor)) as client:
        assert client.get("/").status_code == 400  # TestClient's "testserver" is not allowed
        assert client.get("/", headers={"host": host}).status_code == 200
        assert client.get("/api/runs", headers={"host": host}).status_code == 200


def test_allowed_hosts_from_the_keyword_and_the_setting(ductor: Ductor) -> None:
    ductor.app.conf.ductor_web_allowed_hosts = ["console.example", "[::5]"]
    app = create_app(ductor, allowed_hosts=["ops.example", "*.fleet.example"])
    with TestClient(app) as client:
        for host in (
            "console.example",
            "Console.Example:443",
            "[::5]:8080",
            "ops.example",
            "a.fleet.example",
            "b.a.fleet.example:8080",
            "localhost",
        ):
            assert client.get("/api/runs", headers={"host": host}).status_code == 200, host
        for host in ("fleet.example", "afleet.example", "evil.example", "testserver"):
            assert client.get("/api/runs", headers={"host": host}).status_code == 400, host


def test_a_star_serves_every_host(ductor: Ductor) -> None:
    with TestClient(create_app(ductor, allowed_hosts=["*"])) as client:
        assert client.get("/api/runs", headers={"host": "anything.example"}).status_code == 200


@pytest.mark.parametrize("bad", [["evil.example:80"], [""], [5], "a b", ["a/b"], ["[::1"]])
def test_a_bad_allowed_host_is_refused_at_start(ductor: Ductor, bad: Any) -> None:
    with pytest.raises(ValueError, match="allowed host"):
        create_app(ductor, allowed_hosts=bad)


def test_a_request_without_a_host_header_is_400(ductor: Ductor) -> None:
    app = create_app(ductor)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.0",
        "method": "GET",
        "scheme": "http",
        "path": "/api/runs",
        "raw_path": b"/api/runs",
        "query_string": b"",
        "root_path": "",
        "headers": [],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8080),
    }
    asyncio.run(app(scope, receive, send))  # type: ignore[arg-type]
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 400


def test_the_bound_address_is_a_name_unless_it_is_every_address() -> None:
    from ductor_celery.web.app import bound_hosts

    assert bound_hosts("10.1.2.3") == ["10.1.2.3"]
    assert bound_hosts("console.internal") == ["console.internal"]
    assert bound_hosts("::5") == ["::5"]
    for every in ("0.0.0.0", "::", "[::]", ""):
        assert bound_hosts(every) == []
