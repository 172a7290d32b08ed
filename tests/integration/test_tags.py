"""Run tags (docs/tags.md) through the real store and the real step task (``local_workers``),
on the embedded SQLite and on PostgreSQL: tags written with the start, filters with one and
several tags, a step's tags kept when its attempt succeeds and dropped when it fails, the
20-tag limits, continue-as-new and child runs, prune, bad input that writes nothing."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from ductor_celery import Ductor, RetryPolicy, RunStatus, StepContext, Workflow
from ductor_celery.cli.export import export_of
from ductor_celery.errors import ExportError, InvalidTag
from ductor_celery.store import runs
from ductor_celery.store.db import get_engine
from ductor_celery.store.export_format import read_export
from ductor_celery.store.exports import restore_rows
from ductor_celery.store.migrate import upgrade
from ductor_celery.store.schema import run_tag, workflow_run


@pytest.fixture(params=["sqlite", "postgresql"])
def d(request: pytest.FixtureRequest, tmp_path: Path) -> Ductor:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/tags.sqlite3"
    else:
        url = request.getfixturevalue("database_url")
    app = Celery(f"tags{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    found = Ductor(app, database_url=url)
    if request.param == "sqlite":
        found.migrate()

    @found.step(name="tags.echo")
    def echo(ctx: StepContext, value: Any = None) -> Any:
        return value

    @found.step(name="tags.flaky", retry=RetryPolicy(max_attempts=2, initial_interval=0.01))
    def flaky(ctx: StepContext, fail_always: bool = False) -> int:
        ctx.tag("attempt", f"a{ctx.attempt}")
        ctx.tag(f"only-a{ctx.attempt}", "yes")
        if fail_always or ctx.attempt == 1:
            raise RuntimeError(f"attempt {ctx.attempt} fails")
        return ctx.attempt

    @found.step(name="tags.many")
    def many(ctx: StepContext, keys: list[str]) -> int:
        for key in keys:
            ctx.tag(key, "v")
        return len(keys)

    @found.step(name="tags.bad", retry=RetryPolicy(max_attempts=3, initial_interval=0.01))
    def bad(ctx: StepContext) -> int:
        ctx.tag("k", "v" * 101)
        return 1

    bad_tag = Workflow("bad_tag")
    bad_tag.step("b", bad)
    found.register(bad_tag)

    plain = Workflow("plain")
    plain.step("a", echo, args={"value": "$.input"})
    plain.wait_signal("go", signal="go", after=["a"])
    found.register(plain)

    retried = Workflow("retried")
    retried.step("f", flaky, args={"fail_always": "$.input.fail_always"})
    found.register(retried)

    tagging = Workflow("tagging")
    tagging.step("m", many, args={"keys": "$.input.keys"})
    tagging.wait_signal("go", signal="go", after=["m"])
    tagging.subworkflow("child", workflow="plain", input={"x": 1}, after=["go"])
    found.register(tagging)
    return found


def _rows(d: Ductor, run_id: str) -> dict[str, str]:
    with d.client.engine.connect() as conn:
        found = conn.execute(
            sa.select(run_tag.c.key, run_tag.c.value).where(run_tag.c.run_id == run_id)
        )
        return dict(found.all())


def _ids(page: Any) -> set[str]:
    return {v.run_id for v in page}


def test_start_writes_the_tags_and_list_runs_filters_on_all_of_them(d: Ductor) -> None:
    eu = d.start("plain", tags={"customer": "c-1", "region": "eu"})
    us = d.start("plain", tags={"customer": "c-1", "region": "us"})
    other = d.start("plain", tags={"customer": "c-2", "region": "eu", "url": "a:b=c"})
    bare = d.start("plain")
    assert d.get(eu.run_id).tags == {"customer": "c-1", "region": "eu"}
    assert d.get(bare.run_id).tags == {}
    assert _rows(d, other.run_id) == {"customer": "c-2", "region": "eu", "url": "a:b=c"}
    assert _ids(d.list_runs(tags={"customer": "c-1"})) == {eu.run_id, us.run_id}
    assert _ids(d.list_runs(tags={"customer": "c-1", "region": "eu"})) == {eu.run_id}
    assert _ids(d.list_runs(tags={"region": "eu"})) == {eu.run_id, other.run_id}
    assert _ids(d.list_runs(tags={"url": "a:b=c"})) == {other.run_id}
    assert _ids(d.list_runs(tags={"customer": "c-3"})) == set()
    assert len(d.list_runs(tags={})) == 4  # an empty filter filters nothing
    # With the other filters and the keyset pages: one run a page, both found, then no more.
    first = d.list_runs(tags={"customer": "c-1"}, status="pending", limit=1)
    assert len(first) == 1 and first.next_cursor is not None
    second = d.list_runs(tags={"customer": "c-1"}, limit=1, cursor=first.next_cursor)
    assert len(second) == 1 and second.next_cursor is None
    assert _ids(first) | _ids(second) == {eu.run_id, us.run_id}
    assert {v.tags["region"] for v in (*first, *second)} == {"eu", "us"}


@pytest.mark.parametrize(
    ("tags", "message"),
    [
        ({"k": "v" * 101}, "tag value of 'k' must be 1..100 characters, it is 101"),
        ({"k" * 101: "v"}, "tag key 'kkkk"),
        ({"": "v"}, "tag key '' must be 1..100 characters, it is 0"),
        ({"k": ""}, "tag value of 'k' must be 1..100 characters, it is 0"),
        ({f"k{i}": "v" for i in range(21)}, "at most 20 tags per run, got 21"),
        ({"k": 5}, "tag value of 'k' must be a string, got int"),
        (["k", "v"], "tags must be a mapping of strings to strings, got list"),
        # Neither database stores NUL or a lone surrogate as text: refused before the insert.
        ({"k": "a\x00b"}, "tag value of 'k' must not contain NUL characters"),
        ({"k\x00": "v"}, "tag key must not contain NUL characters"),
        ({"k": "a\ud800"}, "tag value of 'k' must not contain lone surrogates"),
        ({"\udfff": "v"}, "tag key must not contain lone surrogates"),
    ],
)
def test_a_bad_tag_is_one_clear_error_and_nothing_is_written(
    d: Ductor, tags: Any, message: str
) -> None:
    with pytest.raises(ValueError) as caught:
        d.start("plain", tags=tags)
    assert str(caught.value).startswith("tags") and message in str(caught.value)
    with d.client.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(workflow_run)).scalar() == 0
        assert conn.execute(sa.select(sa.func.count()).select_from(run_tag)).scalar() == 0
    with pytest.raises(ValueError, match="tags filter"):
        d.list_runs(tags=tags)


def test_twenty_tags_are_fine(d: Ductor) -> None:
    tags = {f"k{i:02}": "x" * 100 for i in range(20)}
    handle = d.start("plain", tags=tags)
    assert d.get(handle.run_id).tags == tags == _rows(d, handle.run_id)


def test_a_step_tag_is_kept_when_its_attempt_succeeds_and_dropped_when_it_fails(
    d: Ductor,
) -> None:
    with d.local_workers():
        ok = d.start("retried", input={"fail_always": False}, tags={"customer": "c-1"})
        bad = d.start("retried", input={"fail_always": True}, tags={"customer": "c-1"})
        ok_view = d.wait(ok.run_id, timeout=60)
        bad_view = d.wait(bad.run_id, timeout=60)
    assert ok_view.status == RunStatus.SUCCEEDED, ok_view.error
    # Attempt 1 failed: its tags went with it; attempt 2's are the run's.
    expected = {"customer": "c-1", "attempt": "a2", "only-a2": "yes"}
    assert ok_view.tags == expected == _rows(d, ok.run_id)
    assert bad_view.status == RunStatus.FAILED
    assert bad_view.tags == {"customer": "c-1"} == _rows(d, bad.run_id)
    assert _ids(d.list_runs(tags={"attempt": "a2"})) == {ok.run_id}
    assert _ids(d.list_runs(tags={"attempt": "a1"})) == set()


def test_step_tags_past_twenty_are_dropped_and_said_so_the_attempt_succeeds(d: Ductor) -> None:
    start_tags = {f"s{i:02}": "v" for i in range(18)}
    keys = ["s00", "new-1", "new-2", "new-3", "new-4"]  # s00 is an update: not counted
    with d.local_workers():
        handle = d.start("tagging", input={"keys": keys}, tags=start_tags)
        deadline = time.monotonic() + 60
        while d.get(handle.run_id).nodes["m"].status != "succeeded":
            assert time.monotonic() < deadline, d.get(handle.run_id)
            time.sleep(0.05)
    view = d.get(handle.run_id)
    assert view.nodes["m"].output == 5
    assert view.tags == {**start_tags, "new-1": "v", "new-2": "v"}
    assert _rows(d, handle.run_id) == view.tags
    _, history = d.client.history(handle.run_id)
    reasons = [t.reason for t in history if t.node == "m"]
    assert "tag 'new-3' dropped: the run has 20 tags already" in reasons
    assert "tag 'new-4' dropped: the run has 20 tags already" in reasons


def test_ctx_tag_checks_at_the_call() -> None:
    ctx = StepContext(run_id="r", workflow_id="w", node="n", branch=None, attempt=1, context={})
    with pytest.raises(InvalidTag, match="tag value of 'k' must be 1..100 characters"):
        ctx.tag("k", "v" * 101)
    with pytest.raises(ValueError, match="tag key must be a string, got int"):
        ctx.tag(1, "v")  # type: ignore[arg-type]
    with pytest.raises(InvalidTag, match="must not contain NUL characters"):
        ctx.tag("k", "\x00")
    with pytest.raises(InvalidTag, match="must not contain lone surrogates"):
        ctx.tag("\ud800", "v")
    for i in range(20):
        ctx.tag(f"k{i}", "v")
    ctx.tag("k0", "again")  # a key it set already: replaced, not a 21st
    with pytest.raises(ValueError, match="at most 20 tags per run"):
        ctx.tag("k20", "v")
    # As they travel with the outcome: pairs in the order each key was first set.
    assert ctx.tags_value is not None and len(ctx.tags_value) == 20
    assert ctx.tags_value[:2] == [["k0", "again"], ["k1", "v"]]


def test_a_successor_keeps_the_tags_and_a_child_run_starts_without(d: Ductor) -> None:
    with d.local_workers():
        handle = d.start(
            "tagging", input={"keys": ["risk"]}, workflow_id="order-9", tags={"customer": "c-1"}
        )
        deadline = time.monotonic() + 60
        while d.get(handle.run_id).nodes["go"].status != "waiting":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        d.continue_as_new("order-9")
        successor = d.get("order-9")
        assert successor.run_id != handle.run_id
        assert successor.continued_from == handle.run_id
        assert successor.tags == {"customer": "c-1", "risk": "v"}
        assert _rows(d, successor.run_id) == successor.tags
        d.signal("order-9", "go")
        deadline = time.monotonic() + 60
        while d.get(successor.run_id).nodes["child"].status != "waiting":
            assert time.monotonic() < deadline, d.get(successor.run_id)
            time.sleep(0.05)
    children = [v for v in d.list_runs(workflow="plain") if v.parent_run_id == successor.run_id]
    assert len(children) == 1 and children[0].tags == {}
    assert _ids(d.list_runs(tags={"customer": "c-1"})) == {handle.run_id, successor.run_id}


def test_prune_deletes_a_runs_tags_with_it(d: Ductor) -> None:
    with d.local_workers():
        gone = d.start("retried", input={"fail_always": False}, tags={"customer": "c-1"})
        d.wait(gone.run_id, timeout=60)
    kept = d.start("plain", tags={"customer": "c-1"})  # open: never pruned
    time.sleep(0.05)
    assert d.prune(timedelta(seconds=0.01)) == 1
    assert _rows(d, gone.run_id) == {}
    assert _rows(d, kept.run_id) == {"customer": "c-1"}
    assert _ids(d.list_runs(tags={"customer": "c-1"})) == {kept.run_id}


def test_a_start_in_the_callers_transaction_writes_its_tags_with_it(d: Ductor) -> None:
    engine = d.client.engine
    with engine.connect() as conn:
        with conn.begin() as transaction:
            dropped = d.start("plain", tags={"customer": "gone"}, connection=conn)
            transaction.rollback()
        with conn.begin():
            kept = d.start("plain", tags={"customer": "c-7"}, connection=conn)
    assert _rows(d, dropped.run_id) == {}
    assert _rows(d, kept.run_id) == {"customer": "c-7"} == d.get(kept.run_id).tags
    assert _ids(d.list_runs(tags={"customer": "c-7"})) == {kept.run_id}


def test_a_redrive_keeps_the_tags_and_the_rerun_adds_its_own(d: Ductor) -> None:
    with d.local_workers():
        handle = d.start("retried", input={"fail_always": True}, tags={"customer": "c-1"})
        assert d.wait(handle.run_id, timeout=60).status == RunStatus.FAILED
        # The same run again, from the top of ``f``, with input it succeeds on.
        d.redrive(handle.run_id, input={"fail_always": False})
        view = d.wait(handle.run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED, view.error
    # A fresh retry budget: the rerun's attempt 1 fails (its tags dropped), attempt 2 succeeds.
    assert view.tags == {"customer": "c-1", "attempt": "a2", "only-a2": "yes"}
    assert _rows(d, handle.run_id) == view.tags


def test_a_bad_ctx_tag_fails_its_attempt_without_retry_naming_the_tag(d: Ductor) -> None:
    with d.local_workers():
        handle = d.start("bad_tag", tags={"customer": "c-1"})
        view = d.wait(handle.run_id, timeout=60)
    assert view.status == RunStatus.FAILED
    node = view.nodes["b"]
    assert node.attempts == 1  # the same call would fail the same way: no retry
    assert node.error is not None and node.error["type"] == "InvalidTag"
    assert "tag value of 'k' must be 1..100 characters, it is 101" in node.error["message"]
    assert view.tags == {"customer": "c-1"}


def test_an_export_carries_the_tags_and_a_restore_indexes_them(d: Ductor, tmp_path: Path) -> None:
    handle = d.start("plain", tags={"customer": "c-1", "region": "eu"})
    document = export_of(d, handle.run_id)
    assert document["tags"] == {"customer": "c-1", "region": "eu"}
    url = f"sqlite:///{tmp_path}/restored.sqlite3"
    upgrade(url)
    elsewhere = get_engine(url)
    restore_rows(elsewhere, read_export(document).rows, "the export")
    found, _ = runs.list_runs(elsewhere, where=runs.RunFilter(tags=(("customer", "c-1"),)))
    assert [r.run_id for r in found] == [handle.run_id]
    # A state whose tags no run could have: one clear error, nothing written.
    document["run"]["state"]["tags"] = {f"k{i}": "v" for i in range(21)}
    document["run"]["run_id"] = "other"
    with pytest.raises(ExportError, match="at most 20 tags per run, got 21"):
        restore_rows(elsewhere, read_export(document).rows, "the export")
    assert runs.find_run(elsewhere, "other") is None


def test_an_export_holds_each_attempts_tags(d: Ductor) -> None:
    """The tags a succeeded attempt set travel with it in the export (a failed attempt's are
    dropped, not written); an export written before attempts carried them still loads
    (test_export_format)."""
    with d.local_workers():
        handle = d.start("retried", input={"fail_always": False})
        assert d.wait(handle.run_id, timeout=60).status == RunStatus.SUCCEEDED
    attempts = export_of(d, handle.run_id)["attempts"]
    assert [a["tags"] for a in attempts] == [None, [["attempt", "a2"], ["only-a2", "yes"]]]
    assert [a["tags"] for a in read_export(export_of(d, handle.run_id)).rows.attempts] == [
        a["tags"] for a in attempts
    ]
