"""Run concurrency and priorities (docs/flow-control.md), through the test harness: the
production tick, claims and sweeper in this process, on SQLite with a controlled clock.

``RunConcurrency(key, limit, strategy)``: at most ``limit`` open runs per key. A run is
admitted by its first tick; one beyond the limit waits ``pending`` (``queue``), asks the
oldest holder to cancel (``cancel_in_progress``) or is cancelled at once (``cancel_newest``).
Waiters go by priority, then start order. The run's ``priority`` is also the order of waiting
attempts (leases, rate limits) and travels on step messages.
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from ductor_celery import (
    DefinitionError,
    Ductor,
    RunConcurrency,
    RunStatus,
    StepContext,
    Workflow,
    testing,
)


def _ductor(strategy: str = "queue", limit: int = 1) -> Ductor:
    ductor = Ductor(Celery(f"rc_{strategy}"), database_url="sqlite://")

    @ductor.step(name="rc.work")
    def work(ctx: StepContext, customer: str) -> str:
        return customer

    wf = Workflow(
        "sync", concurrency=RunConcurrency(key="$.input.customer", limit=limit, strategy=strategy)
    )
    wf.step("hold", work, args={"customer": "$.input.customer"})
    wf.wait_signal("go", signal="go", after=["hold"])
    wf.output("$.nodes.hold.output")
    ductor.register(wf)
    return ductor


def _statuses(h: Any, handles: list[Any]) -> list[str]:
    return [h.run(x).status.value for x in handles]


def test_queue_keeps_runs_pending_beyond_the_limit_and_starts_them_in_order() -> None:
    ductor = _ductor("queue", limit=2)
    with testing.harness(ductor) as h:
        runs = [h.start("sync", input={"customer": "acme"}) for _ in range(4)]
        other = h.start("sync", input={"customer": "globex"})
        # Two hold acme's slots (parked on their signal); two wait, never started.
        assert _statuses(h, runs) == ["running", "running", "pending", "pending"]
        assert h.run(runs[2]).nodes["hold"].status.value == "pending"
        assert h.run(other).status == RunStatus.RUNNING  # another key is not held back
        h.signal(runs[0].workflow_id, "go")
        # runs[0] finished: its slot goes to the oldest waiter, woken in the same commit.
        assert _statuses(h, runs) == ["succeeded", "running", "running", "pending"]
        ductor.cancel(runs[1].run_id)
        h.run(runs[1])
        assert _statuses(h, runs) == ["succeeded", "cancelled", "running", "running"]


def test_a_waiting_run_can_be_cancelled_and_frees_nothing_it_did_not_hold() -> None:
    ductor = _ductor("queue", limit=1)
    with testing.harness(ductor) as h:
        first, second, third = (h.start("sync", input={"customer": "acme"}) for _ in range(3))
        ductor.cancel(second.run_id)
        assert h.run(second).status == RunStatus.CANCELLED
        assert _statuses(h, [first, third]) == ["running", "pending"]
        h.signal(first.workflow_id, "go")
        assert _statuses(h, [first, third]) == ["succeeded", "running"]


def test_cancel_newest_refuses_the_run_beyond_the_limit_with_an_error_that_says_why() -> None:
    ductor = _ductor("cancel_newest", limit=1)
    with testing.harness(ductor) as h:
        first = h.start("sync", input={"customer": "acme"})
        second = h.start("sync", input={"customer": "acme"})
        view = h.run(second)
        assert view.status == RunStatus.CANCELLED
        assert view.error["type"] == "RunConcurrencyLimit"
        assert "1 of 1 runs of key 'sync|acme' already open" in view.error["message"]
        assert "cancel_newest" in view.error["message"]
        assert h.run(first).status == RunStatus.RUNNING  # untouched
        third = h.start("sync", input={"customer": "acme"})
        assert h.run(third).status == RunStatus.CANCELLED


def test_cancel_in_progress_cancels_the_oldest_and_starts_the_new_one_after_it() -> None:
    ductor = _ductor("cancel_in_progress", limit=1)
    with testing.harness(ductor) as h:
        first = h.start("sync", input={"customer": "acme"})
        assert h.run(first).status == RunStatus.RUNNING
        second = h.start("sync", input={"customer": "acme"})
        assert h.run(first).status == RunStatus.CANCELLED
        assert "making room for run" in h.run(first).error["message"]
        assert h.run(second).status == RunStatus.RUNNING  # started once the first ended
        audit = ductor.audit(first.run_id, action="cancel").entries
        assert [e.source for e in audit] == ["concurrency"]


def test_waiters_go_by_priority_then_start_order() -> None:
    ductor = _ductor("queue", limit=1)
    with testing.harness(ductor) as h:
        holder = h.start("sync", input={"customer": "acme"})
        low = h.start("sync", input={"customer": "acme"}, priority=1)
        high = h.start("sync", input={"customer": "acme"}, priority=7)
        default = h.start("sync", input={"customer": "acme"})
        assert _statuses(h, [holder, low, high, default]) == [
            "running",
            "pending",
            "pending",
            "pending",
        ]
        h.signal(holder.workflow_id, "go")
        assert _statuses(h, [low, high, default]) == ["pending", "running", "pending"]
        h.signal(high.workflow_id, "go")
        assert _statuses(h, [low, high, default]) == ["running", "succeeded", "pending"]


def test_a_paused_waiter_stays_pending_on_resume_until_it_has_a_slot() -> None:
    ductor = _ductor("queue", limit=1)
    with testing.harness(ductor) as h:
        holder = h.start("sync", input={"customer": "acme"})
        waiter = h.start("sync", input={"customer": "acme"})
        ductor.pause(waiter.run_id)
        assert h.run(waiter).status == RunStatus.PAUSED
        ductor.resume(waiter.run_id)
        assert h.run(waiter).status == RunStatus.PENDING  # not past the limit by a resume
        h.signal(holder.workflow_id, "go")
        assert h.run(waiter).status == RunStatus.RUNNING


def test_bad_declarations_and_priorities_get_one_clear_error() -> None:
    with pytest.raises(DefinitionError, match=r"must be a \$\.input path"):
        RunConcurrency(key="$.context.region", limit=1)
    with pytest.raises(DefinitionError, match="limit must be >= 1"):
        RunConcurrency(key="$.input.c", limit=0)
    with pytest.raises(DefinitionError, match="strategy must be 'queue'"):
        RunConcurrency(key="$.input.c", limit=1, strategy="drop_newest")
    with pytest.raises(DefinitionError, match="concurrency= takes a RunConcurrency"):
        Workflow("w", concurrency={"key": "$.input.c"})  # type: ignore[arg-type]
    for bad in (10, -1, 1.5, True, "5"):
        with pytest.raises(DefinitionError, match="priority must be an integer from 0 to 9"):
            Workflow("w", priority=bad)  # type: ignore[arg-type]
    ductor = _ductor()
    with testing.harness(ductor) as h:
        for bad in (10, -1, True, "high"):
            with pytest.raises(ValueError, match="priority must be an integer from 0 to 9"):
                h.start("sync", input={"customer": "acme"}, priority=bad)
        assert ductor.list_runs() == []  # nothing written


def test_children_inherit_their_parents_priority_and_the_workflow_default_applies() -> None:
    ductor = Ductor(Celery("rc_priority"), database_url="sqlite://")

    @ductor.step(name="rc.echo")
    def echo(ctx: StepContext, value: int) -> int:
        return value

    child = Workflow("child")
    child.step("e", echo, args={"value": 1})
    child.output("$.nodes.e.output")
    ductor.register(child)
    parent = Workflow("parent", priority=3)
    parent.subworkflow("sub", workflow="child")
    parent.output("$.nodes.sub.output")
    ductor.register(parent)
    with testing.harness(ductor) as h:
        default = h.start("parent")
        urgent = h.start("parent", priority=9)
        assert h.run(default).status == RunStatus.SUCCEEDED
        assert h.run(urgent).status == RunStatus.SUCCEEDED
        with ductor.runtime.engine().connect() as conn:
            rows = dict(
                conn.execute(sa.text("SELECT workflow_id, priority FROM eec_workflow_run")).all()
            )
            attempts = set(
                conn.execute(sa.text("SELECT priority FROM eec_workflow_step_attempt")).scalars()
            )
        assert rows[default.workflow_id] == 3 and rows[f"{default.workflow_id}/sub"] == 3
        assert rows[urgent.workflow_id] == 9 and rows[f"{urgent.workflow_id}/sub"] == 9
        assert attempts == {3, 9}  # each attempt carries its run's priority


def test_a_limit_raised_in_a_new_version_applies_as_the_line_reaches_its_runs() -> None:
    ductor = _ductor("queue", limit=1)

    @ductor.step(name="rc.work2")
    def work(ctx: StepContext, customer: str) -> str:
        return customer

    wider = Workflow("sync", version=2, concurrency=RunConcurrency("$.input.customer", limit=2))
    wider.step("hold", work, args={"customer": "$.input.customer"})
    wider.wait_signal("go", signal="go", after=["hold"])
    ductor.register(wider)
    with testing.harness(ductor) as h:
        holder = h.start("sync", input={"customer": "acme"}, version=1)
        waiter = h.start("sync", input={"customer": "acme"}, version=1)
        # A version-2 run may run beside one other, but a version-1 run is ahead of it in
        # line, and that one may not: nobody overtakes it (as with concurrency leases).
        newcomer = h.start("sync", input={"customer": "acme"}, version=2)
        assert _statuses(h, [holder, waiter, newcomer]) == ["running", "pending", "pending"]
        h.signal(holder.workflow_id, "go")
        # The holder's end moves the line: the version-1 waiter (1 allowed, none held), then
        # the newcomer (2 allowed, 1 held), in the same commit.
        assert _statuses(h, [holder, waiter, newcomer]) == ["succeeded", "running", "running"]


def test_continue_as_new_frees_the_slot_and_the_successor_lines_up_under_its_own_key() -> None:
    ductor = _ductor("queue", limit=1)
    with testing.harness(ductor) as h:
        acme = h.start("sync", input={"customer": "acme"})
        acme_next = h.start("sync", input={"customer": "acme"})
        globex = h.start("sync", input={"customer": "globex"})
        assert _statuses(h, [acme, acme_next, globex]) == ["running", "pending", "running"]
        ductor.continue_as_new(acme.run_id, input={"customer": "globex"})
        first = h.run(acme.run_id)
        assert first.status == RunStatus.CONTINUED
        # acme's slot went to acme's line; the successor is a globex run now, and waits
        # behind the globex run already open (limit 1).
        assert h.run(acme_next).status == RunStatus.RUNNING
        successor = h.run(first.continued_to)
        assert successor.status == RunStatus.PENDING
        h.signal(globex.workflow_id, "go")
        assert h.run(first.continued_to).status == RunStatus.RUNNING


def test_the_sweeper_releases_a_slot_its_ended_run_left_behind() -> None:
    ductor = _ductor("queue", limit=1)
    with testing.harness(ductor) as h:
        holder = h.start("sync", input={"customer": "acme"})
        waiter = h.start("sync", input={"customer": "acme"})
        engine = ductor.runtime.engine()
        with engine.begin() as conn:  # as if the run had ended without releasing its slot
            conn.execute(
                sa.text(
                    "UPDATE eec_workflow_run SET status = 'terminated', "
                    "finished_at = updated_at WHERE run_id = :r"
                ),
                {"r": holder.run_id},
            )
        from ductor_celery.store import run_slots
        from ductor_celery.store.db import db_now

        with engine.begin() as conn:
            woken = run_slots.reap(conn, db_now(engine))
        assert [r.run_id for r in woken] == [waiter.run_id]
        ductor.runtime.dispatcher.send(woken)  # what the sweeper does with them
        assert h.run(waiter).status == RunStatus.RUNNING
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT run_id FROM eec_run_slot")).scalars().all()
        assert rows == [waiter.run_id]
