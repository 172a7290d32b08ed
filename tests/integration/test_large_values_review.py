"""Large values: the review's findings (docs/large-values.md), each through the real store and
the real step task (``local_workers``) on the embedded SQLite and on PostgreSQL."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from support import CONFIG, load_tick, tick_once
from test_large_values import _blob_rows, _ductor, _rows

from ductor_celery import RunConcurrency, RunStatus, StepContext, Workflow
from ductor_celery.definition.blobrefs import ref_of
from ductor_celery.store import run_slots
from ductor_celery.store.schema import blob, step_attempt, workflow_run


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/review.sqlite3"
    url: str = request.getfixturevalue("database_url")
    return url


def _age(d: Any, run_id: str, days: int = 30) -> None:
    with d.client.engine.begin() as conn:
        conn.execute(
            sa.update(workflow_run)
            .where(workflow_run.c.run_id == run_id)
            .values(finished_at=workflow_run.c.finished_at - timedelta(days=days))
        )


def test_a_batched_scatter_keeps_large_item_results_by_reference(db_url: str) -> None:
    d = _ductor(db_url, offload_bytes=1000)

    @d.step(name="review.big")
    def big(ctx: StepContext, item: int) -> str:
        return str(item) * 5000

    wf = Workflow("review_batched")
    wf.scatter("s", big, over="$.input", batch_size=2, max_parallel=2)
    wf.output("$.nodes.s.output")
    d.register(wf)
    with d.local_workers():
        view = d.wait(d.start("review_batched", input=[1, 2, 3]).run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED, view.error
    assert view.output == [str(i) * 5000 for i in (1, 2, 3)]
    # Each batch attempt's output is a list of references, one blob per large item.
    outputs = [
        r.output
        for r in _rows(
            d, sa.select(step_attempt.c.output).where(step_attempt.c.run_id == view.run_id)
        )
    ]
    refs = [ref_of(item) for out in outputs if isinstance(out, list) for item in out]
    assert len(refs) == 3 and all(r is not None for r in refs)
    assert {r.id for r in _blob_rows(d, view.run_id)} == {r.id for r in refs if r is not None}


def test_a_large_result_keeps_the_steps_tags(db_url: str) -> None:
    d = _ductor(db_url, offload_bytes=1000)

    @d.step(name="review.tagger")
    def tagger(ctx: StepContext) -> str:
        ctx.tag("customer", "acme")
        return "x" * 5000

    wf = Workflow("review_tagged")
    wf.step("tagger", tagger)
    d.register(wf)
    with d.local_workers():
        view = d.wait(d.start("review_tagged").run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED, view.error
    assert _blob_rows(d, view.run_id)  # the result went by reference
    assert view.tags == {"customer": "acme"}


def test_a_parent_whose_reference_a_child_holds_is_not_pruned_before_the_child(
    db_url: str,
) -> None:
    d = _ductor(db_url, offload_bytes=1000)

    @d.step(name="review.make")
    def make(ctx: StepContext) -> str:
        return "x" * 5000

    @d.step(name="review.use")
    def use(ctx: StepContext, data: str) -> int:
        return len(data)

    child = Workflow("review_child")
    child.checkpoint("started")
    child.wait_signal("go", signal="go", after=["started"])
    child.step("use", use, args={"data": "$.input"}, after=["go"])
    child.output("$.nodes.use.output")
    d.register(child)
    parent = Workflow("review_parent")
    parent.step("make", make)
    parent.subworkflow(
        "sub",
        workflow="review_child",
        input="$.nodes.make.output",
        until="started",
        parent_close="abandon",
        after=["make"],
    )
    d.register(parent)
    with d.local_workers():
        parent_id = d.start("review_parent").run_id
        assert d.wait(parent_id, timeout=60).status == RunStatus.SUCCEEDED
        [kid] = _rows(
            d,
            sa.select(workflow_run.c.run_id, workflow_run.c.input).where(
                workflow_run.c.parent_run_id == parent_id
            ),
        )
        held = ref_of(kid.input)
        assert held is not None  # the child's input is the parent's blob, by reference
        assert {r.id for r in _blob_rows(d, parent_id)} == {held.id}
        _age(d, parent_id)
        assert d.prune(older_than=timedelta(days=7)) == 0  # the child still needs the blob
        assert d.get(kid.run_id).input == "x" * 5000
        d.signal(kid.run_id, "go", None)
        done = d.wait(kid.run_id, timeout=60)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert done.output == 5000
    # Once the child is old too, the family goes: the child first, then its parent and blob.
    _age(d, kid.run_id)
    assert d.prune(older_than=timedelta(days=7)) == 2
    assert _blob_rows(d, parent_id) == []


def test_a_successor_holding_its_predecessors_reference_keeps_it(db_url: str) -> None:
    d = _ductor(db_url, offload_bytes=1000)
    seen: list[int] = []

    @d.step(name="review.measure")
    def measure(ctx: StepContext, data: str) -> int:
        seen.append(len(data))
        return len(data)

    wf = Workflow("review_carried")
    wf.wait_signal("go", signal="go")
    wf.step("measure", measure, args={"data": "$.input"}, after=["go"])
    wf.output("$.nodes.measure.output")
    d.register(wf)
    with d.local_workers():
        first = d.start("review_carried", input="z" * 5000).run_id
        d.continue_as_new(first)  # no input: the successor carries the first run's (a reference)
        deadline = time.monotonic() + 60
        while (view := d.get(first)).continued_to is None and time.monotonic() < deadline:
            time.sleep(0.1)
        successor = view.continued_to
        assert successor is not None, view.status
        held = ref_of(
            _rows(d, sa.select(workflow_run.c.input).where(workflow_run.c.run_id == successor))[
                0
            ].input
        )
        assert held is not None and {r.id for r in _blob_rows(d, first)} == {held.id}
        _age(d, first)
        assert d.prune(older_than=timedelta(days=7)) == 0  # kept while its successor exists
        d.signal(successor, "go", None)
        done = d.wait(successor, timeout=60)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert seen == [5000]


def test_a_paged_scatter_with_a_refused_branch_finishes(db_url: str) -> None:
    """Item 0's arguments are over max_payload_bytes: that branch fails alone (tolerated), and
    the scatter goes on to the next page instead of raising on every tick."""
    d = _ductor(db_url, offload_bytes=1000, max_payload_bytes=100_000)

    @d.step(name="review.echo")
    def echo(ctx: StepContext, a: Any, b: Any) -> int:
        return 1

    wf = Workflow("review_paged_refused")
    wf.scatter(
        "s",
        echo,
        over="$.input",
        item_arg=None,
        args={"a": "$.item", "b": "$.item"},
        max_parallel=1,
        tolerated_failures=5,
    )
    wf.output("$.nodes.s.output")
    d.register(wf)
    items = ["y" * 60_000] + ["s"] * 10
    with d.local_workers():
        view = d.wait(d.start("review_paged_refused", input=items).run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED, view.error
    assert view.output is not None
    assert view.output[0]["error"]["type"] == "PayloadTooLarge"
    assert view.output[1:] == [1] * 10


def test_several_scatters_over_one_offloaded_list_all_finish(db_url: str) -> None:
    d = _ductor(db_url, offload_bytes=1000)

    @d.step(name="review.double")
    def double(ctx: StepContext, item: int) -> int:
        return item * 2

    wf = Workflow("review_six")
    for k, at_once in enumerate([6, 5, 4, 3, 2, 1]):
        wf.scatter(f"s{k}", double, over="$.input", max_parallel=at_once)
    wf.output({f"s{k}": f"$.nodes.s{k}.output" for k in range(6)})
    d.register(wf)
    with d.local_workers():
        view = d.wait(d.start("review_six", input=list(range(400))).run_id, timeout=120)
    assert view.status == RunStatus.SUCCEEDED, view.error
    assert view.output == {f"s{k}": [i * 2 for i in range(400)] for k in range(6)}


def test_a_context_patch_may_be_up_to_1_mib_as_before_large_values(db_url: str) -> None:
    """The patch limit is 1 MiB (the old default of max_payload_bytes), not the offload
    threshold (256 KiB by default): a 600 KB patch is kept, a 1.1 MB one is refused."""
    d = _ductor(db_url)

    @d.step(name="review.remember")
    def remember(ctx: StepContext, size: int) -> int:
        ctx.patch({"note": "n" * size})
        return size

    @d.step(name="review.recall")
    def recall(ctx: StepContext, note: str) -> int:
        return len(note)

    wf = Workflow("review_patch")
    wf.step("remember", remember, args={"size": "$.input"})
    wf.step("recall", recall, args={"note": "$.context.note"}, after=["remember"])
    wf.output("$.nodes.recall.output")
    d.register(wf)
    with d.local_workers():
        kept = d.wait(d.start("review_patch", input=600_000).run_id, timeout=60)
        refused = d.wait(d.start("review_patch", input=1_100_000).run_id, timeout=60)
    assert kept.status == RunStatus.SUCCEEDED, kept.error
    assert kept.output == 600_000
    assert refused.status == RunStatus.FAILED
    error = refused.nodes["remember"].error
    assert error is not None and error["type"] == "InvalidResult"
    assert "over the context patch limit of 1048576 bytes" in error["message"]


def test_a_run_concurrency_key_is_read_from_the_slot_not_the_large_input_each_tick(
    db_url: str,
) -> None:
    """Admission reads the large input for the key once; later ticks take the key stored in
    the run's eec_run_slot row. The input's blob is deleted after admission to prove the load
    no longer reads it (it used to, on every tick: a DanglingReference here)."""
    d = _ductor(db_url, offload_bytes=1000)

    @d.step(name="review.noop")
    def noop(ctx: StepContext) -> None:
        return None

    wf = Workflow("review_keyed", concurrency=RunConcurrency("$.input.customer", 1))
    wf.step("noop", noop)
    spec = d.register(wf)
    handle = d.start("review_keyed", input={"customer": "acme", "pad": "p" * 5000})
    tick_once(d.client.engine, handle.run_id, lambda _h: spec)  # admitted: a slot row
    with d.client.engine.connect() as conn:
        assert run_slots.stored_key(conn, handle.run_id) == "review_keyed|acme"
    with d.client.engine.begin() as conn:
        conn.execute(sa.delete(blob).where(blob.c.run_id == handle.run_id))
    found = load_tick(d.client.engine, handle.run_id, lambda _h: spec, CONFIG)
    assert found is not None and found[0].concurrency_key == "review_keyed|acme"


def test_lists_of_runs_read_no_large_value_and_survive_a_dangling_one(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The console's runs page, GET /api/runs and ``ductor runs`` list with
    ``large_values=False``: a placeholder, no blob read, and a dangling reference in one run
    does not break the list. Python's ``list_runs`` still reads values by default."""
    from types import SimpleNamespace

    from click.testing import CliRunner
    from starlette.testclient import TestClient
    from test_large_values import TwoSteps

    from ductor_celery.cli import ductor as ductor_cli
    from ductor_celery.store import blobs
    from ductor_celery.web import create_app

    app = TwoSteps(db_url, offload_bytes=1000)
    app.d.app.conf.ductor_database_url = db_url
    ids = [app.run({"size": 5000}).run_id for _ in range(3)]
    assert app.d.list_runs().runs[0].output["made"]["text"] == "x" * 5000  # read by default

    reads: list[str] = []
    real_read = blobs.read

    def counting(conn: Any, ref: Any, held_by: str = "a value") -> Any:
        reads.append(ref.id)
        return real_read(conn, ref, held_by)

    monkeypatch.setattr(blobs, "read", counting)
    page = app.d.list_runs(large_values=False)
    assert reads == []
    [made] = {ref_of(v.nodes["make"].output) is None for v in page.runs}
    assert made  # not a reference either: a placeholder text
    assert all(
        v.nodes["make"].output.startswith("large value (") and v.output["made"] is not None
        for v in page.runs
    )

    with app.d.client.engine.begin() as conn:
        conn.execute(sa.delete(blob).where(blob.c.run_id == ids[0]))
    assert {v.run_id for v in app.d.list_runs(large_values=False).runs} == set(ids)
    with TestClient(create_app(app.d, allowed_hosts=["testserver"])) as client:
        listed = client.get("/api/runs")
        assert listed.status_code == 200, listed.text
        assert {r["run_id"] for r in listed.json()["runs"]} == set(ids)
        assert client.get("/").status_code == 200
    result = CliRunner().invoke(ductor_cli, ["runs", "--json"], obj=SimpleNamespace(app=app.d.app))
    assert result.exit_code == 0, result.output
    assert reads == []


def test_a_failed_blob_write_is_recorded_as_a_retryable_failure(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step's large result cannot be stored (the blob write raises): the attempt is
    recorded as failed and retried at once, instead of staying claimed until its timeout."""
    from ductor_celery import RetryPolicy
    from ductor_celery.runtime import large_values

    d = _ductor(db_url, offload_bytes=1000)
    real_write = large_values.blobs.write
    failures = [RuntimeError("disk full")]

    def flaky_write(conn: Any, run_id: str, value: Any, text: str | None = None) -> Any:
        if failures:
            raise failures.pop()
        return real_write(conn, run_id, value, text)

    monkeypatch.setattr(large_values.blobs, "write", flaky_write)

    @d.step(name="review.large")
    def large(ctx: StepContext) -> str:
        return "w" * 5000

    wf = Workflow("review_flaky")
    wf.step("large", large, retry=RetryPolicy(max_attempts=2, initial_interval=0.1))
    wf.output("$.nodes.large.output")
    d.register(wf)
    with d.local_workers():
        view = d.wait(d.start("review_flaky").run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED, view.error
    assert view.output == "w" * 5000
    rows = _rows(
        d,
        sa.select(step_attempt.c.attempt, step_attempt.c.outcome, step_attempt.c.error)
        .where(step_attempt.c.run_id == view.run_id)
        .order_by(step_attempt.c.attempt),
    )
    assert [r.outcome for r in rows] == ["failed", "succeeded"]
    assert rows[0].error["type"] == "LargeValueNotStored"
    assert "disk full" in rows[0].error["message"]


def test_no_door_lets_user_data_forge_a_reference(db_url: str) -> None:
    """A signal's payload and a continue-as-new's input are refused like a start's input
    (the first forge test covered start only), and nothing is written."""
    from ductor_celery import PayloadNotSerializable
    from ductor_celery.definition.blobrefs import REF_KEY
    from ductor_celery.store.schema import workflow_control, workflow_signal

    d = _ductor(db_url)
    wf = Workflow("review_forge")
    wf.wait_signal("s", signal="go")
    d.register(wf)
    run_id = d.start("review_forge").run_id
    forged = {REF_KEY: {"id": "0" * 32, "size": 1, "sha256": "0" * 64, "items": None}}
    reserved = rf"{REF_KEY}.* at \$\.b is reserved"
    with pytest.raises(PayloadNotSerializable, match=reserved):
        d.signal(run_id, "go", {"b": forged})
    with pytest.raises(PayloadNotSerializable, match=reserved):
        d.continue_as_new(run_id, input={"b": forged})
    assert _rows(d, sa.select(workflow_signal)) == []
    assert _rows(d, sa.select(workflow_control)) == []
