"""Signed webhooks (``ductor.webhook``, ``POST /hooks/<name>``) through Starlette's TestClient,
on SQLite and on PostgreSQL: a good signature starts a run with the body as its input (201); a
bad, missing, stale or future-dated one is 401 and writes nothing; a delivery sent three times
starts one run, and so do concurrent ones (threads, PostgreSQL); a signal hook signals once; the
secret is read when a delivery arrives; Stripe's and GitHub's schemes; prune; and a run a
webhook started finishing on workers (``local_workers``)."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from starlette.testclient import TestClient
from support import tick_once

from ductor_celery import Ductor, RunStatus, StepContext, Workflow
from ductor_celery.definition.webhooks import sign
from ductor_celery.web import create_app, hooks
from ductor_celery.web.console import REQUEST_RETRY_S, STORE_UNAVAILABLE

TESTSERVER = "testserver"
SECRET = "whsec_k8N2-\u00e9\u00df"  # non-ASCII: the key is the secret's UTF-8 bytes
#: The tables a delivery writes to.
WRITTEN = ("eec_workflow_run", "eec_workflow_signal", "eec_start_request", "eec_audit")


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/hooks.sqlite3"
    url: str = request.getfixturevalue("database_url")
    return url


class Secrets(dict[str, str]):
    """The secret provider: a dict whose entries a test may change between deliveries, and
    which counts how often it was asked."""

    reads = 0

    def __getitem__(self, name: str) -> str:
        self.reads += 1
        return super().__getitem__(name)


@pytest.fixture
def secrets() -> Secrets:
    return Secrets(shop_hook=SECRET)


@pytest.fixture
def d(db_url: str, secrets: Secrets) -> Ductor:
    app = Celery(f"hooks{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.ductor_secret_provider = secrets.__getitem__
    app.conf.ductor_max_payload_bytes = 5000
    found = Ductor(app, database_url=db_url)
    if db_url.startswith("sqlite"):
        found.migrate()

    @found.step(name="hooks.charge")
    def charge(ctx: StepContext, amount: int) -> dict[str, Any]:
        return {"charged": amount, "event": ctx.workflow_id}

    pay = Workflow("payment")
    pay.step("charge", charge, args={"amount": "$.input.data.amount"})
    pay.output("$.nodes.charge.output")
    found.register(pay)
    order = Workflow("order")
    order.wait_signal("paid", signal="paid")
    order.output("$.nodes.paid.output")
    found.register(order)
    found.webhook(
        "stripe", workflow="payment", secret="$.secret.shop_hook", workflow_id="$.body.id"
    )
    found.webhook("paid", signal="paid", target="$.body.order", secret="$.secret.shop_hook")
    return found


@pytest.fixture
def client(d: Ductor) -> Iterator[TestClient]:
    with TestClient(create_app(d, allowed_hosts=[TESTSERVER])) as found:
        yield found


def _counts(d: Ductor) -> dict[str, int]:
    with d.client.engine.connect() as conn:
        return {t: conn.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one() for t in WRITTEN}


def _deliver(
    client: TestClient,
    hook: str,
    body: Any,
    *,
    secret: str = SECRET,
    at: float | None = None,
    header: str | None = None,
    scheme: str = "ductor",
    headers: dict[str, str] | None = None,
) -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    name = {"ductor": "X-Ductor-Signature", "stripe": "Stripe-Signature"}.get(
        scheme, "X-Hub-Signature-256"
    )
    signature = header if header is not None else sign(secret, raw, at or time.time(), scheme)
    sent = {"content-type": "application/json", name: signature, **(headers or {})}
    return client.post(f"/hooks/{hook}", content=raw, headers=sent)


EVENT = {"id": "evt_1", "type": "charge.succeeded", "data": {"amount": 1250}}


def test_a_signed_delivery_starts_a_run_with_the_body_as_its_input(
    d: Ductor, client: TestClient
) -> None:
    answer = _deliver(client, "stripe", EVENT)
    assert answer.status_code == 201, answer.text
    body = answer.json()
    assert body["workflow_id"] == "evt_1" and set(body) == {"run_id", "workflow_id"}
    view = d.get(body["run_id"])
    assert view.workflow == "payment" and view.input == EVENT
    (entry,) = d.audit(body["run_id"]).entries
    assert (entry.actor, entry.action, entry.source) == ("stripe", "start", "web")
    assert entry.detail["request"] == {"scope": "hook:stripe", "key": "evt_1"}


def test_a_delivery_sent_three_times_starts_one_run_even_once_it_finished(
    d: Ductor, client: TestClient
) -> None:
    answers = [_deliver(client, "stripe", EVENT) for _ in range(3)]
    assert [a.status_code for a in answers] == [201, 200, 200]
    assert len({a.json()["run_id"] for a in answers}) == 1
    run_id = answers[0].json()["run_id"]
    d.terminate(run_id)
    late = _deliver(client, "stripe", {**EVENT, "retried": True})  # same id, other body
    assert late.status_code == 200 and late.json()["run_id"] == run_id
    counts = _counts(d)
    assert counts["eec_workflow_run"] == 1 and counts["eec_start_request"] == 1
    other = _deliver(client, "stripe", {**EVENT, "id": "evt_2"})
    assert other.status_code == 201 and other.json()["run_id"] != run_id


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"secret": "not-the-secret"}, "signature does not match the body"),
        ({"at": -360}, "s old: a signature is accepted within 300 s"),
        ({"at": +360}, "s ahead of this server's clock"),
        ({"header": "v1=abc"}, "must read 't=<unix time>,v1="),
        ({"header": "t=17e8,v1=abc"}, "must read 't=<unix time>,v1="),
        ({"header": "t=1,t=2,v1=abc"}, "must read 't=<unix time>,v1="),
        ({"header": ""}, "must read"),
    ],
)
def test_a_bad_stale_or_future_signature_is_401_and_writes_nothing(
    d: Ductor, client: TestClient, change: dict[str, Any], needle: str
) -> None:
    options = dict(change)
    if "at" in options:
        options["at"] = time.time() + options["at"]
    answer = _deliver(client, "stripe", EVENT, **options)
    assert answer.status_code == 401, answer.text
    assert needle in answer.json()["error"]
    assert "www-authenticate" in answer.headers
    assert all(n == 0 for n in _counts(d).values())


def test_a_missing_signature_or_a_body_changed_after_signing_is_401(
    d: Ductor, client: TestClient
) -> None:
    raw = json.dumps(EVENT).encode()
    bare = client.post("/hooks/stripe", content=raw)
    assert bare.status_code == 401 and "X-Ductor-Signature header is missing" in bare.text
    signature = sign(SECRET, raw, time.time())
    tampered = raw.replace(b"1250", b"9999")
    changed = client.post(
        "/hooks/stripe", content=tampered, headers={"X-Ductor-Signature": signature}
    )
    assert changed.status_code == 401 and "does not match" in changed.text
    # Within the window on either side, and a second (rotated) secret's signature beside it.
    now = time.time()
    stamp = int(now) - 240
    good = hmac.new(SECRET.encode(), f"{stamp}.".encode() + raw, hashlib.sha256).hexdigest()
    two = f"t={stamp},v1={'0' * 64},v1={good},v0=ignored"
    assert (
        client.post("/hooks/stripe", content=raw, headers={"X-Ductor-Signature": two}).status_code
        == 201
    )
    assert _counts(d)["eec_workflow_run"] == 1


class Clock:
    """``monotonic()`` as the hooks' secret cache reads it, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    found = Clock()
    monkeypatch.setattr(hooks, "monotonic", found)
    return found


def test_the_secret_is_read_when_a_delivery_arrives_and_kept_for_seconds(
    d: Ductor, client: TestClient, secrets: Secrets, clock: Clock
) -> None:
    secrets["shop_hook"] = "rotated-secret"
    assert _deliver(client, "stripe", EVENT).status_code == 401
    assert secrets.reads == 1  # read when the first delivery arrived, not before
    assert _deliver(client, "stripe", EVENT, secret="rotated-secret").status_code == 201
    assert secrets.reads == 1  # kept for SECRET_TTL_S
    del secrets["shop_hook"]
    clock.now += hooks.SECRET_TTL_S
    missing = _deliver(client, "stripe", {**EVENT, "id": "evt_3"}, secret="rotated-secret")
    assert missing.status_code == 503 and secrets.reads == 2
    assert "rotated-secret" not in missing.text
    assert _counts(d)["eec_workflow_run"] == 1
    secrets["shop_hook"] = SECRET
    clock.now += hooks.SECRET_TTL_S
    assert _deliver(client, "stripe", {**EVENT, "id": "evt_4"}).status_code == 201
    assert secrets.reads == 3


def test_a_flood_of_forged_deliveries_asks_the_provider_once_per_window(
    d: Ductor, client: TestClient, secrets: Secrets, clock: Clock
) -> None:
    for i in range(20):
        forged = _deliver(client, "stripe", {**EVENT, "id": f"evt_{i}"}, secret="guess")
        assert forged.status_code == 401
    assert secrets.reads == 1
    del secrets["shop_hook"]  # a failure is kept as long: the provider is not hammered either
    clock.now += hooks.SECRET_TTL_S
    for _ in range(5):
        assert _deliver(client, "stripe", EVENT).status_code == 503
    assert secrets.reads == 2 and all(n == 0 for n in _counts(d).values())


def test_a_secret_that_is_not_utf8_text_is_503_without_showing_it(
    d: Ductor, client: TestClient, secrets: Secrets, caplog: pytest.LogCaptureFixture
) -> None:
    # What os.environ holds for a variable set from bytes that are not UTF-8.
    secrets["shop_hook"] = "abc\udcffdef"
    answer = _deliver(client, "stripe", EVENT)
    assert answer.status_code == 503, answer.text
    assert answer.json() == {
        "error": "the webhook's secret is not available (see the console's log)"
    }
    assert "shop_hook" in caplog.text and "not UTF-8 text" in caplog.text
    assert "position" not in caplog.text and "udcff" not in caplog.text
    assert all(n == 0 for n in _counts(d).values())


def test_an_unexpected_error_before_authentication_is_500_without_its_text(
    d: Ductor, client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any) -> None:
        raise UnicodeEncodeError("utf-8", "s3cr\udcff", 4, 5, "surrogates not allowed")

    monkeypatch.setattr(hooks, "verify", broken)
    answer = _deliver(client, "stripe", EVENT)
    assert answer.status_code == 500
    assert answer.json() == {
        "error": "the delivery's signature could not be checked (see the console's log)"
    }
    assert all(n == 0 for n in _counts(d).values())


def test_a_database_outage_is_503_soon_without_the_drivers_text(
    secrets: Secrets, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing listens on port 1: every connect is refused, a transient error that the
    delivery rides out for REQUEST_RETRY_S (not the 60..120 s of a worker's retries), then
    answers 503 with a text of ours; the driver's (host, port) goes to the log only."""
    app = Celery(f"hooks{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.ductor_secret_provider = secrets.__getitem__
    down = Ductor(app, database_url="postgresql+psycopg://ductor@127.0.0.1:1/gone")
    down.webhook("pay", workflow="payment", secret="$.secret.shop_hook", workflow_id="$.body.id")
    began = time.monotonic()
    with TestClient(create_app(down, allowed_hosts=[TESTSERVER])) as client:
        answer = _deliver(client, "pay", EVENT)
    took = time.monotonic() - began
    assert answer.status_code == 503, answer.text
    assert answer.json() == {"error": STORE_UNAVAILABLE}
    assert took < REQUEST_RETRY_S + 20
    assert "127.0.0.1" in caplog.text and STORE_UNAVAILABLE in caplog.text


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"[1, 2]", "must be a JSON object, got an array"),
        (b'"evt"', "must be a JSON object, got a string"),
        (b"{nope", "the body is not valid JSON"),
        (b"\xff\xfe", "not UTF-8"),
        (b"[" * 120 + b"]" * 120, "nested too deeply"),
        (b'{"type": "x"}', "the body has no workflow id at $.body.id"),
        (b'{"id": {"nested": 1}}', "workflow id at $.body.id must be a string, got an object"),
        (b'{"id": ""}', "must not be empty"),
    ],
)
def test_a_signed_body_the_hook_cannot_use_is_400_and_writes_nothing(
    d: Ductor, client: TestClient, body: bytes, needle: str
) -> None:
    answer = _deliver(client, "stripe", body)
    assert answer.status_code == 400, answer.text
    assert needle in answer.json()["error"]
    assert all(n == 0 for n in _counts(d).values())


def test_an_integer_id_names_the_run_and_an_unknown_hook_is_404(
    d: Ductor, client: TestClient
) -> None:
    answer = _deliver(client, "stripe", {"id": 42, "data": {"amount": 1}})
    assert answer.status_code == 201 and answer.json()["workflow_id"] == "42"
    unknown = _deliver(client, "nope", EVENT)
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"]


def test_a_signal_hook_signals_once_per_delivery(d: Ductor, client: TestClient) -> None:
    run_id = d.start("order", workflow_id="order-1").run_id
    paid = {"order": "order-1", "amount": 10}
    answers = [_deliver(client, "paid", paid) for _ in range(3)]
    assert [a.status_code for a in answers] == [202, 200, 200]
    first = answers[0].json()
    assert first["run_id"] == run_id and first["workflow_id"] == "order-1"
    assert all(a.json() == first for a in answers)
    assert _counts(d)["eec_workflow_signal"] == 1
    for _ in range(5):
        tick_once(d.client.engine, run_id, d.runtime.spec_for)
    view = d.get(run_id)
    assert view.status == RunStatus.SUCCEEDED and view.output == paid
    # Once the run finished: a repeat is still 200; another body to it is refused (409).
    assert _deliver(client, "paid", paid).status_code == 200
    refused = _deliver(client, "paid", {**paid, "amount": 11})
    assert refused.status_code == 409
    unknown = _deliver(client, "paid", {"order": "order-404"})
    assert unknown.status_code == 404
    assert _counts(d)["eec_workflow_signal"] == 1
    (entry,) = [e for e in d.audit(run_id).entries if e.action == "signal"]
    assert (entry.actor, entry.source) == ("paid", "web")


def test_stripe_and_github_schemes(d: Ductor, client: TestClient) -> None:
    d.webhook(
        "stripe-native",
        workflow="payment",
        secret="$.secret.shop_hook",
        workflow_id="$.body.id",
        scheme="stripe",
    )
    d.webhook("gh", workflow="payment", secret="$.secret.shop_hook", scheme="github")
    striped = _deliver(client, "stripe-native", {**EVENT, "id": "evt_s"}, scheme="stripe")
    assert striped.status_code == 201
    push = {"ref": "refs/heads/main", "data": {"amount": 3}}
    raw = json.dumps(push).encode()
    delivered = _deliver(client, "gh", raw, scheme="github")
    assert delivered.status_code == 201
    assert _deliver(client, "gh", raw, scheme="github").status_code == 200  # same body
    forged = _deliver(client, "gh", raw, scheme="github", header="sha256=" + "0" * 64)
    assert forged.status_code == 401
    no_prefix = _deliver(client, "gh", raw, scheme="github", header="0" * 64)
    assert no_prefix.status_code == 401
    assert _counts(d)["eec_workflow_run"] == 2


def test_deliveries_need_no_token_where_reads_do(d: Ductor) -> None:
    tokens = {"vera": {"secret": "viewer-secret-7f3a", "role": "viewer"}}
    app = create_app(d, tokens=tokens, auth_reads=True, allowed_hosts=[TESTSERVER])
    with TestClient(app) as client:
        assert client.get("/api/runs").status_code == 401
        assert _deliver(client, "stripe", EVENT).status_code == 201


def test_prune_deletes_a_deliverys_row_with_its_run(d: Ductor, client: TestClient) -> None:
    run_id = _deliver(client, "stripe", EVENT).json()["run_id"]
    d.terminate(run_id)
    time.sleep(0.01)
    assert d.prune(older_than=0) == 1
    assert _counts(d)["eec_start_request"] == 0


def test_concurrent_duplicate_deliveries_start_one_run(d: Ductor, client: TestClient) -> None:
    if d.client.engine.dialect.name != "postgresql":
        pytest.skip("threads racing on one delivery: PostgreSQL (SQLite serializes writes)")
    app = client.app
    threads = 8
    barrier = threading.Barrier(threads)
    answers: list[tuple[int, str]] = []
    raw = json.dumps(EVENT).encode()
    signature = sign(SECRET, raw, time.time())
    paid_raw = json.dumps({"order": "order-c"}).encode()
    paid_signature = sign(SECRET, paid_raw, time.time())
    d.start("order", workflow_id="order-c")

    def post(hook: str, body: bytes, header: str) -> None:
        with TestClient(app) as mine:
            barrier.wait()
            got = mine.post(f"/hooks/{hook}", content=body, headers={"X-Ductor-Signature": header})
            answers.append((got.status_code, got.json()["run_id"]))

    for hook, body, header, first in [
        ("stripe", raw, signature, 201),
        ("paid", paid_raw, paid_signature, 202),
    ]:
        answers.clear()
        workers = [threading.Thread(target=post, args=(hook, body, header)) for _ in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join(60)
        assert sorted(code for code, _ in answers) == [200] * (threads - 1) + [first]
        assert len({run_id for _, run_id in answers}) == 1
    counts = _counts(d)
    assert counts["eec_workflow_run"] == 2  # the hook's run and order-c
    assert counts["eec_workflow_signal"] == 1 and counts["eec_start_request"] == 2


def test_a_run_a_webhook_started_finishes_on_workers(d: Ductor, client: TestClient) -> None:
    with d.local_workers():
        answer = _deliver(client, "stripe", EVENT)
        assert answer.status_code == 201
        view = d.wait(answer.json()["run_id"], timeout=60)
    assert view.status == RunStatus.SUCCEEDED
    assert view.output == {"charged": 1250, "event": "evt_1"}
