"""``wait()``'s read of a finished run carries its nodes' outputs (PostgreSQL): the view it
returns needs no read of its own, where a client that did not run the steps (every client but
a step worker) read them in a transaction of its own (``BEGIN``, ``SELECT``, ``ROLLBACK``).
The outputs are those of the attempts the run's nodes name, finished, as ``get()`` reads them
(a retried step's last attempt; a large output's reference resolved). On SQLite the view reads
them as before: the same view."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy as sa
from inline_support import deliver, make_ductor, start_run, url  # noqa: F401 - fixture
from support import attempt_reads_so_far, grow_attempts

from ductor_celery import Ductor, RetryPolicy, StepContext
from ductor_celery.definition import Workflow
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store import composed, runs
from ductor_celery.store.db import get_engine

T = TypeVar("T")
BIG = "x" * 300_000  # over the inline limit: stored as a large value, its row holds a reference


def _finished_run(database: str) -> tuple[Ductor, str]:
    """A run of three steps played to its end in this process: ``flaky`` fails its first
    attempt (so its node has two), ``big`` returns a large value."""
    ductor, recorder = make_ductor(database)
    tries: list[int] = []

    def flaky(ctx: StepContext) -> str:
        tries.append(1)
        if len(tries) == 1:
            raise RuntimeError("first attempt fails")
        return f"attempt {ctx.attempt}"

    ductor.step(name="wro.flaky", retry=RetryPolicy(max_attempts=2, initial_interval=0.01))(flaky)
    ductor.step(name="wro.big")(lambda ctx: BIG)
    ductor.step(name="wro.last")(lambda ctx: {"done": True})
    wf = Workflow("wro")
    wf.step("flaky", "wro.flaky")
    wf.step("big", "wro.big", after=["flaky"])
    wf.step("last", "wro.last", after=["big"])
    wf.output("$.nodes.last.output")
    ductor.register(wf)
    run_id, first = start_run(ductor, "wro", recorder)
    deliver(ductor, first)
    deadline = time.monotonic() + 10
    while ductor.get(run_id).status != "succeeded" and time.monotonic() < deadline:
        # The retry: its timer's tick, then its message (and the inline chain after it).
        time.sleep(0.02)
        run_tick(ductor.runtime, run_id)
        for row in [r for r in recorder.rows if r.kind == "step"]:
            recorder.rows.remove(row)
            deliver(ductor, row)
    assert ductor.get(run_id).status == "succeeded"
    # Another process's client: it never saw these outputs.
    composed._outputs_caches.clear()
    return ductor, run_id


def _check_view(view: Any) -> None:
    assert view.status == "succeeded"
    assert view.nodes["flaky"].output == "attempt 2"
    assert view.nodes["big"].output == BIG
    assert view.nodes["last"].output == {"done": True}
    assert view.output == {"done": True}


def _statements(database_url: str, call: Callable[[], T]) -> tuple[T, list[str]]:
    """What ``call`` returns, and the statements the database's engine sent for it meanwhile
    (from this thread: the outbox janitor's thread uses the engine too)."""
    engine = get_engine(database_url)
    seen: list[str] = []
    me = threading.get_ident()

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if threading.get_ident() == me:
            seen.append(statement)

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        return call(), seen
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)


def _attempt_reads(statements: list[str]) -> list[str]:
    """Reads of the attempt rows on their own (not inside the run's read)."""
    return [s for s in statements if s.startswith("SELECT eec_workflow_step_attempt")]


def test_a_finished_runs_wait_reads_the_run_and_its_outputs_in_one_statement(
    database_url: str,
) -> None:
    ductor, run_id = _finished_run(database_url)
    view, seen = _statements(database_url, lambda: ductor.wait(run_id, timeout=5))
    _check_view(view)
    # One statement reads the run and its outputs; the only other is the large value's read
    # (a value held elsewhere, read because the view shows it).
    assert [s.rsplit("FROM", 1)[1].split()[0] for s in seen] == ["eec_workflow_run", "eec_blob"]
    assert _attempt_reads(seen) == []


def test_a_wait_by_workflow_id_reads_the_outputs_too(database_url: str) -> None:
    ductor, run_id = _finished_run(database_url)
    workflow_id = ductor.get(run_id).workflow_id
    composed._outputs_caches.clear()
    view, seen = _statements(database_url, lambda: ductor.wait(workflow_id, timeout=5))
    _check_view(view)
    assert _attempt_reads(seen) == [], seen


def test_an_open_runs_read_keeps_no_output(database_url: str) -> None:
    """Until the run is terminal its read carries no output: the view of an open run reads
    its finished nodes' outputs itself, and no attempt still open is ever kept."""
    ductor, recorder = make_ductor(database_url, inline_steps=0)
    ductor.step(name="wro.one")(lambda ctx: 1)
    wf = Workflow("wro-open")
    wf.step("a", "wro.one")
    wf.step("b", "wro.one", after=["a"])
    ductor.register(wf)
    run_id, first = start_run(ductor, "wro-open", recorder)
    deliver(ductor, first)
    composed._outputs_caches.clear()
    found = runs.find_run_for_wait(get_engine(database_url), run_id)
    assert found is not None and found[0].status == "running"
    assert composed.outputs_cache(get_engine(database_url))._data == {}
    view = ductor.get(run_id)
    assert view.nodes["a"].output == 1 and view.nodes["b"].output is None


def test_the_view_wait_returns_is_the_same_on_either_database(url: str) -> None:  # noqa: F811
    ductor, run_id = _finished_run(url)
    _check_view(ductor.wait(run_id, timeout=5))


def test_outputs_past_the_reads_bound_are_read_by_the_view(database_url: str) -> None:
    """The outputs that ride with the run's read are bounded (``WAIT_READ_OUTPUTS_MAX_BYTES``,
    by token order): one ``jsonb`` value is capped, and a run of many large inline outputs
    must still be readable. Past the bound, the view reads the rest itself, as before."""
    ductor, recorder = make_ductor(database_url)
    part = "y" * 250_000  # under the offload threshold: kept inline in its attempt row
    ductor.step(name="wro.part")(lambda ctx: part)
    wf = Workflow("wro-bound")
    for i in range(5):  # 5 x 250 kB: past the 1 MiB bound
        wf.step(f"p{i}", "wro.part", after=[f"p{i - 1}"] if i else [])
    ductor.register(wf)
    run_id, first = start_run(ductor, "wro-bound", recorder)
    deliver(ductor, first)
    assert ductor.get(run_id).status == "succeeded"
    assert 5 * len(part) > runs.WAIT_READ_OUTPUTS_MAX_BYTES
    composed._outputs_caches.clear()
    view, seen = _statements(database_url, lambda: ductor.wait(run_id, timeout=5))
    assert [view.nodes[f"p{i}"].output for i in range(5)] == [part] * 5
    # The read carried what fits; the view read the rest in one read of its own.
    assert len(_attempt_reads(seen)) == 1, seen


def test_a_finished_runs_outputs_are_found_by_their_keys_on_a_grown_table(
    database_url: str,
) -> None:
    """The read finds the outputs the run's nodes name by the attempts' primary key, at any
    size of the table and in the plan PostgreSQL keeps for the prepared statement: on an
    analyzed table of 5,000 more attempts, with generic plans forced, each of twelve reads
    (past psycopg's threshold for preparing it) reads no attempt row by a scan and fetches
    only a few by the index. ``token IN`` the nodes' tokens was planned as a scan of the
    whole table at a few thousand rows, and the growing benchmark tables made ``wait()``
    slower round after round."""
    ductor, run_id = _finished_run(database_url)
    engine = get_engine(database_url)
    grow_attempts(engine, 5000, run="other")
    with engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE eec_workflow_step_attempt")
        conn.commit()
        conn.exec_driver_sql("SET LOCAL plan_cache_mode = force_generic_plan")
        reads = []
        for _ in range(12):
            before = attempt_reads_so_far(conn)
            row = conn.execute(runs._WAIT_READS[True, False], {"target": run_id}).one()
            after = attempt_reads_so_far(conn)
            reads.append((after[0] - before[0], after[1] - before[1]))
            assert row.outputs is not None and {"done": True} in row.outputs.values()
        conn.rollback()
    # The run's three nodes name three attempts: none scanned, and only those fetched, by
    # their keys (the state gives its succeeded nodes back from the same rows, once for the
    # state and once for the tokens the outputs are read by: store/done_nodes.py).
    assert all(scanned == 0 and 0 < fetched <= 9 for scanned, fetched in reads), reads
