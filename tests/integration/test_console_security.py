"""The console's defences, through Starlette's TestClient over a real PostgreSQL store: the
Host check that keeps a rebinding page from reading the console, no HTML built from a request's
values, the security headers on every response, and a session cookie that keeps nothing an
attacker could test token guesses against."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from starlette.testclient import TestClient

from ductor_celery import Ductor, StepContext, Workflow
from ductor_celery.web import create_app, tokens

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


# -- no HTML built from what the request says ---------------------------------------------------


HOSTILE = [
    "<img src=x onerror=alert(1)>",
    '"><script>alert(1)</script>',
    "x' onmouseover='alert(1)",
    "<svg/onload=alert(1)>",
]
#: The raw markup of the hostile values (the pages' own <script src=...> is not one).
MARKUP = re.compile(r"<img\b|<script>|<svg/", re.IGNORECASE)


def _assert_not_html_of(response: Any, value: str) -> None:
    """The answer names ``value`` only as text: JSON or plain text, or escaped HTML."""
    kind = response.headers.get("content-type", "")
    assert kind.split(";")[0] in ("text/html", "text/plain", "application/json"), kind
    if kind.startswith("text/html"):
        assert value not in response.text
        assert not MARKUP.search(response.text), response.text[:500]


@pytest.mark.parametrize("run_id", HOSTILE)
@pytest.mark.parametrize("path", ["/runs/{}", "/runs/{}/panels", "/runs/{}/live", "/api/runs/{}"])
def test_a_hostile_run_id_is_404_and_never_html(client: TestClient, path: str, run_id: str) -> None:
    answer = client.get(path.format(run_id))
    # An id with a "/" is two path segments: no such route (or only a POST one there).
    assert answer.status_code in ((404, 405) if "/" in run_id else (404,)), answer.text
    _assert_not_html_of(answer, run_id)


@pytest.mark.parametrize("path", ["/runs/{}", "/runs/{}/panels", "/runs/{}/live", "/api/runs/{}"])
def test_an_invalid_hostile_run_id_is_400_and_never_html(client: TestClient, path: str) -> None:
    run_id = "<img src=x onerror=alert(1)>" + "x" * 200  # over 200 characters
    answer = client.get(path.format(run_id))
    assert answer.status_code == 400, answer.text
    _assert_not_html_of(answer, "<img src=x onerror=alert(1)>")


def test_a_fragment_error_is_plain_text(client: TestClient) -> None:
    answer = client.get("/runs/<img src=x onerror=alert(1)>/panels")
    assert answer.status_code == 404
    assert answer.headers["content-type"].startswith("text/plain")
    assert "<img src=x onerror=alert(1)>" in answer.text  # as text: the browser shows it


@pytest.mark.parametrize("value", HOSTILE)
@pytest.mark.parametrize("param", ["status", "workflow", "workflow_id", "since", "limit", "cursor"])
def test_hostile_runs_list_filters_are_escaped(client: TestClient, param: str, value: str) -> None:
    for headers in ({}, {"X-Ductor-Fragment": "rows"}):
        answer = client.get("/", params={param: value}, headers=headers)
        assert answer.status_code in (200, 400), answer.text
        _assert_not_html_of(answer, value)
    api = client.get("/api/runs", params={param: value})
    assert api.status_code in (200, 400)
    _assert_not_html_of(api, value)


def test_a_hostile_action_on_an_unknown_run_is_escaped(client: TestClient) -> None:
    page = client.get("/login").text
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert csrf is not None
    client.post("/login", data={"csrf_token": csrf.group(1), "token": TOKEN, "next": "/"})
    run_id = HOSTILE[0]
    answer = client.post(f"/runs/{run_id}/actions/pause", data={"csrf_token": csrf.group(1)})
    assert answer.status_code == 404
    _assert_not_html_of(answer, run_id)
    login = client.get("/login", params={"next": '/"><script>alert(1)</script>'})
    _assert_not_html_of(login, "<script>alert(1)</script>")


@pytest.mark.parametrize(
    "nxt",
    [
        "//evil.example/",
        "/\t/evil.example/",
        "/\n/evil.example",
        "/\\evil.example",
        "https://evil.example/",
    ],
)
def test_logging_in_never_redirects_to_another_site(client: TestClient, nxt: str) -> None:
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', client.get("/login").text)
    assert csrf is not None
    answer = client.post(
        "/login",
        data={"csrf_token": csrf.group(1), "token": TOKEN, "next": nxt},
        follow_redirects=False,
    )
    assert answer.status_code == 303 and answer.headers["location"] == "/"


def test_templates_escape_and_hold_no_inline_script_or_style(client: TestClient) -> None:
    """What keeps the pages working under the CSP and escaping by default: no template turns
    escaping off or marks a value safe, none carries inline script, handlers or styles."""
    from ductor_celery.web.console import PACKAGE

    assert client.app.state.console.env.autoescape is True  # type: ignore[attr-defined]
    templates = list((PACKAGE / "templates").iterdir())
    assert templates
    for path in templates:
        text = path.read_text()
        assert not re.search(r"\|\s*safe\b|autoescape\s+false|Markup", text), path.name
        assert not re.search(r"<script(?![^>]*\bsrc=)", text), path.name
        assert not re.search(r"\son[a-z]+\s*=", text, re.IGNORECASE), path.name
        assert not re.search(r"\bstyle\s*=|<style", text, re.IGNORECASE), path.name
        assert "javascript:" not in text.lower(), path.name


# -- headers on every response --------------------------------------------------------------------


def _policy(header: str) -> dict[str, list[str]]:
    found = {}
    for part in header.split(";"):
        words = part.split()
        if words:
            found[words[0].lower()] = words[1:]
    return found


def assert_guarded(response: Any) -> None:
    """The security headers the contract promises, on one response."""
    csp = response.headers.get("content-security-policy")
    assert csp, f"no CSP on {response.request.method} {response.request.url}"
    policy = _policy(csp)
    scripts = policy.get("script-src", policy.get("default-src"))
    assert scripts is not None and "'unsafe-inline'" not in scripts, csp
    assert "'unsafe-eval'" not in scripts, csp
    assert "'unsafe-inline'" not in policy.get("style-src", policy.get("default-src", [])), csp
    assert policy.get("frame-ancestors") == ["'none'"], csp
    assert response.headers.get("x-content-type-options") == "nosniff"
    assert response.headers.get("x-frame-options") == "DENY"


def test_every_response_carries_the_security_headers(ductor: Ductor, client: TestClient) -> None:
    run_id = ductor.start("sec_flow", input={"x": 1}).run_id
    answers = [
        client.get("/"),
        client.get("/", headers={"X-Ductor-Fragment": "rows"}),
        client.get("/?limit=0"),
        client.get(f"/runs/{run_id}"),
        client.get(f"/runs/{run_id}/panels"),
        client.get(f"/runs/{run_id}/live"),
        client.get("/runs/nope"),
        client.get("/runs/nope/panels"),
        client.get("/login"),
        client.post("/login", data={}),
        client.post("/logout", data={}),
        client.get("/api/runs"),
        client.get("/api/runs?limit=0"),
        client.get(f"/api/runs/{run_id}"),
        client.get("/api/runs/nope"),
        client.post(f"/api/runs/{run_id}/pause", json={}),
        client.get("/metrics"),
        client.get("/static/console.js"),
        client.get("/static/console.css"),
        client.get("/static/nope.js"),
        client.get("/no/such/page"),
        client.put("/"),
        client.get("/", headers={"host": "evil.example"}),
    ]
    codes = sorted({a.status_code for a in answers})
    assert codes == [200, 400, 403, 404, 405], codes
    for answer in answers:
        assert_guarded(answer)


def test_a_server_error_is_plain_text_with_the_headers(ductor: Ductor, monkeypatch: Any) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("<b>boom</b>")

    monkeypatch.setattr(ductor, "get", broken)
    app = create_app(ductor, allowed_hosts=[TESTSERVER])
    with TestClient(app, raise_server_exceptions=False) as client:
        answer = client.get("/api/runs/some-run")
    assert answer.status_code == 500
    assert answer.headers["content-type"].startswith("text/plain")
    assert "<b>" not in answer.text
    assert_guarded(answer)


# -- the session cookie -------------------------------------------------------------------------


def _session(client: TestClient) -> dict[str, Any]:
    """The session cookie's contents: Starlette's base64 JSON, then timestamp and signature."""
    raw = client.cookies["ductor_console"]
    payload = raw.split(".")[0]
    decoded: dict[str, Any] = json.loads(base64.b64decode(payload + "=" * (-len(payload) % 4)))
    return decoded


def _log_in(client: TestClient) -> None:
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', client.get("/login").text)
    assert csrf is not None
    answer = client.post(
        "/login",
        data={"csrf_token": csrf.group(1), "token": TOKEN, "next": "/"},
        follow_redirects=False,
    )
    assert answer.status_code == 303


def test_the_session_cookie_holds_nothing_to_test_token_guesses_against(ductor: Ductor) -> None:
    seen = []
    for _ in range(2):
        with TestClient(create_app(ductor, token=TOKEN, allowed_hosts=[TESTSERVER])) as client:
            _log_in(client)
            session = _session(client)
            seen.append(session)
            text = json.dumps(session)
            for digest in (
                hashlib.sha256(b"ductor-console:" + TOKEN.encode()).hexdigest(),
                hashlib.sha256(TOKEN.encode()).hexdigest(),
                hashlib.sha1(TOKEN.encode()).hexdigest(),  # noqa: S324 - looking for it
                hashlib.md5(TOKEN.encode()).hexdigest(),  # noqa: S324
            ):
                assert digest not in text
            assert TOKEN not in text
            assert "log out" in client.get("/").text  # the session still logs in
    # Keyed by a secret of the console's own: the same token, two consoles, two values.
    assert seen[0].get("auth") != seen[1].get("auth")


def test_a_changed_token_logs_the_session_out(ductor: Ductor) -> None:
    app = create_app(ductor, token=TOKEN, allowed_hosts=[TESTSERVER])
    with TestClient(app) as client:
        _log_in(client)
        assert "log out" in client.get("/").text
        app.state.console.tokens = tokens.single("another-token")
        page = client.get("/").text
        assert "log out" not in page and "log in to act" in page
