"""A chain's commit returns its run's next read (PostgreSQL; docs/next-read-from-commit.md):
the next inline step's tick, in the same thread and within ``NEXT_READ_FRESH_FOR_S``, takes it
instead of reading the run row again, and its commit is still conditional on the run being
as that read describes it. Each test plays the run's first message by hand
(``tests/inline_support.py``)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa
from inline_support import attempt_rows, deliver, make_ductor, run_row, start_run

from ductor_celery import Ductor, StepContext
from ductor_celery.definition import Workflow
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store import load, next_read
from ductor_celery.store.schema import workflow_run


@pytest.fixture
def reads(monkeypatch: Any) -> list[str]:
    """Each run-row read a tick makes (``load._run_row``), by run id."""
    seen: list[str] = []
    real = load._run_row

    def counting(conn: Any, run_id: str, *args: Any, **kwargs: Any) -> Any:
        seen.append(run_id)
        return real(conn, run_id, *args, **kwargs)

    monkeypatch.setattr(load, "_run_row", counting)
    return seen


def _chain(ductor: Ductor, length: int, during: dict[int, Any] | None = None) -> None:
    """A chain of ``length`` steps adding one; ``during[i]``: called inside step ``i``."""
    during = during or {}

    def add_one(ctx: StepContext, value: int = 0, index: int = 0) -> int:
        if index in during:
            during[index](ctx)
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
    ductor, recorder = make_ductor(database_url)
    _chain(ductor, 6)
    run_id, first = start_run(ductor, "nrc", recorder)
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


def test_a_commit_by_another_tick_in_between_makes_the_next_tick_busy_and_loses_nothing(
    database_url: str,
) -> None:
    ductor, recorder = make_ductor(database_url)
    holder: dict[str, str] = {}
    _chain(ductor, 4, {2: lambda ctx: _bump_version(ductor, holder["run"])})
    run_id, first = start_run(ductor, "nrc", recorder)
    holder["run"] = run_id

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
    database_url: str,
) -> None:
    ductor, recorder = make_ductor(database_url)
    holder: dict[str, str] = {}
    cancel = lambda ctx: _in_another_thread(lambda: ductor.cancel(holder["run"], reason="x"))  # noqa: E731
    _chain(ductor, 6, {1: cancel})
    run_id, first = start_run(ductor, "nrc", recorder)
    holder["run"] = run_id

    deliver(ductor, first)

    # The client applied the cancel with a tick of its own (a new version) while s1 ran: s1's
    # tick, taking the read s0's commit returned, was busy at its commit and wrote its outcome
    # alone; nothing after s1 started.
    assert run_row(ductor, run_id).status == "cancelled"
    assert [r.node for r in attempt_rows(ductor, run_id)] == ["s0", "s1"]
    assert recorder.steps() == []


def test_a_read_kept_longer_than_its_freshness_is_not_taken(
    database_url: str, reads: list[str]
) -> None:
    ductor, recorder = make_ductor(database_url)
    _chain(ductor, 3, {1: lambda ctx: time.sleep(next_read.NEXT_READ_FRESH_FOR_S * 3)})
    run_id, first = start_run(ductor, "nrc", recorder)
    reads.clear()

    assert deliver(ductor, first) == "succeeded"

    # s0's tick reads; s1 ran longer than the kept read stays fresh: its tick reads too.
    assert reads == [run_id, run_id]
    assert run_row(ductor, run_id).output == 3


def test_a_kept_read_is_taken_once_and_only_for_its_run_and_engine() -> None:
    from datetime import UTC, datetime

    from ductor_celery.coordinator.port import LoadedRun
    from ductor_celery.engine import RunState

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
    read = ({"status": "running"}, now, False, False, False)

    next_read.keep(engine, loaded, None, read)
    assert next_read.take(other, "r1") is None  # another database: dropped
    assert next_read.take(engine, "r1") is None  # dropped by the take before

    next_read.keep(engine, loaded, None, read)
    assert next_read.take(engine, "r2") is None  # another run: dropped

    next_read.keep(engine, loaded, now, read)
    row = next_read.take(engine, "r1")
    assert row is not None
    assert row.record_version == 8 and row.timer_at == now and row.state == {"status": "running"}
    assert row.now >= now
    assert next_read.take(engine, "r1") is None  # one tick at most

    for flags in [(True, False, False), (False, True, False), (False, False, True)]:
        next_read.keep(engine, loaded, None, ({}, now, *flags))
        assert next_read.take(engine, "r1") is None  # something else to apply: read
