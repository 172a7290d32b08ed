"""Named console tokens with roles (issue 23): every role against every action over the JSON
API and the pages (CSRF kept), reads that need a token (``auth_reads``), where tokens come
from (``--token``, a token file, the settings), sessions that end when their token changes,
and no secret in any answer or log line. Through Starlette's TestClient over a real
PostgreSQL store, runs driven by hand."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from click.testing import CliRunner
from starlette.testclient import TestClient
from support import tick_once

from ductor_celery import Ductor, Workflow
from ductor_celery.cli import ductor as ductor_cli
from ductor_celery.web import create_app, tokens

TESTSERVER = "testserver"
SECRETS = {
    "vera": "viewer-secret-7f3a",
    "otto": "operator-secret-91bc",
    "ada": "admin-secret-5d2e",
}
ROLES = {"vera": "viewer", "otto": "operator", "ada": "admin"}
#: Who asks: a name of SECRETS, or None for a request without a token.
ASKERS = [None, "vera", "otto", "ada"]
ACTIONS = ["pause", "resume", "cancel", "terminate", "redrive", "approve", "reject", "signal"]
#: Who may do each action: every run action needs an operator (an admin may too).
MAY_ACT = {"otto", "ada"}


def _sha(secret: str) -> str:
    return "sha256:" + hashlib.sha256(secret.encode()).hexdigest()


def _file_tokens(*, hashed: tuple[str, ...] = ()) -> dict[str, dict[str, str]]:
    return {
        name: {"secret": _sha(SECRETS[name]) if name in hashed else SECRETS[name], "role": role}
        for name, role in ROLES.items()
    }


@pytest.fixture
def d(database_url: str) -> Ductor:
    app = Celery("tokens", broker="memory://", set_as_current=False)
    found = Ductor(app, database_url=database_url)
    flow = Workflow("gate")
    flow.approval("review", on_reject="continue")
    flow.wait_signal("go", signal="go", after=["review"])
    found.register(flow)
    return found


def _tick(d: Ductor, run_id: str) -> None:
    for _ in range(5):
        if not tick_once(d.client.engine, run_id, d.runtime.spec_for):
            return


def _run_for(d: Ductor, action: str) -> str:
    """A run whose state allows ``action``: waiting for its approval, or paused (resume), or
    terminated (redrive)."""
    run_id = d.start("gate").run_id
    _tick(d, run_id)
    assert d.get(run_id).nodes["review"].status == "waiting"
    if action == "resume":
        d.pause(run_id)
        _tick(d, run_id)
        assert d.get(run_id).status == "paused"
    if action == "redrive":
        d.terminate(run_id)
        assert d.get(run_id).status == "terminated"
    return run_id


def _body(action: str) -> dict[str, Any]:
    return {
        "approve": {"node": "review", "comment": "fine"},
        "reject": {"node": "review"},
        "signal": {"name": "go", "payload": {"n": 1}},
        "pause": {"reason": "look"},
    }.get(action, {})


def _rows(d: Ductor, run_id: str) -> tuple[int, int]:
    """(controls, signals) the run has been sent."""
    with d.client.engine.connect() as conn:
        return tuple(  # type: ignore[return-value]
            conn.execute(
                sa.text(f"SELECT count(*) FROM {table} WHERE run_id = :r"), {"r": run_id}
            ).scalar_one()
            for table in ("eec_workflow_control", "eec_workflow_signal")
        )


def _acted(d: Ductor, run_id: str, action: str, name: str) -> None:
    """The action's effect is there, done as ``name``."""
    _tick(d, run_id)
    view = d.get(run_id)
    expected = {
        "pause": "paused",
        "resume": "running",
        "cancel": "cancelled",
        "terminate": "terminated",
        "redrive": "running",
    }
    if action in expected:
        assert view.status == expected[action], (action, view.status)
    elif action in ("approve", "reject"):
        output = view.nodes["review"].output
        assert output["approved"] is (action == "approve") and output["by"] == name
    else:
        assert _rows(d, run_id)[1] == 1


def _bearer(name: str | None) -> dict[str, str]:
    return {} if name is None else {"Authorization": f"Bearer {SECRETS[name]}"}


def _csrf(html: str) -> str:
    found = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert found is not None, "no CSRF token in the page"
    return found.group(1)


def _log_in(client: TestClient, secret: str, status: int = 303) -> str:
    """Log the client's session in; its CSRF token."""
    csrf = _csrf(client.get("/login").text)
    answer = client.post(
        "/login",
        data={"csrf_token": csrf, "token": secret, "next": "/"},
        follow_redirects=False,
    )
    assert answer.status_code == status, answer.text
    return csrf


@pytest.fixture
def console(d: Ductor) -> Iterator[Callable[..., TestClient]]:
    made: list[TestClient] = []

    def make(**options: Any) -> TestClient:
        options.setdefault("tokens", _file_tokens(hashed=("ada",)))
        client = TestClient(create_app(d, allowed_hosts=[TESTSERVER], **options))
        client.__enter__()
        made.append(client)
        return client

    yield make
    for client in made:
        client.__exit__(None, None, None)


# -- every role against every action ------------------------------------------------------------


@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("who", ASKERS)
def test_each_role_against_each_action_over_the_json_api(
    d: Ductor, console: Callable[..., TestClient], who: str | None, action: str
) -> None:
    api = console()
    run_id = _run_for(d, action)
    before, rows = d.get(run_id), _rows(d, run_id)
    answer = api.post(f"/api/runs/{run_id}/{action}", json=_body(action), headers=_bearer(who))
    if who in MAY_ACT:
        assert answer.status_code == 200, answer.text
        assert answer.json()["run_id"] == run_id
        _acted(d, run_id, action, who)
        return
    assert answer.status_code == 403, answer.text
    if who is None:
        assert "Authorization: Bearer" in answer.json()["error"]
    else:
        assert answer.json()["error"] == (
            f"the token {who!r} has the role viewer: {action} needs the role operator or above"
        )
    assert d.get(run_id) == before and _rows(d, run_id) == rows


@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("who", ASKERS)
def test_each_role_against_each_action_on_the_pages(
    d: Ductor, console: Callable[..., TestClient], who: str | None, action: str
) -> None:
    page = console()
    csrf = _log_in(page, SECRETS[who]) if who is not None else _csrf(page.get("/login").text)
    run_id = _run_for(d, action)
    before, rows = d.get(run_id), _rows(d, run_id)
    html = page.get(f"/runs/{run_id}").text
    form = {k: v for k, v in _body(action).items() if k != "payload"}
    answer = page.post(
        f"/runs/{run_id}/actions/{action}",
        data={"csrf_token": csrf, **form},
        follow_redirects=False,
    )
    if who in MAY_ACT:
        assert f'data-action="{action}"' in html  # the page offers it
        assert answer.status_code == 303, answer.text
        _acted(d, run_id, action, who)
        return
    assert "data-action=" not in html  # no buttons for who may not act
    assert answer.status_code == 403, answer.text
    needle = "log in with a token first" if who is None else "needs the role operator"
    assert needle in answer.text
    assert d.get(run_id) == before and _rows(d, run_id) == rows


@pytest.mark.parametrize("who", ["otto", "ada"])
def test_the_pages_keep_the_csrf_check_for_every_role(
    d: Ductor, console: Callable[..., TestClient], who: str
) -> None:
    page, other = console(), console()
    _log_in(page, SECRETS[who])
    foreign = _csrf(other.get("/login").text)  # another session's token
    run_id = _run_for(d, "pause")
    for data in ({}, {"csrf_token": ""}, {"csrf_token": foreign}):
        answer = page.post(f"/runs/{run_id}/actions/pause", data=data, follow_redirects=False)
        assert answer.status_code == 403 and "CSRF token" in answer.text
    assert d.get(run_id).status == "running" and _rows(d, run_id) == (0, 0)
    # A bearer token is no way around the session on the pages' forms.
    answer = page.post(
        f"/runs/{run_id}/actions/pause", data={"csrf_token": foreign}, headers=_bearer(who)
    )
    assert answer.status_code == 403


def test_a_viewer_session_sees_the_run_but_no_form(
    d: Ductor, console: Callable[..., TestClient]
) -> None:
    page = console()
    _log_in(page, SECRETS["vera"])
    run_id = _run_for(d, "approve")
    html = page.get(f"/runs/{run_id}").text
    assert 'data-who="vera" data-role="viewer"' in html and "reads only" in html
    assert "data-action=" not in html and 'data-approval="review"' not in html
    panels = page.get(f"/runs/{run_id}/panels").text
    assert "data-no-actions" in panels and "data-action=" not in panels
    # Logging out needs the session's CSRF token, for a viewer too.
    assert page.post("/logout", data={}).status_code == 403
    page.post("/logout", data={"csrf_token": _csrf(html)})
    assert "log in to act" in page.get("/").text


def test_the_approval_form_takes_its_approver_from_the_session(
    d: Ductor, console: Callable[..., TestClient]
) -> None:
    page = console()
    csrf = _log_in(page, SECRETS["otto"])
    run_id = _run_for(d, "approve")
    html = page.get(f"/runs/{run_id}").text
    assert 'name="by"' not in html and "by otto" in html
    # A "by" posted anyway (an old form, a script) does not choose who approved.
    page.post(
        f"/runs/{run_id}/actions/approve",
        data={"csrf_token": csrf, "node": "review", "by": "mallory"},
    )
    _tick(d, run_id)
    assert d.get(run_id).nodes["review"].output["by"] == "otto"


def test_the_body_by_does_not_choose_who_approves_over_the_api(
    d: Ductor, console: Callable[..., TestClient]
) -> None:
    api = console()
    run_id = _run_for(d, "reject")
    answer = api.post(
        f"/api/runs/{run_id}/reject",
        json={"node": "review", "by": "mallory", "comment": "no"},
        headers=_bearer("ada"),
    )
    assert answer.status_code == 200
    _tick(d, run_id)
    assert d.get(run_id).nodes["review"].output["by"] == "ada"


# -- reads that need a token --------------------------------------------------------------------


def test_auth_reads_needs_a_token_for_the_json_api(
    d: Ductor, console: Callable[..., TestClient]
) -> None:
    api = console(auth_reads=True)
    run_id = _run_for(d, "pause")
    for path in ("/api/runs", f"/api/runs/{run_id}", "/metrics"):
        missing = api.get(path)
        assert missing.status_code == 401, path
        assert missing.headers["www-authenticate"] == 'Bearer realm="ductor"'
        wrong = api.get(path, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 403, path
        for who in ROLES:
            assert api.get(path, headers=_bearer(who)).status_code == 200, (path, who)
    assert "error" in api.get("/api/runs").json()
    assert api.get("/api/runs", headers=_bearer("vera")).json()["runs"][0]["run_id"] == run_id
    # An action without a token is 401 here (reads need one; 403 without --auth-reads).
    refused = api.post(f"/api/runs/{run_id}/pause", json={})
    assert refused.status_code == 401 and "Authorization" in refused.json()["error"]
    viewer = api.post(f"/api/runs/{run_id}/pause", json={}, headers=_bearer("vera"))
    assert viewer.status_code == 403
    assert (
        api.post(f"/api/runs/{run_id}/pause", json={}, headers=_bearer("otto")).status_code == 200
    )


def test_auth_reads_needs_a_login_for_the_pages(
    d: Ductor, console: Callable[..., TestClient]
) -> None:
    page = console(auth_reads=True)
    run_id = _run_for(d, "pause")
    for path in ("/", f"/runs/{run_id}"):
        answer = page.get(path)
        assert answer.status_code == 401, path
        assert 'name="token"' in answer.text and f'name="next" value="{path}"' in answer.text
        assert "data-run-id" not in answer.text and "data-run-status" not in answer.text
    for path in (f"/runs/{run_id}/live", f"/runs/{run_id}/panels", "/metrics", "/nope"):
        answer = page.get(path)
        assert answer.status_code == 401 and answer.headers["content-type"].startswith(
            "text/plain"
        ), path
        assert run_id not in answer.text
    assert page.get("/login").status_code == 200
    assert page.get("/static/console.css").status_code == 200
    assert page.post(f"/runs/{run_id}/actions/pause", data={}).status_code == 401
    _log_in(page, SECRETS["vera"])
    assert f'data-run-id="{run_id}"' in page.get("/").text
    assert page.get(f"/runs/{run_id}/live").json()["status"] == "running"
    assert page.get("/metrics").status_code == 200
    # The session is the pages' way in, never the JSON API's.
    assert page.get("/api/runs").status_code == 401
    # A bearer token reads a page too (scripts reading data-* attributes).
    bare = console(auth_reads=True)
    assert bare.get(f"/runs/{run_id}", headers=_bearer("vera")).status_code == 200


def test_auth_reads_from_the_setting_and_refused_without_tokens(d: Ductor) -> None:
    d.app.conf.ductor_web_auth_reads = True
    with pytest.raises(ValueError, match="need tokens"):
        create_app(d, allowed_hosts=[TESTSERVER])
    d.app.conf.ductor_web_tokens = _file_tokens()
    with TestClient(create_app(d, allowed_hosts=[TESTSERVER])) as client:
        assert client.get("/api/runs").status_code == 401
        assert client.get("/api/runs", headers=_bearer("vera")).status_code == 200
    # The keyword wins over the setting.
    with TestClient(create_app(d, allowed_hosts=[TESTSERVER], auth_reads=False)) as client:
        assert client.get("/api/runs").status_code == 200
    d.app.conf.ductor_web_auth_reads = "maybe"
    with pytest.raises(ValueError, match="ductor_web_auth_reads must be true or false"):
        create_app(d, allowed_hosts=[TESTSERVER])


def test_without_auth_reads_reads_need_no_token(
    d: Ductor, console: Callable[..., TestClient]
) -> None:
    api = console()
    run_id = _run_for(d, "pause")
    assert api.get("/api/runs").status_code == 200
    assert api.get(f"/runs/{run_id}").status_code == 200
    # Nor does a wrong one hurt a read: only actions look at it.
    assert api.get("/api/runs", headers={"Authorization": "Bearer nope"}).status_code == 200


# -- where tokens come from ---------------------------------------------------------------------


def _approver(d: Ductor, client: TestClient, secret: str) -> str:
    run_id = _run_for(d, "approve")
    answer = client.post(
        f"/api/runs/{run_id}/approve",
        json={"node": "review"},
        headers={"Authorization": f"Bearer {secret}"},
    )
    assert answer.status_code == 200, answer.text
    _tick(d, run_id)
    by: str = d.get(run_id).nodes["review"].output["by"]
    return by


def test_the_single_token_is_an_admin_named_token(d: Ductor) -> None:
    with TestClient(create_app(d, token="old-shared", allowed_hosts=[TESTSERVER])) as client:
        assert _approver(d, client, "old-shared") == "token"
    d.app.conf.ductor_web_token = "from-setting"
    with TestClient(create_app(d, allowed_hosts=[TESTSERVER])) as client:
        assert _approver(d, client, "from-setting") == "token"
        page = client
        _log_in(page, "from-setting")
        assert 'data-who="token" data-role="admin"' in page.get("/").text


@pytest.mark.parametrize("suffix", [".json", ".toml", ""])
def test_a_token_file_json_or_toml_with_hashes(d: Ductor, tmp_path: Path, suffix: str) -> None:
    entries = _file_tokens(hashed=("otto",))
    path = tmp_path / f"tokens{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps({"tokens": entries}))
    else:
        path.write_text(
            "".join(
                f'[tokens.{name}]\nsecret = "{e["secret"]}"\nrole = "{e["role"]}"\n\n'
                for name, e in entries.items()
            )
        )
    with TestClient(create_app(d, token_file=path, allowed_hosts=[TESTSERVER])) as client:
        assert _approver(d, client, SECRETS["otto"]) == "otto"  # a hashed entry
        assert _approver(d, client, SECRETS["ada"]) == "ada"
        run_id = _run_for(d, "pause")
        viewer = client.post(f"/api/runs/{run_id}/pause", headers=_bearer("vera"))
        assert viewer.status_code == 403
        # The hash itself is not the token.
        hashed = client.post(
            f"/api/runs/{run_id}/pause",
            headers={"Authorization": f"Bearer {entries['otto']['secret']}"},
        )
        assert hashed.status_code == 403


def test_sources_given_together_are_one_set(d: Ductor, tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"tokens": {"otto": {"secret": "o-1", "role": "operator"}}}))
    app = create_app(
        d,
        token="shared",
        tokens={"vera": {"secret": "v-1", "role": "viewer"}},
        token_file=str(path),
        allowed_hosts=[TESTSERVER],
    )
    known = {t.name: t.role for t in app.state.console.tokens}
    assert known == {"token": "admin", "vera": "viewer", "otto": "operator"}
    # Given ones replace the settings' entirely.
    d.app.conf.ductor_web_token = "from-setting"
    app = create_app(d, token_file=str(path), allowed_hosts=[TESTSERVER])
    assert [t.name for t in app.state.console.tokens] == ["otto"]
    with pytest.raises(ValueError, match="two tokens are named 'token'"):
        create_app(d, token="a", tokens={"token": {"secret": "b", "role": "viewer"}})
    with pytest.raises(ValueError, match="the tokens 'token' and 'otto' have one secret"):
        create_app(d, token="o-1", token_file=str(path))


# -- sessions -----------------------------------------------------------------------------------


def test_a_session_keeps_the_name_and_ends_when_its_token_changes(d: Ductor) -> None:
    app = create_app(d, tokens=_file_tokens(), allowed_hosts=[TESTSERVER])
    console = app.state.console
    with TestClient(app) as alice_tab, TestClient(app) as bob_tab:
        _log_in(alice_tab, SECRETS["otto"])
        _log_in(bob_tab, SECRETS["ada"])
        assert 'data-who="otto"' in alice_tab.get("/").text
        # otto's secret changes: his session is over, ada's is not.
        entries = _file_tokens()
        entries["otto"]["secret"] = "a-new-secret"
        console.tokens = tokens.from_mapping(entries, "test")
        assert "log in to act" in alice_tab.get("/").text
        assert 'data-who="ada"' in bob_tab.get("/").text
        # ada is removed: hers ends too; another token of the same name is not hers either.
        del entries["ada"]
        console.tokens = tokens.from_mapping(entries, "test")
        assert "log in to act" in bob_tab.get("/").text
        entries["ada"] = {"secret": "someone-else", "role": "admin"}
        console.tokens = tokens.from_mapping(entries, "test")
        assert "log in to act" in bob_tab.get("/").text
        # A session cookie names who, and holds no secret or plain hash of one.
        _log_in(alice_tab, "a-new-secret")
        raw = alice_tab.cookies["ductor_console"].split(".")[0]
        session = json.loads(base64.b64decode(raw + "=" * (-len(raw) % 4)))
        assert session["who"] == "otto"
        text = json.dumps(session)
        assert "a-new-secret" not in text
        assert hashlib.sha256(b"a-new-secret").hexdigest() not in text


def test_a_wrong_token_does_not_log_in_and_a_viewer_logs_in_to_read(
    d: Ductor, console: Callable[..., TestClient]
) -> None:
    page = console()
    csrf = _csrf(page.get("/login").text)
    wrong = page.post("/login", data={"csrf_token": csrf, "token": "nope"})
    assert wrong.status_code == 403 and "wrong token" in wrong.text
    hashed = _sha(SECRETS["ada"])  # the file's hash is not a password
    _log_in(page, hashed, status=403)
    _log_in(page, SECRETS["vera"])
    assert "logged in as vera (viewer): reads only" in page.get("/").text


# -- secrets stay secret ------------------------------------------------------------------------


def test_no_secret_in_any_answer_or_log_line(
    d: Ductor, console: Callable[..., TestClient], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    api = console(auth_reads=True)
    run_id = _run_for(d, "approve")
    answers = []
    for secret in [*SECRETS.values(), "a-wrong-guess-123"]:
        auth = {"Authorization": f"Bearer {secret}"}
        answers.append(api.get("/api/runs", headers=auth))
        answers.append(api.post(f"/api/runs/{run_id}/pause", json={}, headers=auth))
        answers.append(api.post(f"/api/runs/{run_id}/nope", json={}, headers=auth))
        csrf = _csrf(api.get("/login").text)
        answers.append(api.post("/login", data={"csrf_token": csrf, "token": secret}))
    for secret in [*SECRETS.values(), "a-wrong-guess-123"]:
        for answer in answers:
            assert secret not in answer.text and secret not in str(answer.headers)
        for record in caplog.records:
            assert secret not in record.getMessage()
            assert hashlib.sha256(secret.encode()).hexdigest() not in record.getMessage()


# -- the command line ---------------------------------------------------------------------------


@pytest.fixture
def cli(d: Ductor, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    started: list[Any] = []
    monkeypatch.setattr("ductor_celery.web.app.run", lambda app, **kw: started.append(app))

    def invoke(*args: str) -> Any:
        started.clear()
        result = CliRunner().invoke(ductor_cli, ["web", *args], obj=SimpleNamespace(app=d.app))
        result.started = list(started)
        return result

    return invoke


def test_the_cli_starts_with_a_token_file_and_auth_reads(
    cli: Callable[..., Any], tmp_path: Path
) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(
        '[tokens.alice]\nsecret = "alice-plain-secret"\nrole = "operator"\n'
        f'[tokens.bob]\nsecret = "{_sha("bob-secret")}"\nrole = "viewer"\n'
    )
    path.chmod(0o644)
    result = cli("--token-file", str(path), "--auth-reads")
    assert result.exit_code == 0, result.output
    [app] = result.started
    assert app.state.console.auth_reads is True
    assert "tokens: alice (operator), bob (viewer); reads need a token" in result.output
    assert "readable by other users and holds 1 secret(s) in the clear" in result.output
    assert "alice-plain-secret" not in result.output
    path.chmod(0o600)
    quiet = cli("--token-file", str(path), "--token", "t0k")
    assert quiet.exit_code == 0 and "readable by other users" not in quiet.output
    assert "token (admin), alice (operator)" in quiet.output
    assert "reads need no token" in quiet.output


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("missing.toml", None, "cannot read token file"),
        ("bad.json", '{"tokens": {', "is not valid JSON"),
        ("bad.toml", "[tokens.alice\nsecret = 1", "is not valid TOML"),
        (
            "role.toml",
            '[tokens.alice]\nsecret = "s3cret-value"\nrole = "boss"\n',
            "token 'alice': the role must be one of viewer, operator, admin",
        ),
        ("empty.toml", '[tokens.alice]\nsecret = ""\nrole = "viewer"\n', "the secret is empty"),
        (
            "dup.json",
            json.dumps(
                {
                    "tokens": {
                        "a": {"secret": "s3cret-value", "role": "viewer"},
                        "b": {"secret": _sha("s3cret-value"), "role": "admin"},
                    }
                }
            ),
            "the tokens 'a' and 'b' have one secret",
        ),
        (
            "hash.toml",
            '[tokens.alice]\nsecret = "sha256:s3cret-value"\nrole = "viewer"\n',
            "must go on with the 64 hex digits",
        ),
    ],
)
def test_a_bad_token_file_is_one_line_and_no_start(
    cli: Callable[..., Any], tmp_path: Path, name: str, content: str | None, needle: str
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    result = cli("--token-file", str(path))
    assert result.exit_code == 1 and result.started == []
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert "s3cret-value" not in result.output


def test_the_cli_refuses_auth_reads_without_tokens(cli: Callable[..., Any]) -> None:
    result = cli("--auth-reads")
    assert result.exit_code == 1 and result.started == []
    assert "need tokens" in result.output
