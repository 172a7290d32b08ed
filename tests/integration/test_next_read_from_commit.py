"""A chain's commit returns its run's next read (PostgreSQL; docs/next-read-from-commit.md):
the next inline step's tick, in the same thread and within ``NEXT_READ_FRESH_FOR_S``, takes it
instead of reading the run row again, and its commit is still conditional on the run being
as that read describes it. Each test plays the run's first message by hand
(``tests/inline_support.py``)."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from inline_support import (
    QUEUE,
    RecordingDispatcher,
    attempt_rows,
    deliver,
    make_ductor,
    run_row,
    start_run,
)

from ductor_celery import Ductor, RetryPolicy, StepContext
from ductor_celery.definition import Workflow
from ductor_celery.engine import RunState
from ductor_celery.runtime import inline
from ductor_celery.runtime.steps import first_tick
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store import load, next_read
from ductor_celery.store.outbox import OutboxRow
from ductor_celery.store.schema import dumps_json, workflow_run

#: What a chain's step ``i`` does besides adding one (``_chain``'s ``during``).
During = Callable[[Ductor, StepContext], None]


@pytest.fixture
def reads(monkeypatch: Any) -> list[str]:
    """Each run-row read a tick makes in this thread (``load._run_row``), by run id. A kept
    read stays fresh for a minute here: the counts do not depend on how loaded the machine is
    (``test_a_read_kept_past_its_freshness_is_not_taken`` checks the bound)."""
    seen: list[str] = []
    real = load._run_row
    me = threading.get_ident()

    def counting(conn: Any, run_id: str, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == me:
            seen.append(run_id)
        return real(conn, run_id, *args, **kwargs)

    monkeypatch.setattr(load, "_run_row", counting)
    monkeypatch.setattr(next_read, "NEXT_READ_FRESH_FOR_S", 60.0)
    return seen


def _chain(ductor: Ductor, length: int, during: dict[int, During] | None = None) -> None:
    """A chain of ``length`` steps adding one; ``during[i]``: called inside step ``i``."""
    during = during or {}

    def add_one(ctx: StepContext, value: int = 0, index: int = 0) -> int:
        if index in during:
            during[index](ductor, ctx)
        return value + 1

    step = ductor.step(name="nrc.add")(add_one)
    wf = Workflow("nrc")
    wf.step("s0", step, args={"value": 0, "index": 0})
    for i in range(1, length):
        wf.step(
            f"s{i}",
            step,
            after=[f"s{i - 1}"],
            args={"value": f"$.nodes.s{i - 1}.output", "index": i},
        )
    wf.output(f"$.nodes.s{length - 1}.output")
    ductor.register(wf)


def _started(
    database_url: str, length: int, during: dict[int, During] | None = None
) -> tuple[Ductor, RecordingDispatcher, str, OutboxRow]:
    """A chain started and ticked once by the coordinator: the ductor, what it would have
    published since, the run id and the run's first step message (not delivered yet)."""
    ductor, recorder = make_ductor(database_url)
    _chain(ductor, length, during)
    run_id, first = start_run(ductor, "nrc", recorder)
    return ductor, recorder, run_id, first


def _bump_version(ductor: Ductor, run_id: str) -> None:
    """Another tick's commit, as far as the run row shows it: a new version."""
    with ductor.runtime.engine().begin() as conn:
        conn.execute(
            sa.update(workflow_run)
            .where(workflow_run.c.run_id == run_id)
            .values(record_version=workflow_run.c.record_version + 1)
        )


def test_a_chain_reads_its_run_once_and_every_later_tick_takes_the_commits_read(
    database_url: str, reads: list[str]
) -> None:
    ductor, recorder, run_id, first = _started(database_url, 6)
    reads.clear()

    assert deliver(ductor, first) == "succeeded"

    # The first step's tick reads the run (the coordinator's tick before it committed in a
    # transaction, which keeps nothing); the five after it take what the commit returned.
    assert reads == [run_id]
    run = run_row(ductor, run_id)
    assert run.status == "succeeded" and run.output == 6
    rows = attempt_rows(ductor, run_id)
    assert [r.node for r in rows] == [f"s{i}" for i in range(6)]
    assert all(r.outcome == "succeeded" and r.folded for r in rows)
    # Every tick committed (the timer row and version each kept read carried were right): no
    # outcome written alone, no wake-up, no step message.
    assert recorder.wakes == [] and recorder.steps() == []


def test_a_run_started_on_a_step_worker_reads_its_run_once_and_begins_no_transaction(
    database_url: str, reads: list[str], monkeypatch: Any
) -> None:
    """The first tick, on the step worker the start message reached, reads in autocommit
    and commits alone (docs/tick-without-transaction.md), and its commit returns the first
    step's read: a 4-step run reads its run once, with no ``BEGIN`` from this thread."""
    ductor, recorder = make_ductor(database_url)
    _chain(ductor, 4)
    run_id = ductor.start("nrc", input={}).run_id
    assert recorder.first_ticks == [run_id]
    reads.clear()
    begun: list[bytes] = []
    real = psycopg.Connection._exec_command
    me = threading.get_ident()

    def recording(self: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == me and bytes(command).startswith(b"BEGIN"):
            begun.append(bytes(command))
        return real(self, command, *args, **kwargs)

    monkeypatch.setattr(psycopg.Connection, "_exec_command", recording)

    assert first_tick(ductor.runtime, run_id, "w1@host", QUEUE, f"{run_id}:first_tick") == (
        "committed"
    )

    assert reads == [run_id] and begun == []
    run = run_row(ductor, run_id)
    assert run.status == "succeeded" and run.output == 4
    assert recorder.wakes == [] and recorder.steps() == []


def test_a_commit_by_another_tick_in_between_makes_the_next_tick_busy_and_loses_nothing(
    database_url: str, reads: list[str]
) -> None:
    ductor, recorder, run_id, first = _started(
        database_url, 4, {2: lambda d, ctx: _bump_version(d, ctx.run_id)}
    )

    assert deliver(ductor, first) == "succeeded"

    # s2's tick found the run moved on since the commit that returned its read: busy, so its
    # outcome was written alone and the coordinator woken, and the chain stopped there.
    assert recorder.wakes == [run_id]
    s2 = [r for r in attempt_rows(ductor, run_id) if r.node == "s2"]
    assert len(s2) == 1 and s2[0].outcome == "succeeded" and not s2[0].folded
    assert run_tick(ductor.runtime, run_id) == "committed"  # the coordinator's tick folds it
    [s3] = [r for r in recorder.rows if r.kind == "step"]
    assert s3.payload["node"] == "s3"
    assert deliver(ductor, s3) == "succeeded"
    run = run_row(ductor, run_id)
    assert run.status == "succeeded" and run.output == 4
    rows = attempt_rows(ductor, run_id)
    assert [r.node for r in rows] == ["s0", "s1", "s2", "s3"]  # each applied once


def _in_another_thread(fn: Any) -> None:
    """``fn`` run by another thread (another client), waited for: this thread's kept read
    stays kept."""
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()


def test_a_cancel_applied_while_a_step_runs_makes_its_tick_busy_and_starts_nothing_more(
    database_url: str, reads: list[str]
) -> None:
    def cancel(d: Ductor, ctx: StepContext) -> None:
        _in_another_thread(lambda: d.cancel(ctx.run_id, reason="x"))

    ductor, recorder, run_id, first = _started(database_url, 6, {1: cancel})
    reads.clear()

    deliver(ductor, first)

    # The client applied the cancel with a tick of its own (a new version) while s1 ran: s1's
    # tick took the read s0's commit returned (this thread read the run once, for s0) and was
    # busy at its commit, so s1's outcome was written alone and the coordinator woken, whose
    # tick folds it and ends the run. Nothing after s1 started.
    assert reads == [run_id]
    assert recorder.wakes == [run_id]
    assert run_row(ductor, run_id).status == "running"  # the cancel waits for s1's outcome
    assert run_tick(ductor.runtime, run_id) == "committed"
    assert run_row(ductor, run_id).status == "cancelled"
    assert [r.node for r in attempt_rows(ductor, run_id)] == ["s0", "s1"]
    assert recorder.steps() == []


def test_a_control_waiting_at_a_commit_sends_the_next_tick_to_read_and_apply_it(
    database_url: str, reads: list[str]
) -> None:
    def queue_cancel(d: Ductor, ctx: StepContext) -> None:
        # A client that cannot tick leaves the control queued (and wakes the run).
        def cancel() -> None:
            d.client._tick_here = None
            d.cancel(ctx.run_id, reason="queued")

        _in_another_thread(cancel)

    ductor, recorder, run_id, first = _started(database_url, 6, {1: queue_cancel})
    reads.clear()

    deliver(ductor, first)

    # s1's tick took s0's read (the control came after it) and committed; its commit saw the
    # control waiting, so s2's tick read the run and applied the cancel.
    assert reads == [run_id, run_id]
    assert run_row(ductor, run_id).status == "cancelled"
    assert [r.node for r in attempt_rows(ductor, run_id)] == ["s0", "s1", "s2"]


def test_a_signal_waiting_at_a_commit_sends_each_next_tick_to_read(
    database_url: str, reads: list[str]
) -> None:
    def signal(d: Ductor, ctx: StepContext) -> None:
        _in_another_thread(lambda: d.signal(ctx.run_id, "later", 1))

    ductor, recorder, run_id, first = _started(database_url, 4, {1: signal})
    reads.clear()

    assert deliver(ductor, first) == "succeeded"

    # s0's tick read; s1's took s0's read; the signal (no node waits for it: it stays
    # unapplied) was there at s1's commit and at s2's, so s2's and s3's ticks read.
    assert reads == [run_id, run_id, run_id]
    assert run_row(ductor, run_id).output == 4


def test_an_outcome_waiting_at_a_commit_sends_the_next_tick_to_read_and_fold_it(
    database_url: str, reads: list[str]
) -> None:
    def stray_outcome(d: Ductor, ctx: StepContext) -> None:
        # A finished attempt not folded yet, as an outcome written alone leaves it (here of
        # an old generation: the tick that folds it ignores it as stale).
        with d.runtime.engine().begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO eec_workflow_step_attempt (token, run_id, node, generation, "
                    "attempt, step, args, timeout, finished_at, outcome, folded) VALUES "
                    "('stray', :r, 's0', 99, 1, 'nrc.add', '{}', 10, now(), 'succeeded', false)"
                ),
                {"r": ctx.run_id},
            )

    ductor, recorder, run_id, first = _started(database_url, 6, {1: stray_outcome})
    reads.clear()

    assert deliver(ductor, first) == "succeeded"

    # s1's tick took s0's read; its commit saw the unfolded outcome, so s2's tick read the run
    # and folded it. s2's commit, which folded it, still saw it unfolded in its snapshot (a
    # statement does not see its own writes): s3's tick read too; the ticks after it took
    # their reads again.
    assert reads == [run_id, run_id, run_id]
    with ductor.runtime.engine().connect() as conn:
        folded = conn.execute(
            sa.text("SELECT folded FROM eec_workflow_step_attempt WHERE token = 'stray'")
        ).scalar_one()
    assert folded is True
    assert run_row(ductor, run_id).output == 6


def test_a_read_kept_past_its_freshness_is_not_taken(
    database_url: str, reads: list[str], monkeypatch: Any
) -> None:
    ductor, recorder, run_id, first = _started(database_url, 3)
    reads.clear()
    monkeypatch.setattr(next_read, "NEXT_READ_FRESH_FOR_S", 0.0)  # every kept read stale

    assert deliver(ductor, first) == "succeeded"

    assert reads == [run_id, run_id, run_id]
    assert run_row(ductor, run_id).output == 3


def _with_values_in_nodes(ductor: Ductor) -> None:
    """A chain whose later nodes hold values a step could see in the run's state: a context
    patch of nested objects whose keys ``jsonb`` orders otherwise (and a negative zero), a
    checkpoint reached with it (its output is that context), a node failed with
    ``continue_on_failure`` (its error)."""

    def patches(ctx: StepContext) -> int:
        ctx.patch({"zz": {"b": [{"y": 1, "x": -0.0}], "a": -0.0}, "é": 1, "bb": 2})
        return 1

    def fails(ctx: StepContext, value: int) -> int:
        raise ValueError({"zz": 1, "a": -0.0, "é": [value]})

    def add_one(ctx: StepContext, value: int = 0) -> int:
        return value + 1

    wf = Workflow("nrv")
    wf.step("first", ductor.step(name="nrv.patches")(patches))
    wf.step(
        "broken",
        ductor.step(name="nrv.fails", retry=RetryPolicy(max_attempts=1))(fails),
        after=["first"],
        args={"value": "$.nodes.first.output"},
        continue_on_failure=True,
    )
    # Reached by the tick that folds the patch: its output is the context as that tick
    # computed it, not as a read decodes it.
    wf.checkpoint("cp", after=["first"])
    previous = "first"
    for name in ("s1", "s2", "s3"):
        wf.step(
            name,
            ductor.step(name="nrv.add")(add_one),
            after=["cp", "broken", previous],
            args={"value": f"$.nodes.{previous}.output"},
        )
        previous = name
    wf.output("$.nodes.s3.output")
    ductor.register(wf)


@pytest.mark.parametrize("workflow", ["nrc", "nrv"])
def test_the_kept_read_is_what_a_read_finds_timer_row_included(
    database_url: str, monkeypatch: Any, workflow: str
) -> None:
    """Each kept read, taken, matches a fresh read of the run at that moment: version,
    state (as stored, in the order a read decodes it: nodes, keys, numbers), timer row (the
    chain's steps have timeouts: each commit sets or keeps the timer row)."""
    monkeypatch.setattr(next_read, "NEXT_READ_FRESH_FOR_S", 60.0)
    compared: list[str] = []
    real_take = next_read.take

    def take_and_compare(engine: Any, run_id: str) -> Any:
        row = real_take(engine, run_id)
        if row is not None:
            with engine.connect() as conn:
                fresh = load._run_row(conn, run_id, False, with_input=False, lock=False)
            read = RunState.from_json(fresh.state)
            assert (row.record_version, row.state, row.timer_at) == (
                fresh.record_version,
                read,
                fresh.timer_at,
            )
            # Equal as values is not enough: the engine iterates nodes in their order, and
            # a step sees the order of keys and the sign of a zero.
            assert dumps_json(row.state.to_json()) == dumps_json(read.to_json())
            assert row.has_control is fresh.has_control is False
            assert row.has_signals is fresh.has_signals is False
            assert fresh.results is None
            compared.append(run_id)
            last[:] = [row.state]
        return row

    last: list[RunState] = []
    monkeypatch.setattr(next_read, "take", take_and_compare)
    if workflow == "nrc":
        ductor, recorder, run_id, first = _started(database_url, 5)
        taken = 4
    else:
        ductor, recorder = make_ductor(database_url)
        _with_values_in_nodes(ductor)
        run_id, first = start_run(ductor, "nrv", recorder)
        taken = 4  # the failed step's tick, s1's, s2's, s3's: "first" is the message's

    assert deliver(ductor, first) == "succeeded"
    assert compared == [run_id] * taken
    run = run_row(ductor, run_id)
    assert run.status == "succeeded"
    if workflow == "nrv":
        assert run.output == 4
        # The last kept read compared held every kind of value: the failed node's error,
        # the checkpoint's output (the context), the context itself.
        assert last[0].nodes["broken"].error is not None
        assert last[0].nodes["cp"].output is not None
        assert math.copysign(1.0, last[0].context["zz"]["a"]) == 1.0  # no negative zero


@pytest.mark.parametrize("quick", [True, False], ids=["quick steps", "slow steps"])
def test_a_chain_into_a_scatter_and_out_of_it_folds_every_branch_once(
    database_url: str, reads: list[str], monkeypatch: pytest.MonkeyPatch, quick: bool
) -> None:
    """A claimed scatter branch asks for no next read (its tick reads in its transaction);
    the chain after the scatter takes them again. With every step counted as slow (as on a
    loaded machine), the branches go out as messages and a wake-up row ticks the rest."""
    monkeypatch.setattr(inline, "HOLD_IF_QUICKER_S", 10.0 if quick else 0.0)
    ductor, recorder = make_ductor(database_url)

    def add_one(ctx: StepContext, value: int = 0, index: int = 0) -> int:
        return value + 1

    step = ductor.step(name="nrc.add")(add_one)
    wf = Workflow("nrc_scatter")
    wf.step("s0", step, args={"value": 0})
    wf.scatter("fan", step, over="$.input.items", item_arg="value", after=["s0"])
    wf.step("s1", step, args={"value": 10}, after=["fan"])
    wf.step("s2", step, args={"value": "$.nodes.s1.output"}, after=["s1"])
    wf.output({"fan": "$.nodes.fan.output", "s2": "$.nodes.s2.output"})
    ductor.register(wf)
    handle = ductor.start("nrc_scatter", input={"items": [1, 2, 3, 4, 5]})
    assert run_tick(ductor.runtime, handle.run_id) == "committed"
    [first] = [r for r in recorder.rows if r.kind == "step"]
    recorder.rows.clear()

    deliver(ductor, first)
    for _ in range(10):  # branches the chain sent as messages, if any, and the ticks after
        sent = [r for r in recorder.rows if r.kind == "step"]
        # A wake-up sent as an outbox row (a slow step's tick leaves the run's next tick to
        # the coordinator that way), as well as one sent directly.
        woken = {r.run_id for r in recorder.rows if r.kind == "wakeup"}
        recorder.rows.clear()
        for row in sent:
            deliver(ductor, row)
        for run_id in set(recorder.wakes) | woken:
            while run_id in recorder.wakes:
                recorder.wakes.remove(run_id)
            run_tick(ductor.runtime, run_id)
        if run_row(ductor, handle.run_id).status == "succeeded":
            break

    run = run_row(ductor, handle.run_id)
    assert run.status == "succeeded"
    assert run.output == {"fan": [2, 3, 4, 5, 6], "s2": 12}
    rows = attempt_rows(ductor, handle.run_id)
    assert sorted((r.node, r.branch) for r in rows) == sorted(
        [("s0", None), ("s1", None), ("s2", None)] + [("fan", i) for i in range(5)]
    )
    assert all(r.folded for r in rows)


def test_a_kept_read_is_taken_once_and_only_for_its_run_and_engine() -> None:
    from datetime import UTC, datetime, timedelta

    from ductor_celery.coordinator.port import LoadedRun
    from ductor_celery.engine import RunState
    from ductor_celery.engine.state import NodeState
    from ductor_celery.engine.status import NodeStatus, RunStatus
    from ductor_celery.store.pg_commit import NextRead

    loaded = LoadedRun(
        run_id="r1",
        workflow_id="w",
        workflow="nrc",
        spec_hash="h",
        record_version=7,
        state=RunState(),
        now=datetime.now(UTC),
    )
    engine, other = object(), object()
    now = datetime.now(UTC)
    read = NextRead({"status": "running", "context": {"k": 1}}, now, False, False, False)
    nodes = {"s1": NodeState(status=NodeStatus.RUNNING), "s0": NodeState()}

    next_read.keep(engine, loaded, None, read, nodes)
    assert next_read.take(other, "r1") is None  # another database: dropped
    assert next_read.take(engine, "r1") is None  # dropped by the take before

    next_read.keep(engine, loaded, None, read, nodes)
    assert next_read.take(engine, "r2") is None  # another run: dropped

    next_read.keep(engine, loaded, now, read, nodes)
    row = next_read.take(engine, "r1")
    assert row is not None
    assert row.record_version == 8 and row.timer_at == now and row.now >= now
    # The run's own fields as PostgreSQL returned them, the committed nodes as it orders them.
    assert row.state == RunState(status=RunStatus.RUNNING, context={"k": 1}, nodes=nodes)
    assert list(row.state.nodes) == ["s0", "s1"]
    assert row.state.nodes["s1"] is nodes["s1"]
    assert next_read.take(engine, "r1") is None  # one tick at most

    for flags in [(True, False, False), (False, True, False), (False, False, True)]:
        next_read.keep(engine, loaded, None, NextRead({}, now, *flags), nodes)
        assert next_read.take(engine, "r1") is None  # something else to apply: read

    # A statement that waited for the run's lock: its flags are as of its start, too old.
    began = now - timedelta(seconds=1)
    next_read.keep(engine, loaded, None, read._replace(db_began=began), nodes)
    assert next_read.take(engine, "r1") is None
    next_read.keep(engine, loaded, None, read._replace(db_began=now), nodes)
    assert next_read.take(engine, "r1") is not None

    next_read.keep(engine, loaded, None, read, nodes)
    next_read.forget()
    assert next_read.take(engine, "r1") is None
