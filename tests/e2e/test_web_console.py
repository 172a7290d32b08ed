"""The web console in a real headless browser: Debian's Chromium driven by Playwright, against
``ductor -A e2e_app web`` serving a cluster of real workers.

Playwright is pointed at /usr/bin/chromium (scripts/test installs the Debian package); it never
downloads a browser of its own.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster import ROOT_DIR, TESTS_DIR
from playwright import sync_api
from servers import free_port

pytestmark = pytest.mark.e2e

CHROMIUM = os.environ.get("DUCTOR_TEST_CHROMIUM", "/usr/bin/chromium")
TOKEN = "console-test-token"
#: A name the token console serves because it was started with --allowed-host.
ALLOWED = "console.test"
#: Another loopback address: the read-only console binds it, so it is served by that name.
OTHER_LOOPBACK = "127.0.0.2"
HOSTILE = "<img src=x onerror=alert(1)>"
SCREENSHOT = ROOT_DIR / "docs" / "console-run.png"

if not os.path.exists(CHROMIUM):  # scripts/test installs it; say so rather than skip quietly
    pytest.fail(f"no Chromium at {CHROMIUM}: run scripts/test (it installs chromium)")


class Console:
    """``ductor -A e2e_app web`` as a user starts it, on a free loopback port."""

    def __init__(self, cluster: Any, workdir: Path, *extra: str, host: str = "127.0.0.1") -> None:
        self.port = free_port()
        self.host = host
        self.url = f"http://{host}:{self.port}"
        self._log = open(workdir / f"console-{self.port}.log", "wb")  # noqa: SIM115
        exe = os.path.join(os.path.dirname(sys.executable), "ductor")
        self.proc = subprocess.Popen(
            [exe, "-A", "e2e_app", "web", "--host", host, "--port", str(self.port), *extra],
            cwd=TESTS_DIR,
            env=cluster.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/api/runs?limit=1", timeout=2):  # noqa: S310
                    return
            except urllib.error.HTTPError:  # an answer (401 where reads need a token): it is up
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the console did not start: {self.log()}") from None
                time.sleep(0.1)

    def log(self) -> str:
        return (Path(self._log.name).read_text(errors="replace"))[-3000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


@pytest.fixture(scope="module")
def console(shared_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    c = Console(
        shared_cluster,
        tmp_path_factory.mktemp("console"),
        "--token",
        TOKEN,
        "--allowed-host",
        ALLOWED,
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def read_only_console(
    shared_cluster: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Console]:
    c = Console(shared_cluster, tmp_path_factory.mktemp("console-ro"), host=OTHER_LOOPBACK)
    yield c
    c.stop()


#: The named tokens of the token-file console: a viewer's secret in the clear, an operator's
#: as its SHA-256.
VIEWER_SECRET, OPERATOR_SECRET = "vera-reads-only-4c1d", "otto-acts-9b7e"


@pytest.fixture(scope="module")
def token_file_console(
    shared_cluster: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Console]:
    workdir = tmp_path_factory.mktemp("console-tokens")
    path = workdir / "tokens.toml"
    digest = hashlib.sha256(OPERATOR_SECRET.encode()).hexdigest()
    path.write_text(
        f'[tokens.vera]\nsecret = "{VIEWER_SECRET}"\nrole = "viewer"\n\n'
        f'[tokens.otto]\nsecret = "sha256:{digest}"\nrole = "operator"\n'
    )
    path.chmod(0o600)
    c = Console(shared_cluster, workdir, "--token-file", str(path), "--auth-reads")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            # As root in a container Chromium's own sandbox cannot start.
            args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"],
        )
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh browser tab. Every test also checks that the console's own pages need nothing
    their Content-Security-Policy forbids (Chromium reports each blocked thing on the console)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(30_000)
    blocked = CSP_REPORTS[id(page)] = []
    page.on(
        "console",
        lambda m: blocked.append(m.text) if "Content Security Policy" in m.text else None,
    )
    yield page
    context.close()
    assert CSP_REPORTS.pop(id(page)) == []


#: What Chromium blocked under the console's CSP, per open page (a test that provokes it on
#: purpose reads and clears its list).
CSP_REPORTS: dict[int, list[str]] = {}


@pytest.fixture
def ductor(shared_cluster: Any, client_for: Any) -> Any:
    return client_for(shared_cluster)


def _log_in(page: Any, console: Console, next_path: str) -> None:
    page.goto(f"{console.url}/login?next={next_path}")
    page.fill("input[name=token]", TOKEN)
    page.click("form[action='/login'] button[type=submit]")
    page.wait_for_url(f"{console.url}{next_path}")


def test_nodes_turn_from_running_to_succeeded_on_an_open_page(
    ductor: Any, console: Console, page: Any, tmp_path: Path
) -> None:
    run_id = ductor.start("long_steps", input={"seconds": 2.5}).run_id
    page.goto(f"{console.url}/runs/{run_id}")
    page.evaluate("window.__not_reloaded = true")
    page.wait_for_selector('[data-node="slow_a"][data-status="running"]')
    assert page.get_attribute('[data-node="after"]', "data-status") == "pending"
    assert page.get_attribute("[data-run-status]", "data-run-status") == "running"
    shot = tmp_path / "console-run.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    if os.environ.get("DUCTOR_UPDATE_SCREENSHOTS") == "1":  # refresh the README's picture
        shutil.copyfile(shot, SCREENSHOT)
    page.wait_for_selector('[data-node="slow_a"][data-status="succeeded"]', timeout=30_000)
    page.wait_for_selector('[data-node="after"][data-status="succeeded"]', timeout=30_000)
    page.wait_for_selector('[data-run-status="succeeded"]', timeout=30_000)
    assert page.evaluate("window.__not_reloaded") is True  # updated in place
    # The panels followed too: the nodes table and the attempts of each node.
    assert "succeeded" in page.inner_text('[data-row-node="after"]')
    # Playwright's own polling: a string predicate is re-evaluated with eval() in the page,
    # which the console's Content-Security-Policy refuses (the test failed whenever the
    # third attempt was not on the page at its first look).
    sync_api.expect(page.locator("[data-attempt]")).to_have_count(3)


def test_approving_from_the_page_lets_the_run_finish(
    ductor: Any, console: Console, page: Any
) -> None:
    run_id = ductor.start("approvals").run_id
    _log_in(page, console, f"/runs/{run_id}")
    page.wait_for_selector('[data-node="review"][data-status="waiting"]')
    page.reload()  # the approval form is there once the node waits
    form = page.locator('form[data-approval="review"]')
    assert form.locator("input[name=by]").count() == 0  # who approves is who logged in
    form.locator("input[name=comment]").fill("looks right")
    form.locator("button[data-action=approve]").click()
    page.wait_for_selector("text=approved review")
    page.wait_for_selector('[data-node="review"][data-status="succeeded"]')
    for event in ("id_ok", "address_ok"):
        signal = page.locator("form.signal")
        signal.locator("input[name=name]").fill(event)
        signal.locator("input[name=payload]").fill('{"checked": true}')
        signal.locator("button[data-action=signal]").click()
        page.wait_for_selector(f"text=signal '{event}' sent")
    page.wait_for_selector('[data-run-status="succeeded"]', timeout=30_000)
    view = ductor.get(run_id)
    assert view.status == "succeeded"
    assert view.output["review"]["by"] == "token"  # --token's name
    assert view.output["review"]["comment"] == "looks right"
    # An action the run no longer allows: the client's InvalidOperation, shown on the page.
    status = page.evaluate(
        """async (csrf) => {
            const r = await fetch(location.pathname + '/actions/pause', {method: 'POST',
              headers: {'content-type': 'application/x-www-form-urlencoded'},
              body: 'csrf_token=' + encodeURIComponent(csrf)});
            return [r.status, await r.text()];
        }""",
        page.get_attribute("input[name=csrf_token]", "value"),
    )
    assert status[0] == 409 and "cannot pause run" in status[1]


def test_a_read_only_console_refuses_an_action(
    ductor: Any, read_only_console: Console, page: Any
) -> None:
    run_id = ductor.start("approvals").run_id
    page.goto(f"{read_only_console.url}/runs/{run_id}")
    page.wait_for_selector('[data-node="review"][data-status="waiting"]')
    assert "read-only" in page.inner_text("body")
    assert page.locator("[data-action]").count() == 0  # no buttons at all
    answers = page.evaluate(
        """async (token) => {
            const api = await fetch(location.pathname.replace('/runs/', '/api/runs/')
              + '/approve', {method: 'POST', headers: {'Authorization': 'Bearer ' + token,
              'content-type': 'application/json'}, body: JSON.stringify({node: 'review'})});
            const form = await fetch(location.pathname + '/actions/approve', {method: 'POST',
              headers: {'content-type': 'application/x-www-form-urlencoded'},
              body: 'node=review'});
            return [api.status, form.status];
        }""",
        TOKEN,
    )
    assert answers == [403, 403]
    assert ductor.get(run_id).nodes["review"].status == "waiting"
    ductor.terminate(run_id)


def test_named_tokens_with_roles_and_reads_that_need_one(
    ductor: Any, token_file_console: Console, page: Any
) -> None:
    """``ductor web --token-file F --auth-reads``: the run's page asks for a token first; a
    viewer reads it without a button; an operator (a hashed entry) approves, as himself."""
    console = token_file_console
    run_id = ductor.start("approvals").run_id
    answer = page.goto(f"{console.url}/runs/{run_id}")
    assert answer is not None and answer.status == 401
    assert page.locator("[data-node]").count() == 0 and page.locator("input[name=token]").count()
    assert page.evaluate("async () => (await fetch('/api/runs')).status") == 401
    page.fill("input[name=token]", VIEWER_SECRET)
    page.click("form[action='/login'] button[type=submit]")
    page.wait_for_url(f"{console.url}/runs/{run_id}")
    page.wait_for_selector('[data-node="review"][data-status="waiting"]')
    page.reload()
    assert page.get_attribute("[data-who]", "data-role") == "viewer"
    assert page.locator("[data-action]").count() == 0 and "reads only" in page.inner_text("body")
    page.click("form[action='/logout'] button[type=submit]")
    page.wait_for_selector("input[name=token]")  # reads need a token again: the login page
    page.fill("input[name=token]", OPERATOR_SECRET)
    page.click("form[action='/login'] button[type=submit]")
    page.goto(f"{console.url}/runs/{run_id}")
    assert page.get_attribute("[data-who]", "data-who") == "otto"
    page.locator('form[data-approval="review"] button[data-action=approve]').click()
    page.wait_for_selector("text=approved review")
    page.wait_for_selector('[data-node="review"][data-status="succeeded"]')
    assert ductor.get(run_id).nodes["review"].output["by"] == "otto"
    ductor.terminate(run_id)
    assert VIEWER_SECRET not in console.log() and OPERATOR_SECRET not in console.log()


def test_the_runs_list_filters_and_pages(ductor: Any, console: Console, page: Any) -> None:
    started = {ductor.start("chain10", input={"value": i}).run_id for i in range(5)}
    for run_id in started:
        ductor.wait(run_id, timeout=60)
    page.goto(console.url)
    page.select_option("select[name=status]", "succeeded")
    page.fill("input[name=workflow]", "chain10")
    page.fill("input[name=limit]", "2")
    page.click("form.filters button[type=submit]")
    page.wait_for_url(re.compile(r"workflow=chain10"))
    seen: list[str] = []
    for _ in range(5):
        rows = page.locator("tr[data-run-id]")
        ids = [rows.nth(i).get_attribute("data-run-id") for i in range(rows.count())]
        assert 1 <= len(ids) <= 2
        assert all(rows.nth(i).get_attribute("data-status") == "succeeded" for i in range(len(ids)))
        seen += ids
        if page.locator("[data-next-page]").count() == 0:
            break
        page.click("[data-next-page]")
        page.wait_for_url(re.compile(r"cursor="))
    assert sorted(seen) == sorted(started) and len(seen) == len(set(seen))
    assert page.inner_text('[data-count="succeeded"]').endswith("5")
    page.goto(f"{console.url}/?workflow=chain10&status=failed")
    assert page.locator("tr[data-run-id]").count() == 0
    page.goto(f"{console.url}/?limit=0")
    assert "limit must be between 1 and 1000" in page.inner_text("[data-error]")


def test_a_1000_branch_scatter_page_loads_in_under_a_second(
    ductor: Any, console: Console, page: Any
) -> None:
    run_id = ductor.start("scatter", input={"items": list(range(1000))}).run_id
    page.goto(f"{console.url}/runs/{run_id}")  # warm: the console's caches, the browser's
    page.wait_for_selector('[data-node="squares"][data-status="running"]')
    timings = []
    for _ in range(3):  # the best of three: the machine is shared and noisy
        began = time.monotonic()
        page.goto(f"{console.url}/runs/{run_id}", wait_until="load")
        timings.append(time.monotonic() - began)
    assert min(timings) < 1.0, timings
    # One element for the scatter, however many branches: never one per branch.
    assert page.locator("[data-node]").count() == 2
    assert page.locator("[data-attempt]").count() <= 50
    assert page.evaluate("document.getElementsByTagName('*').length") < 3000
    label = page.text_content('[data-node="squares"] .node-label') or ""
    assert "/1000 done" in label
    ductor.cancel(run_id)


# -- the console's defences, in the browser and over the real server ------------------------------


def _raw_get(console: Console, path: str, host: str) -> tuple[int, dict[str, str], str]:
    """A GET to the console with exactly this ``Host`` header (as a rebinding page's would be)."""
    conn = http.client.HTTPConnection(console.host, console.port, timeout=10)
    try:
        conn.putrequest("GET", path, skip_host=True)
        conn.putheader("Host", host)
        conn.endheaders()
        answer = conn.getresponse()
        headers = {k.lower(): v for k, v in answer.getheaders()}
        return answer.status, headers, answer.read().decode("utf-8", "replace")
    finally:
        conn.close()


def test_the_real_server_refuses_unknown_hosts_and_sends_the_headers(
    console: Console, read_only_console: Console
) -> None:
    port, other = console.port, read_only_console.port
    for host in (f"evil.example:{port}", "localhost.evil.example", f"{OTHER_LOOPBACK}:{port}"):
        status, headers, body = _raw_get(console, "/api/runs", host)
        assert status == 400 and "--allowed-host" in body, (host, status, body)
        assert "frame-ancestors 'none'" in headers["content-security-policy"]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", ALLOWED):
        status, headers, _ = _raw_get(console, "/api/runs", host)
        assert status == 200, host
    # Bound to another address, the console serves that name (and still the loopback names).
    assert _raw_get(read_only_console, "/", f"{OTHER_LOOPBACK}:{other}")[0] == 200
    assert _raw_get(read_only_console, "/", f"localhost:{other}")[0] == 200
    assert _raw_get(read_only_console, "/", ALLOWED)[0] == 400
    for path in ("/", "/api/runs", "/metrics", "/static/console.js", "/runs/nope", "/nope"):
        status, headers, _ = _raw_get(console, path, f"127.0.0.1:{port}")
        csp = headers.get("content-security-policy", "")
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp, (path, csp)
        assert headers.get("x-content-type-options") == "nosniff", path


def test_hostile_ids_in_links_run_no_script(ductor: Any, console: Console, page: Any) -> None:
    """A crafted link used to run script in the console's origin (issue 22): every page and
    fragment a link can open shows a hostile value as text, logged in or not."""
    run_id = ductor.start("approvals").run_id
    _log_in(page, console, f"/runs/{run_id}")
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    svg = '"><svg onload=alert(2)>'
    cases = [
        (f"/runs/{HOSTILE}/panels", 404, HOSTILE),
        (f"/runs/{HOSTILE}", 404, HOSTILE),
        (f"/runs/{HOSTILE}/live", 404, HOSTILE),
        (f"/api/runs/{HOSTILE}", 404, HOSTILE),
        (f"/runs/{HOSTILE}{'x' * 200}/panels", 400, "at most 200 characters"),
        (f"/runs/{svg}", 404, svg),
        (f"/runs/{run_id}?node={HOSTILE}", 200, None),
        (f"/runs/{run_id}/panels?node={HOSTILE}", 200, None),
        (f"/?workflow={HOSTILE}", 200, None),
        (f"/?workflow_id={svg}", 200, None),
        (f"/?status={HOSTILE}", 400, HOSTILE),
        (f"/?since={HOSTILE}", 400, HOSTILE),
        (f"/?limit={svg}", 400, svg[:30]),
        (f"/?cursor={HOSTILE}", 400, None),
        (f"/login?next={svg}", 200, None),
    ]
    for path, status, shown in cases:
        answer = page.goto(console.url + path)
        assert answer is not None and answer.status == status, (path, answer and answer.status)
        page.wait_for_timeout(100)  # time for an image's onerror, were one there
        assert dialogs == [], path
        if shown is not None:
            assert shown in page.inner_text("body"), path  # as text, not as markup
        assert page.locator("img, svg[onload]").count() == 0, path
    assert ductor.get(run_id).status == "running"
    ductor.terminate(run_id)


def test_a_script_that_slipped_into_a_page_would_not_run(
    ductor: Any, console: Console, page: Any
) -> None:
    """Defence in depth: were a template ever to miss an escape, the CSP still refuses inline
    script and event handlers."""
    run_id = ductor.start("approvals").run_id
    page.goto(f"{console.url}/runs/{run_id}")
    page.wait_for_selector('[data-node="review"][data-status="waiting"]')
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.evaluate(
        """() => {
            document.body.insertAdjacentHTML('beforeend', '<img src="x" onerror="alert(1)">');
            const s = document.createElement('script');
            s.textContent = 'alert(2)';
            document.body.appendChild(s);
        }"""
    )
    page.wait_for_timeout(300)
    assert dialogs == []
    reports = CSP_REPORTS[id(page)]
    assert reports and all("script-src 'self'" in r for r in reports), reports
    reports.clear()
    ductor.terminate(run_id)
