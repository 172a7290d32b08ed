"""Starting runs over HTTP: ``POST /api/workflows/{name}/runs`` on the console, through
Starlette's TestClient, on SQLite and on PostgreSQL. An operator's token starts (201); an
``Idempotency-Key`` repeated returns the run it started (200), finished or not, and a
concurrent repeat too (PostgreSQL, threads); a key that meets an open run is recorded in the
transaction that reads it (a prune racing it leaves no row naming a deleted run); no token, a
viewer's, a read-only console: 403;
an unknown workflow: 404; a bad body or key: 400 and nothing written; the audit entry names
the token (source ``web``)."""

from __future__ import annotations

import functools
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from sqlalchemy import event
from starlette.testclient import TestClient

from ductor_celery import Ductor, RunStatus, StepContext, Workflow
from ductor_celery.web import create_app
from ductor_celery.web.console import REQUEST_RETRY_S, STORE_UNAVAILABLE

TESTSERVER = "testserver"
TOKENS = {
    "vera": {"secret": "viewer-secret-7f3a", "role": "viewer"},
    "otto": {"secret": "operator-secret-91bc", "role": "operator"},
}
#: The tables a start writes to.
WRITTEN = ("eec_workflow_run", "eec_start_request", "eec_audit", "eec_workflow_timer")


@pytest.fixture(params=["sqlite", "postgresql"])
def d(request: pytest.FixtureRequest, tmp_path: Path) -> Ductor:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/starts.sqlite3"
    else:
        url = request.getfixturevalue("database_url")
    app = Celery(f"starts{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    app.conf.ductor_max_payload_bytes = 5000
    found = Ductor(app, database_url=url)
    if request.param == "sqlite":
        found.migrate()

    @found.step(name="starts.echo")
    def echo(ctx: StepContext, value: Any = None) -> Any:
        return value

    flow = Workflow("order")
    flow.step("a", echo, args={"value": "$.input"})
    flow.wait_signal("paid", signal="paid", after=["a"])
    found.register(flow)
    return found


@pytest.fixture
def api(d: Ductor) -> Iterator[TestClient]:
    with TestClient(create_app(d, tokens=TOKENS, allowed_hosts=[TESTSERVER])) as client:
        yield client


def _as(name: str | None, key: str | None = None) -> dict[str, str]:
    headers = {}
    if name is not None:
        headers["Authorization"] = f"Bearer {TOKENS[name]['secret']}"
    if key is not None:
        headers["Idempotency-Key"] = key
    return headers


def _counts(d: Ductor) -> dict[str, int]:
    with d.client.engine.connect() as conn:
        return {t: conn.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one() for t in WRITTEN}


def test_an_operator_starts_a_run_and_the_audit_names_the_token(d: Ductor, api: TestClient) -> None:
    answer = api.post(
        "/api/workflows/order/runs",
        json={"input": {"sku": "x-1"}, "workflow_id": "order-7"},
        headers=_as("otto"),
    )
    assert answer.status_code == 201, answer.text
    body = answer.json()
    assert body["workflow_id"] == "order-7" and set(body) == {"run_id", "workflow_id"}
    view = d.get(body["run_id"])
    assert view.workflow == "order" and view.input == {"sku": "x-1"}
    assert view.status == RunStatus.PENDING
    (entry,) = d.audit(body["run_id"]).entries
    assert (entry.actor, entry.action, entry.source) == ("otto", "start", "web")
    # Without a key: a plain start (no request row); the open run of the workflow id wins, 200.
    again = api.post(
        "/api/workflows/order/runs", json={"workflow_id": "order-7"}, headers=_as("otto")
    )
    assert again.status_code == 200 and again.json() == body
    assert _counts(d)["eec_start_request"] == 0


def test_an_empty_body_starts_with_no_input_and_a_delay_keeps_it_pending(
    d: Ductor, api: TestClient
) -> None:
    bare = api.post("/api/workflows/order/runs", headers=_as("otto"))
    assert bare.status_code == 201
    assert d.get(bare.json()["run_id"]).input is None
    later = api.post("/api/workflows/order/runs", json={"delay": 3600}, headers=_as("otto"))
    assert later.status_code == 201
    view = d.get(later.json()["run_id"])
    assert view.status == RunStatus.PENDING and view.start_at is not None


def test_a_start_over_http_takes_a_priority(d: Ductor, api: TestClient) -> None:
    answer = api.post("/api/workflows/order/runs", json={"priority": 8}, headers=_as("otto"))
    assert answer.status_code == 201
    with d.runtime.engine().connect() as conn:
        priority = conn.execute(
            sa.text("SELECT priority FROM eec_workflow_run WHERE run_id = :r"),
            {"r": answer.json()["run_id"]},
        ).scalar_one()
    assert priority == 8


def test_a_repeated_idempotency_key_returns_the_run_it_started_even_finished(
    d: Ductor, api: TestClient
) -> None:
    first = api.post("/api/workflows/order/runs", json={"input": 1}, headers=_as("otto", key="k-1"))
    assert first.status_code == 201
    run_id = first.json()["run_id"]
    again = api.post("/api/workflows/order/runs", json={"input": 2}, headers=_as("otto", key="k-1"))
    assert again.status_code == 200 and again.json() == first.json()
    d.terminate(run_id)
    assert d.get(run_id).status == RunStatus.TERMINATED
    after = api.post("/api/workflows/order/runs", json={"input": 3}, headers=_as("otto", key="k-1"))
    assert after.status_code == 200 and after.json() == first.json()
    assert len(d.list_runs(workflow="order")) == 1
    # Another key starts another run; the same key for another workflow is another request.
    other = api.post("/api/workflows/order/runs", headers=_as("otto", key="k-2"))
    assert other.status_code == 201 and other.json()["run_id"] != run_id
    counts = _counts(d)
    assert counts["eec_workflow_run"] == 2 and counts["eec_start_request"] == 2
    entries = [e for e in d.audit(limit=100).entries if e.action == "start"]
    assert len(entries) == 2
    assert {e.detail["request"]["key"] for e in entries} == {"k-1", "k-2"}


def test_a_key_that_met_an_open_run_is_that_runs_from_then_on(d: Ductor, api: TestClient) -> None:
    run_id = d.start("order", workflow_id="order-9").run_id
    met = api.post(
        "/api/workflows/order/runs", json={"workflow_id": "order-9"}, headers=_as("otto", "k")
    )
    assert met.status_code == 200 and met.json() == {"run_id": run_id, "workflow_id": "order-9"}
    d.terminate(run_id)
    again = api.post(
        "/api/workflows/order/runs", json={"workflow_id": "order-9"}, headers=_as("otto", "k")
    )
    assert again.status_code == 200 and again.json()["run_id"] == run_id


def _watch_open_run_reads(
    d: Ductor,
    request: pytest.FixtureRequest,
    workflow_id: str,
    on_read: Callable[[], None] | None = None,
) -> list[str]:
    """What the engine does from now on, in order: ``begin``/``commit``/``rollback``, the
    reads of the open run of ``workflow_id`` (``read``, calling ``on_read`` after the first)
    and the inserts into eec_start_request (``record``)."""
    seen: list[str] = []

    def statement(conn: Any, cursor: Any, sql: str, params: Any, context: Any, many: bool) -> None:
        values = params.values() if isinstance(params, dict) else params or ()
        if "FROM eec_workflow_run" in sql and "status IN" in sql and workflow_id in values:
            seen.append("read")
            if on_read is not None and seen.count("read") == 1:
                on_read()
        elif sql.lstrip().upper().startswith("INSERT INTO EEC_START_REQUEST"):
            seen.append("record")

    engine = d.client.engine
    listeners: list[tuple[str, Callable[..., None]]] = [
        ("after_cursor_execute", statement),
        ("begin", lambda conn: seen.append("begin")),
        ("commit", lambda conn: seen.append("commit")),
        ("rollback", lambda conn: seen.append("rollback")),
    ]
    for name, fn in listeners:
        event.listen(engine, name, fn)
        request.addfinalizer(functools.partial(event.remove, engine, name, fn))
    return seen


def test_a_key_that_met_an_open_run_is_recorded_in_the_transaction_that_read_it(
    d: Ductor, api: TestClient, request: pytest.FixtureRequest
) -> None:
    """No commit between the read of the open run and the request's row: a crash or a prune
    between the two cannot leave the key unrecorded after its answer, or naming a run gone."""
    run_id = d.start("order", workflow_id="order-5").run_id
    seen = _watch_open_run_reads(d, request, "order-5")
    met = api.post(
        "/api/workflows/order/runs", json={"workflow_id": "order-5"}, headers=_as("otto", "k5")
    )
    assert met.status_code == 200 and met.json()["run_id"] == run_id
    read = seen.index("read")
    assert "record" in seen[read:], seen
    between = seen[read : seen.index("record", read)]
    assert not {"begin", "commit", "rollback"} & set(between), seen
    assert seen[seen.index("record", read) + 1 :][:1] == ["commit"], seen


def test_a_prune_racing_a_key_that_met_an_open_run_never_leaves_its_row_dangling(
    d: Ductor, api: TestClient, request: pytest.FixtureRequest
) -> None:
    """PostgreSQL: the open run ends and a prune runs between the start's read of it and the
    request's row; the row must never name a deleted run (the read locks it until it commits;
    SQLite's BEGIN IMMEDIATE keeps every other writer out, so no prune can come between)."""
    if d.client.engine.dialect.name != "postgresql":
        pytest.skip("a prune on another connection mid-transaction: PostgreSQL")
    run_id = d.start("order", workflow_id="order-6").run_id
    engine = d.client.engine
    pruned: list[int] = []

    def end_and_prune() -> None:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE eec_workflow_run SET status = 'terminated', "
                    "finished_at = now() - interval '1 hour' WHERE run_id = :r"
                ),
                {"r": run_id},
            )
        pruned.append(d.prune(older_than=timedelta(0)))

    _watch_open_run_reads(d, request, "order-6", end_and_prune)
    met = api.post(
        "/api/workflows/order/runs", json={"workflow_id": "order-6"}, headers=_as("otto", "k6")
    )
    assert met.status_code == 200 and met.json()["run_id"] == run_id
    assert pruned == [0]  # the run was locked: the prune passed it by
    with engine.connect() as conn:
        dangling = conn.execute(
            sa.text(
                "SELECT count(*) FROM eec_start_request r WHERE NOT EXISTS "
                "(SELECT 1 FROM eec_workflow_run w WHERE w.run_id = r.run_id)"
            )
        ).scalar_one()
    assert dangling == 0 and _counts(d)["eec_start_request"] == 1
    # Once the start committed, the next prune takes the run and its key together.
    assert d.prune(older_than=timedelta(0)) == 1
    assert _counts(d)["eec_start_request"] == 0


def test_an_open_run_that_ends_before_it_is_looked_for_lets_the_start_insert_again(
    d: Ductor, api: TestClient
) -> None:
    """PostgreSQL: the insert meets the open run of the workflow id, which ends before the
    start looks for it: the start inserts again (201), never an error."""
    if d.client.engine.dialect.name != "postgresql":
        pytest.skip("a write on another connection mid-transaction: PostgreSQL")
    run_id = d.start("order", workflow_id="order-8").run_id
    engine = d.client.engine
    ended: list[str] = []

    def on_error(context: Any) -> None:
        if ended or "INSERT INTO eec_workflow_run" not in (context.statement or ""):
            return
        ended.append(run_id)
        with engine.begin() as conn:
            conn.execute(
                sa.text("UPDATE eec_workflow_run SET status = 'terminated' WHERE run_id = :r"),
                {"r": run_id},
            )

    event.listen(engine, "handle_error", on_error)
    try:
        answer = api.post(
            "/api/workflows/order/runs", json={"workflow_id": "order-8"}, headers=_as("otto", "k8")
        )
    finally:
        event.remove(engine, "handle_error", on_error)
    assert ended == [run_id]
    assert answer.status_code == 201, answer.text
    assert answer.json()["run_id"] != run_id and answer.json()["workflow_id"] == "order-8"


def test_prune_deletes_a_keys_row_with_its_run(d: Ductor, api: TestClient) -> None:
    run_id = api.post("/api/workflows/order/runs", headers=_as("otto", "old")).json()["run_id"]
    d.terminate(run_id)
    assert d.prune(older_than=0) == 1
    assert _counts(d)["eec_start_request"] == 0
    fresh = api.post("/api/workflows/order/runs", headers=_as("otto", "old"))
    assert fresh.status_code == 201 and fresh.json()["run_id"] != run_id


def test_a_database_outage_is_503_soon_without_the_drivers_text(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every connect refused (nothing listens on port 1): the start rides it out for
    REQUEST_RETRY_S, then answers 503 with a text of ours (the driver's goes to the log)."""
    app = Celery(f"starts{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    down = Ductor(app, database_url="postgresql+psycopg://ductor@127.0.0.1:1/gone")

    @down.step(name="starts.noop")
    def noop(ctx: StepContext) -> None:
        return None

    flow = Workflow("order")
    flow.step("a", noop)
    down.register(flow)
    began = time.monotonic()
    with TestClient(create_app(down, tokens=TOKENS, allowed_hosts=[TESTSERVER])) as client:
        answer = client.post("/api/workflows/order/runs", headers=_as("otto", "k-down"))
    assert answer.status_code == 503, answer.text
    assert answer.json() == {"error": STORE_UNAVAILABLE}
    assert time.monotonic() - began < REQUEST_RETRY_S + 20
    assert "127.0.0.1" in caplog.text


@pytest.mark.parametrize(
    ("who", "needle"),
    [(None, "Authorization: Bearer"), ("vera", "needs the role operator")],
)
def test_no_token_or_a_viewers_is_403_and_starts_nothing(
    d: Ductor, api: TestClient, who: str | None, needle: str
) -> None:
    before = _counts(d)
    answer = api.post("/api/workflows/order/runs", json={"input": 1}, headers=_as(who, "k"))
    assert answer.status_code == 403 and needle in answer.json()["error"]
    assert _counts(d) == before


def test_a_read_only_console_refuses_every_start(d: Ductor) -> None:
    with TestClient(create_app(d, allowed_hosts=[TESTSERVER])) as read_only:
        answer = read_only.post("/api/workflows/order/runs", headers=_as("otto"))
    assert answer.status_code == 403 and "read-only" in answer.json()["error"]
    assert _counts(d)["eec_workflow_run"] == 0


def test_an_unknown_workflow_is_404(d: Ductor, api: TestClient) -> None:
    answer = api.post("/api/workflows/nope/runs", json={}, headers=_as("otto", "k"))
    assert answer.status_code == 404 and "nope" in answer.json()["error"]
    assert all(n == 0 for n in _counts(d).values())


@pytest.mark.parametrize(
    ("body", "headers", "code", "needle"),
    [
        ("[1, 2]", {}, 400, "must be a JSON object, got list"),
        ('"input"', {}, 400, "must be a JSON object, got str"),
        ("{not json", {}, 400, "the body is not valid JSON"),
        ('{"input": NaN}', {}, 400, "NaN"),
        ("[" * 150 + "]" * 150, {}, 400, "nested too deeply"),
        ('{"input": ' + "[" * 101 + "]" * 101 + "}", {}, 400, "nested too deeply"),
        ('{"inputs": 1}', {}, 400, "a start takes no key 'inputs'"),
        ('{"workflow_id": 7}', {}, 400, "workflow_id must be a string"),
        ('{"workflow_id": ""}', {}, 400, "workflow_id must not be empty"),
        ('{"workflow_id": "' + "w" * 201 + '"}', {}, 400, "at most 200 characters"),
        ('{"delay": "60"}', {}, 400, "delay must be a number of seconds"),
        ('{"delay": -5}', {}, 400, "delay must be >= 0"),
        ('{"delay": true}', {}, 400, "delay must be a number of seconds"),
        ('{"delay": 1e12}', {}, 400, "delay"),
        ('{"priority": 10}', {}, 400, "priority must be an integer from 0 to 9"),
        ('{"priority": -1}', {}, 400, "priority must be an integer from 0 to 9"),
        ('{"priority": "5"}', {}, 400, "priority must be an integer from 0 to 9"),
        ('{"priority": true}', {}, 400, "priority must be an integer from 0 to 9"),
        ("{}", {"Idempotency-Key": "k" * 201}, 400, "Idempotency-Key must be at most 200"),
        ('{"input": "' + "x" * 6000 + '"}', {}, 413, "over ductor_max_payload_bytes"),
    ],
)
def test_a_bad_body_is_refused_naming_the_problem_and_writes_nothing(
    d: Ductor, api: TestClient, body: str, headers: dict[str, str], code: int, needle: str
) -> None:
    answer = api.post(
        "/api/workflows/order/runs",
        content=body.encode(),
        headers={**_as("otto"), "content-type": "application/json", **headers},
    )
    assert answer.status_code == code, answer.text
    assert needle in answer.json()["error"]
    assert all(n == 0 for n in _counts(d).values())


def test_concurrent_repeats_of_a_key_start_one_run(
    d: Ductor, api: TestClient, request: pytest.FixtureRequest
) -> None:
    if d.client.engine.dialect.name != "postgresql":
        pytest.skip("threads racing on one key: PostgreSQL (SQLite serializes every write)")
    app = api.app
    threads, barrier = 8, threading.Barrier(8)
    answers: list[tuple[int, str]] = []

    def post() -> None:
        with TestClient(app) as mine:
            barrier.wait()
            got = mine.post(
                "/api/workflows/order/runs", json={"input": 1}, headers=_as("otto", "race")
            )
            answers.append((got.status_code, got.json()["run_id"]))

    workers = [threading.Thread(target=post) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(60)
    assert len(answers) == threads
    assert sorted(code for code, _ in answers) == [200] * (threads - 1) + [201]
    assert len({run_id for _, run_id in answers}) == 1
    counts = _counts(d)
    assert counts["eec_workflow_run"] == 1 and counts["eec_start_request"] == 1
