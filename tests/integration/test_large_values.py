"""Large values by reference (docs/large-values.md) through the real store and the real step
task (``local_workers``), on the embedded SQLite and on PostgreSQL: a value over
``ductor_offload_bytes`` is stored once in ``eec_blob`` and only its reference is in the row;
steps and views see the value; a scatter pages an offloaded list; prune deletes blobs; a
dangling reference is an error that names it."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from support import CONFIG, load_tick

from ductor_celery import (
    DanglingReference,
    Ductor,
    PayloadNotSerializable,
    PayloadTooLarge,
    RunConcurrency,
    RunStatus,
    StepContext,
    Workflow,
)
from ductor_celery.definition.blobrefs import REF_KEY, ref_of
from ductor_celery.store import blobs, run_slots
from ductor_celery.store.schema import (
    blob,
    step_attempt,
    workflow_run,
    workflow_signal,
)

MIB = 1024 * 1024


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/large.sqlite3"
    url: str = request.getfixturevalue("database_url")
    return url


def _ductor(url: str, **conf: Any) -> Ductor:
    app = Celery(f"large{id(conf)}", set_as_current=False)
    for key, value in conf.items():
        app.conf[f"ductor_{key}"] = value
    d = Ductor(app, database_url=url)
    if url.startswith("sqlite"):
        d.migrate()
    return d


def _rows(d: Ductor, query: Any) -> list[Any]:
    with d.client.engine.connect() as conn:
        return list(conn.execute(query))


def _blob_rows(d: Ductor, run_id: str) -> list[Any]:
    return _rows(d, sa.select(blob).where(blob.c.run_id == run_id).order_by(blob.c.id, blob.c.seq))


class TwoSteps:
    """``make`` returns a text of ``size`` characters (and a small tag); ``measure`` gets the
    whole output and reports its length and the text's head; the run outputs both."""

    def __init__(self, url: str, **conf: Any) -> None:
        self.d = _ductor(url, **conf)
        self.seen: list[Any] = []

        @self.d.step(name="large.make")
        def make(ctx: StepContext, size: int) -> dict[str, Any]:
            return {"text": "x" * size, "tag": "made"}

        @self.d.step(name="large.measure")
        def measure(ctx: StepContext, made: dict[str, Any], tag: str) -> dict[str, Any]:
            self.seen.append(made)
            return {"length": len(made["text"]), "tag": tag, "input_size": ctx.input["size"]}

        wf = Workflow("two_steps")
        wf.step("make", make, args={"size": "$.input.size"})
        # ``made`` takes the whole output (its reference travels); ``tag`` reads inside it.
        wf.step(
            "measure",
            measure,
            args={"made": "$.nodes.make.output", "tag": "$.nodes.make.output.tag"},
            after=["make"],
        )
        wf.output({"measured": "$.nodes.measure.output", "made": "$.nodes.make.output"})
        self.d.register(wf)

    def run(self, run_input: Any) -> Any:
        with self.d.local_workers():
            handle = self.d.start("two_steps", input=run_input)
            return self.d.wait(handle.run_id, timeout=120)


def test_a_5_mib_output_is_stored_once_and_seen_by_the_next_step_and_the_view(db_url: str) -> None:
    app = TwoSteps(db_url)
    size = 5 * MIB
    view = app.run({"size": size})
    assert view.status == RunStatus.SUCCEEDED, view.error
    assert app.seen[0]["text"] == "x" * size and app.seen[0]["tag"] == "made"
    assert view.nodes["measure"].output == {"length": size, "tag": "made", "input_size": size}
    assert view.nodes["make"].output["text"] == "x" * size
    assert view.output["made"]["text"] == "x" * size
    attempts = {
        r.node: r
        for r in _rows(app.d, sa.select(step_attempt).where(step_attempt.c.run_id == view.run_id))
    }
    made = ref_of(attempts["make"].output)
    assert made is not None and made.size > size
    # The next step's arguments and the run's output hold the reference, never the value.
    assert attempts["measure"].args["made"] == attempts["make"].output
    run = _rows(app.d, sa.select(workflow_run).where(workflow_run.c.run_id == view.run_id))[0]
    assert run.output["made"] == attempts["make"].output
    stored = _blob_rows(app.d, view.run_id)
    assert {r.id for r in stored} == {made.id}  # stored once
    assert len(stored) == 6  # 5 MiB and a little, in chunks of at most 1 MiB
    assert max(len(r.data) for r in stored) <= 1024 * 1024


def test_a_value_just_under_the_threshold_stays_inline_and_just_over_is_offloaded(
    db_url: str,
) -> None:
    app = TwoSteps(db_url, offload_bytes=1000)
    # {"text": "x...x", "tag": "made"}: 27 bytes around the text.
    overhead = len(json.dumps({"text": "", "tag": "made"}, ensure_ascii=False))
    under = app.run({"size": 1000 - overhead})
    over = app.run({"size": 1001 - overhead})
    outputs = {}
    for view in (under, over):
        assert view.status == RunStatus.SUCCEEDED, view.error
        row = _rows(
            app.d,
            sa.select(step_attempt.c.output).where(
                step_attempt.c.run_id == view.run_id, step_attempt.c.node == "make"
            ),
        )[0]
        outputs[view.run_id] = row.output
    assert ref_of(outputs[under.run_id]) is None and outputs[under.run_id]["tag"] == "made"
    assert ref_of(outputs[over.run_id]) is not None
    # The small run's blobs are the measure step's arguments (the inline output and its tag,
    # together over the threshold) and its output: none holds the make step's output alone.
    run = _rows(
        app.d, sa.select(workflow_run.c.output).where(workflow_run.c.run_id == under.run_id)
    )
    args = _rows(
        app.d,
        sa.select(step_attempt.c.args).where(
            step_attempt.c.run_id == under.run_id, step_attempt.c.node == "measure"
        ),
    )
    expected = {ref_of(run[0].output), ref_of(args[0].args)}
    assert None not in expected
    assert {r.id for r in _blob_rows(app.d, under.run_id)} == {r.id for r in expected if r}
    assert over.nodes["measure"].output["length"] == 1001 - overhead


def test_input_signal_payload_and_run_output_are_offloaded(db_url: str) -> None:
    d = _ductor(db_url, offload_bytes=2000)

    @d.step(name="large.echo")
    def echo(ctx: StepContext, data: list[int], note: str) -> dict[str, Any]:
        return {"sum": sum(data), "note": note, "copy": data}

    wf = Workflow("io")
    wf.wait_signal("approve", signal="go")
    wf.step(
        "echo",
        echo,
        args={"data": "$.input.data", "note": "$.nodes.approve.output.note"},
        after=["approve"],
    )
    wf.output("$.nodes.echo.output")
    d.register(wf)
    data = list(range(1000))
    note = "n" * 3000
    with d.local_workers():
        handle = d.start("io", input={"data": data})
        d.signal(handle.run_id, "go", {"note": note})
        view = d.wait(handle.run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED, view.error
    assert view.input == {"data": data}
    assert view.output == {"sum": sum(data), "note": note, "copy": data}
    assert view.nodes["approve"].output == {"note": note}
    run = _rows(d, sa.select(workflow_run).where(workflow_run.c.run_id == handle.run_id))[0]
    signal = _rows(d, sa.select(workflow_signal).where(workflow_signal.c.run_id == handle.run_id))
    assert ref_of(run.input) is not None
    assert ref_of(run.output) is not None
    assert ref_of(signal[0].payload) is not None
    # The step's arguments read inside the input and the payload: the tick offloaded them
    # again as its own value (a path into a large value resolves to the value).
    args = _rows(d, sa.select(step_attempt.c.args).where(step_attempt.c.run_id == handle.run_id))
    assert ref_of(args[0].args) is not None
    # The run's output is the echo step's output: its reference, the same blob.
    output = _rows(
        d,
        sa.select(step_attempt.c.output).where(
            step_attempt.c.run_id == handle.run_id, step_attempt.c.node == "echo"
        ),
    )
    assert run.output == output[0].output
    # input, payload, arguments, output: each stored once.
    assert len({r.id for r in _blob_rows(d, handle.run_id)}) == 4


def test_a_value_over_max_payload_is_refused_by_name_and_nothing_is_written(db_url: str) -> None:
    d = _ductor(db_url, offload_bytes=1000, max_payload_bytes=100_000)

    @d.step(name="large.big")
    def big(ctx: StepContext) -> str:
        return "y" * 200_000

    wf = Workflow("big")
    wf.step("big", big)
    d.register(wf)
    with pytest.raises(
        PayloadTooLarge, match="input of workflow 'big' is .* over ductor_max_payload_bytes"
    ):
        d.start("big", input={"text": "z" * 150_000})
    assert _rows(d, sa.select(workflow_run)) == []
    assert _rows(d, sa.select(blob)) == []
    with d.local_workers():
        handle = d.start("big", input=None)
        view = d.wait(handle.run_id, timeout=60)
    assert view.status == RunStatus.FAILED
    assert "result is 200002 bytes, over ductor_max_payload_bytes=100000" in str(view.error)
    assert _rows(d, sa.select(blob)) == []


def test_user_data_cannot_forge_a_reference(db_url: str) -> None:
    d = _ductor(db_url)
    wf = Workflow("forge")
    wf.wait_signal("s", signal="go")
    d.register(wf)
    forged = {REF_KEY: {"id": "0" * 32, "size": 1, "sha256": "0" * 64, "items": None}}
    with pytest.raises(PayloadNotSerializable, match=rf"{REF_KEY}.* at \$\.a\[1\] is reserved"):
        d.start("forge", input={"a": [1, forged]})
    assert _rows(d, sa.select(workflow_run)) == []


def test_a_scatter_over_an_offloaded_list_reads_only_the_pages_it_dispatches(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = _ductor(db_url, offload_bytes=1000)

    @d.step(name="large.double")
    def double(ctx: StepContext, item: dict[str, Any]) -> int:
        return int(item["n"]) * 2

    wf = Workflow("paged")
    wf.scatter("double", double, over="$.input", item_arg="item", max_parallel=7)
    wf.output("$.nodes.double.output")
    d.register(wf)
    # About 700 KB: the list is cut into several 256 KiB chunks, so pages come from
    # different chunks.
    items = [{"n": i, "pad": "p" * 200} for i in range(3000)]
    pages: list[tuple[int, int]] = []
    whole: list[str] = []
    fetched: list[int] = []  # chunks fetched for pages
    read_items, read, chunks = blobs.read_items, blobs.read, blobs._chunks

    def counting_items(conn: Any, ref: Any, start: int, stop: int) -> Any:
        pages.append((start, stop))
        return read_items(conn, ref, start, stop)

    def counting_read(conn: Any, ref: Any, held_by: str = "") -> Any:
        whole.append(ref.id)
        return read(conn, ref, held_by)

    def counting_chunks(conn: Any, ref: Any, where: Any = None) -> Any:
        found = chunks(conn, ref, where)
        if where is not None:
            fetched.append(len(found))
        return found

    monkeypatch.setattr(blobs, "_chunks", counting_chunks)
    monkeypatch.setattr(blobs, "read_items", counting_items)
    monkeypatch.setattr(blobs, "read", counting_read)
    with d.local_workers():
        handle = d.start("paged", input=items)
        view = d.wait(handle.run_id, timeout=120)
    assert view.status == RunStatus.SUCCEEDED, view.error
    assert view.output == [i * 2 for i in range(3000)]
    run = _rows(d, sa.select(workflow_run).where(workflow_run.c.run_id == handle.run_id))[0]
    ref = ref_of(run.input)
    assert ref is not None and ref.items == 3000
    input_chunks = [r for r in _blob_rows(d, handle.run_id) if r.id == ref.id]
    assert len(input_chunks) >= 3
    assert pages and all(stop - start <= 7 for start, stop in pages)
    # Hundreds of ticks, yet each chunk is fetched about once (parsed chunks are kept).
    assert len(pages) > 100 and sum(fetched) <= 2 * len(input_chunks)
    # The ticks never read the whole list; only the view (the run's input) does.
    assert whole.count(ref.id) <= 1


def test_prune_deletes_a_runs_blobs(db_url: str) -> None:
    app = TwoSteps(db_url, offload_bytes=1000)
    kept = app.run({"size": 5000})
    pruned = app.run({"size": 5000})
    assert _blob_rows(app.d, pruned.run_id)
    with app.d.client.engine.begin() as conn:
        conn.execute(
            sa.update(workflow_run)
            .where(workflow_run.c.run_id == pruned.run_id)
            .values(finished_at=workflow_run.c.finished_at - timedelta(days=30))
        )
    assert app.d.prune(older_than=timedelta(days=7)) == 1
    assert _blob_rows(app.d, pruned.run_id) == []
    assert _blob_rows(app.d, kept.run_id)
    assert app.d.get(kept.run_id).nodes["make"].output["text"] == "x" * 5000


def test_a_dangling_reference_is_an_error_that_names_it(db_url: str) -> None:
    app = TwoSteps(db_url, offload_bytes=1000)
    view = app.run({"size": 5000})
    output = _rows(
        app.d,
        sa.select(step_attempt.c.output).where(
            step_attempt.c.run_id == view.run_id, step_attempt.c.node == "make"
        ),
    )[0].output
    ref = ref_of(output)
    assert ref is not None
    with app.d.client.engine.begin() as conn:
        conn.execute(sa.delete(blob).where(blob.c.id == ref.id))
    with pytest.raises(
        DanglingReference, match=f"blob {ref.id} referenced by the output of node 'make'"
    ):
        app.d.get(view.run_id)


def test_a_run_concurrency_key_reads_inside_a_large_input(db_url: str) -> None:
    d = _ductor(db_url, offload_bytes=1000)

    @d.step(name="large.noop")
    def noop(ctx: StepContext) -> None:
        return None

    wf = Workflow("keyed", concurrency=RunConcurrency("$.input.customer", 1))
    wf.step("noop", noop)
    spec = d.register(wf)
    run_input = {"customer": "acme", "pad": "p" * 5000}
    handle = d.start("keyed", input=run_input)  # no workers: it stays pending
    run = _rows(d, sa.select(workflow_run.c.input).where(workflow_run.c.run_id == handle.run_id))
    assert ref_of(run[0].input) is not None
    found = load_tick(d.client.engine, handle.run_id, lambda _h: spec, CONFIG)
    assert found is not None
    assert spec.concurrency is not None
    # The key of the value inside the input, as an inline input gives it (not of a null).
    expected = run_slots.key_for("keyed", spec.concurrency, run_input)
    assert expected == "keyed|acme" and found[0].concurrency_key == expected


def test_a_step_result_cannot_forge_a_reference(db_url: str) -> None:
    d = _ductor(db_url)

    @d.step(name="large.forger")
    def forger(ctx: StepContext) -> Any:
        return {"ok": [{REF_KEY: {"id": "0" * 32, "size": 1, "sha256": "0" * 64}}]}

    wf = Workflow("forger")
    wf.step("forger", forger)
    d.register(wf)
    with d.local_workers():
        view = d.wait(d.start("forger").run_id, timeout=60)
    assert view.status == RunStatus.FAILED
    assert f"{REF_KEY}' at $.ok[0] is reserved" in str(view.error)


def test_small_values_never_touch_eec_blob(db_url: str) -> None:
    """The hot path for small values is unchanged: no statement of a small run (its start,
    steps, ticks and view) reads or writes eec_blob."""
    app = TwoSteps(db_url)
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        statements.append(statement)

    engine = app.d.client.engine
    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        view = app.run({"size": 100})
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)
    assert view.status == RunStatus.SUCCEEDED and view.nodes["measure"].output["length"] == 100
    assert any("eec_workflow_step_attempt" in s for s in statements)  # the listener saw the run
    assert not [s for s in statements if "eec_blob" in s]


def test_an_export_holds_large_values_and_replays_them(db_url: str) -> None:
    """docs/replay.md: an export stands on its own, so it holds the values, not references;
    a replay calls the step with the 5 MiB argument it received."""
    from ductor_celery import testing
    from ductor_celery.cli.export import export_of

    app = TwoSteps(db_url)
    size = 5 * MIB
    view = app.run({"size": size})
    assert view.status == RunStatus.SUCCEEDED, view.error
    document = export_of(app.d, view.run_id)
    text = json.dumps(document)
    assert REF_KEY not in text
    measure = next(a for a in document["attempts"] if a["node"] == "measure")
    assert measure["args"]["made"]["text"] == "x" * size
    assert testing.replay(document, node="measure", ductor=app.d) == {
        "length": size,
        "tag": "made",
        "input_size": size,
    }


def test_a_compensations_large_output_is_seen_in_the_view(db_url: str) -> None:
    d = _ductor(db_url)

    @d.step(name="large.book")
    def book(ctx: StepContext) -> str:
        return "booked"

    @d.step(name="large.fail")
    def fail(ctx: StepContext) -> None:
        raise ValueError("no seats")

    @d.step(name="large.unbook")
    def unbook(ctx: StepContext, output: str, input: Any) -> str:
        return output + "!" * MIB

    from ductor_celery import RetryPolicy

    wf = Workflow("large_saga")
    wf.step("book", book, compensate=unbook)
    wf.step("fail", fail, after=["book"], retry=RetryPolicy(max_attempts=1))
    d.register(wf)
    with d.local_workers():
        view = d.wait(d.start("large_saga").run_id, timeout=60)
    assert view.status == RunStatus.FAILED
    [saga] = view.compensations
    assert saga.node == "book" and saga.output == "booked" + "!" * MIB
    assert _blob_rows(d, view.run_id)  # stored by reference
