"""Issue 15 item 4: ``ductor_celery.testing``, the in-process harness with a controlled clock.

The production tick and attempt execution on a throwaway SQLite database: a day's sleep and a
chain of retries with backoff in one ``advance()``, well under a second of wall time; stubs
that return and raise; signals and approvals; timers created while advancing; a scatter;
``h.run`` by handle, run id and workflow id; bad input; and the Ductor as it was afterwards.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from ductor_celery import (
    DefinitionError,
    Ductor,
    NodeStatus,
    NonRetryableError,
    RetryPolicy,
    RunStatus,
    StepContext,
    Workflow,
    testing,
)
from ductor_celery.limits import LATEST_NOW, MAX_DURATION_S
from ductor_celery.runtime.dispatch import Dispatcher

T0 = datetime(2030, 1, 1, 9, 0, tzinfo=UTC)
DAY = timedelta(days=1)


def make_shop(tmp_path: Path) -> Ductor:
    """A user's Ductor with its own database (a file the harness must never touch)."""
    app = Celery(f"harness{id(tmp_path)}", broker="memory://", set_as_current=False)
    ductor = Ductor(app, database_url=f"sqlite:///{tmp_path}/user.sqlite3")

    @ductor.step(
        name="shop.charge",
        retry=RetryPolicy(max_attempts=4, initial_interval=10.0, backoff=2.0),
    )
    def charge(ctx: StepContext, amount: int) -> dict[str, Any]:
        if ctx.attempt < 3:
            raise ConnectionError("the payment gateway is down")
        return {"charge_id": f"ch_{amount}", "attempt": ctx.attempt}

    @ductor.step(name="shop.ship")
    def ship(ctx: StepContext, order: dict[str, Any]) -> dict[str, Any]:
        return {"tracking": f"TRK-{order['id']}"}

    @ductor.step(name="shop.pack")
    def pack(ctx: StepContext, item: str) -> str:
        return item.upper()

    order = Workflow("order")
    order.sleep("cool_off", seconds=86400)
    order.step("charge", charge, after=["cool_off"], args={"amount": "$.input.total"})
    order.step("ship", ship, after=["charge"], args={"order": "$.input"})
    order.output({"charge": "$.nodes.charge.output", "ship": "$.nodes.ship.output"})
    ductor.register(order)

    paid = Workflow("paid")
    paid.wait_signal("paid", signal="payment_received", timeout=3600)
    paid.approval("review", after=["paid"], timeout=86400)
    paid.step("ship", ship, after=["review"], args={"order": "$.input"})
    ductor.register(paid)

    naps = Workflow("naps")
    naps.sleep("first", seconds=3600)
    naps.sleep("second", seconds=3600, after=["first"])
    ductor.register(naps)

    packing = Workflow("packing")
    packing.scatter("pack", pack, over="$.input.items", item_arg="item", max_parallel=2)
    packing.output({"packed": "$.nodes.pack.output"})
    ductor.register(packing)
    return ductor


def test_a_day_of_sleep_and_a_chain_of_retries_in_well_under_a_second(tmp_path: Path) -> None:
    ductor = make_shop(tmp_path)
    began = time.perf_counter()
    with testing.harness(ductor, start_at=T0) as h:
        handle = h.start("order", input={"id": 42, "total": 99})
        view = h.run(handle)
        assert view.status == RunStatus.RUNNING
        assert view.nodes["cool_off"].status == NodeStatus.WAITING
        # The sleep fires at T0 + 1 day; the charge fails twice, retried after 10 s and 20 s
        # (timers its own ticks create while the clock advances), then succeeds: one call.
        h.advance(days=1, minutes=1)
        view = h.run(handle)
    elapsed = time.perf_counter() - began
    assert view.status == RunStatus.SUCCEEDED, view.error
    assert view.output == {
        "charge": {"charge_id": "ch_99", "attempt": 3},
        "ship": {"tracking": "TRK-42"},
    }
    assert view.nodes["charge"].attempts == 3
    assert view.nodes["cool_off"].finished_at == T0 + DAY
    assert view.nodes["charge"].finished_at == T0 + DAY + timedelta(seconds=30)
    assert view.created_at == T0
    assert view.finished_at == T0 + DAY + timedelta(seconds=30)
    # A day, then retry backoffs of 10 s and 20 s, on the harness's clock: none of it is slept.
    # The bound is far above the work (a few tenths of a second) and below the shortest real
    # wait, so a noisy machine does not fail it while a real sleep would.
    assert elapsed < 10.0, f"{elapsed:.2f}s of wall time: the harness slept"


def test_the_clock_moves_only_in_advance_and_fires_each_timer_at_its_time(
    tmp_path: Path,
) -> None:
    ductor = make_shop(tmp_path)
    with testing.harness(ductor, start_at=T0) as h:
        handle = h.start("naps")
        assert h.now == T0
        h.advance(minutes=59)
        assert h.run(handle).nodes["first"].status == NodeStatus.WAITING
        # The second sleep is created at T0+1h, while advancing, and fires at T0+2h.
        assert h.advance(hours=1, minutes=1) == T0 + timedelta(hours=2)
        view = h.run(handle)
    assert view.status == RunStatus.SUCCEEDED
    assert view.nodes["first"].finished_at == T0 + timedelta(hours=1)
    assert view.nodes["second"].finished_at == T0 + timedelta(hours=2)


def test_stubs_return_and_raise(tmp_path: Path) -> None:
    ductor = make_shop(tmp_path)
    with testing.harness(ductor, start_at=T0) as h:
        charge = h.stub("shop.charge", returns={"charge_id": "ch_stub"})
        handle = h.start("order", input={"id": 1, "total": 10})
        h.advance(days=1)
        view = h.run(handle)
        assert view.status == RunStatus.SUCCEEDED
        assert view.output["charge"] == {"charge_id": "ch_stub"}
        assert charge.calls == [{"amount": 10}]
        assert charge.contexts[0].attempt == 1

        # raises= an instance: non-retryable fails the node at once.
        h.stub("shop.charge", raises=NonRetryableError("card declined"))
        declined = h.start("order", input={"id": 2, "total": 20})
        h.advance(days=1)
        view = h.run(declined)
        assert view.status == RunStatus.FAILED
        assert view.nodes["charge"].attempts == 1
        assert "card declined" in view.nodes["charge"].error["message"]
        assert view.nodes["ship"].status == NodeStatus.PENDING

        # raises= a class: retried by the step's own policy until it is spent.
        h.stub("shop.charge", raises=ConnectionError)
        flaky = h.start("order", input={"id": 3, "total": 30})
        h.advance(days=1, minutes=2)  # backoffs of 10, 20 and 40 s
        view = h.run(flaky)
        assert view.status == RunStatus.FAILED
        assert view.nodes["charge"].attempts == 4
        assert view.nodes["charge"].error["type"] == "ConnectionError"


def test_a_step_that_hangs_times_out_and_is_retried(tmp_path: Path) -> None:
    ductor = make_shop(tmp_path)
    with testing.harness(ductor, start_at=T0) as h:
        h.stub("shop.ship", hangs=True)
        handle = h.start("paid", input={"id": 5})
        h.signal(handle, "payment_received")
        h.approve(handle, "review")
        assert h.get(handle).nodes["ship"].status == NodeStatus.RUNNING
        # The default step timeout (300 s) closes the lost attempt; the retry succeeds.
        h.unstub("shop.ship")
        view = h.run(handle)
        assert view.status == RunStatus.SUCCEEDED
        assert view.nodes["ship"].attempts == 2
        assert view.nodes["ship"].finished_at is not None
        assert T0 + timedelta(seconds=300) <= view.nodes["ship"].finished_at <= h.now

        # Hanging every time: each attempt times out in turn, until the policy is spent.
        h.stub("shop.ship", hangs=True)
        stuck = h.start("paid", input={"id": 6})
        h.signal(stuck, "payment_received")
        h.approve(stuck, "review")
        view = h.run(stuck)
    assert view.status == RunStatus.FAILED
    assert view.nodes["ship"].attempts == 3  # RetryPolicy() default
    assert view.nodes["ship"].error["type"] == "StepTimeout"


def test_run_goes_through_retries_but_stops_where_the_run_is_parked(tmp_path: Path) -> None:
    ductor = make_shop(tmp_path)
    with testing.harness(ductor, start_at=T0) as h:
        handle = h.start("order", input={"id": 42, "total": 99})
        # Parked at the day's sleep: run() does not move the clock past it.
        assert h.run(handle).nodes["cool_off"].status == NodeStatus.WAITING
        assert h.now == T0
        h.advance(timedelta(days=1))  # the sleep ends; the charge fails and waits 10 s
        assert h.get(handle).nodes["charge"].status == NodeStatus.RUNNING
        view = h.run(handle)  # the backoffs are the run's own business: it finishes
        assert view.status == RunStatus.SUCCEEDED
        assert view.nodes["charge"].attempts == 3
        assert h.now == T0 + DAY + timedelta(seconds=30)


def test_signals_approvals_and_timeouts(tmp_path: Path) -> None:
    ductor = make_shop(tmp_path)
    with testing.harness(ductor, start_at=T0) as h:
        handle = h.start("paid", input={"id": 7}, workflow_id="order-7")
        assert h.run("order-7").nodes["paid"].status == NodeStatus.WAITING
        h.signal("order-7", "payment_received", {"amount": 10})
        view = h.run(handle)
        assert view.nodes["paid"].output == {"amount": 10}
        assert view.nodes["review"].status == NodeStatus.WAITING
        h.approve(handle, "review", by="alice", comment="ok")
        view = h.run(handle)
        assert view.status == RunStatus.SUCCEEDED
        assert view.nodes["review"].output["by"] == "alice"
        assert view.nodes["review"].output["at"] == T0.isoformat()

        rejected = h.start("paid", input={"id": 8})
        h.signal(rejected, "payment_received")
        h.reject(rejected, "review", by="bob")
        assert h.run(rejected).status == RunStatus.FAILED

        # No signal within the hour: the wait times out when the clock passes it.
        silent = h.start("paid", input={"id": 9})
        h.advance(minutes=59)
        assert h.run(silent).status == RunStatus.RUNNING
        h.advance(minutes=2)
        view = h.run(silent)
        assert view.status == RunStatus.FAILED
        assert view.nodes["paid"].status == NodeStatus.FAILED


def test_a_scatter(tmp_path: Path) -> None:
    ductor = make_shop(tmp_path)
    with testing.harness(ductor) as h:
        pack = h.stub("shop.pack", returns="boxed")
        handle = h.start("packing", input={"items": ["book", "lamp", "mug"]})
        view = h.run(handle)
        assert view.status == RunStatus.SUCCEEDED
        assert view.output == {"packed": ["boxed", "boxed", "boxed"]}
        assert sorted(c["item"] for c in pack.calls) == ["book", "lamp", "mug"]
        h.unstub("shop.pack")
        view = h.run(h.start("packing", input={"items": ["cup", "pen"]}))
        assert view.output == {"packed": ["CUP", "PEN"]}


def test_run_by_handle_run_id_and_workflow_id(tmp_path: Path) -> None:
    ductor = make_shop(tmp_path)
    with testing.harness(ductor) as h:
        handle = h.start("naps", workflow_id="naps-1")
        by_handle, by_run_id, by_workflow_id = (
            h.run(handle),
            h.run(handle.run_id),
            h.run("naps-1"),
        )
        assert by_handle.run_id == by_run_id.run_id == by_workflow_id.run_id == handle.run_id
        kinds = [m.kind for m in h.messages]
        assert kinds[:1] == ["first_tick"] and "step" not in kinds  # eager ticks, the default


def test_bad_input_is_refused_clearly(tmp_path: Path) -> None:
    ductor = make_shop(tmp_path)
    with testing.harness(ductor) as h:
        with pytest.raises(DefinitionError, match=r"no step named 'shop\.refund'.*shop\.charge"):
            h.stub("shop.refund", returns=1)
        with pytest.raises(KeyError):
            h.stub("nope")
        with pytest.raises(ValueError, match="one of returns=, raises= or hangs=True"):
            h.stub("shop.charge", returns=1, raises=ValueError)
        with pytest.raises(TypeError, match="exception or exception class"):
            h.stub("shop.charge", raises="boom")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="forward only"):
            h.advance(seconds=-1)
        with pytest.raises(testing.HarnessError, match="inside a harness already"):
            with testing.harness(ductor):
                pass
    with pytest.raises(ValueError, match="aware datetime"):
        with testing.harness(ductor, start_at=datetime(2030, 1, 1)):  # noqa: DTZ001
            pass


def test_everything_is_restored_and_harnesses_share_nothing(tmp_path: Path) -> None:
    ductor = make_shop(tmp_path)
    settings = ductor.settings
    with testing.harness(ductor, start_at=T0) as h:
        h.run(h.start("naps", workflow_id="naps-1"))
        inside = ductor.settings.database_url
        assert inside != settings.database_url
        database = Path(inside.removeprefix("sqlite:///"))
        assert database.exists()
    assert ductor.settings is settings
    assert ductor.client.settings is settings and ductor.runtime.settings is settings
    assert type(ductor.runtime.dispatcher) is Dispatcher
    assert not database.parent.exists()
    with testing.harness(ductor) as h:
        assert list(ductor.list_runs()) == []
        # The same workflow id again: a new run, not the first harness's.
        h.start("naps", workflow_id="naps-1")
        assert len(ductor.list_runs()) == 1
    # The user's own database and broker, as before: the run is there and its wake-up queued.
    handle = ductor.start("naps", workflow_id="naps-1")
    view = ductor.get(handle.run_id)
    assert view.status == RunStatus.PENDING
    assert abs(view.created_at - datetime.now(UTC)) < timedelta(minutes=5)  # the real clock
    assert (tmp_path / "user.sqlite3").exists()


def test_the_example_of_docs_testing_md_runs_as_written() -> None:
    """The page's example, executed as it is printed (examples that cannot rot)."""
    from celery import _state

    page = (Path(__file__).resolve().parents[2] / "docs" / "testing.md").read_text()
    code = page.split("```python\n", 1)[1].split("```", 1)[0]
    previous = _state.get_current_app()
    namespace: dict[str, Any] = {"__name__": "docs_testing_example"}
    try:
        exec(compile(code, "docs/testing.md", "exec"), namespace)  # noqa: S102
        began = time.perf_counter()
        namespace["test_an_order_ships_a_day_later_after_two_failed_charges"]()
        elapsed = time.perf_counter() - began
    finally:
        previous.set_current()
    # A day, then retry backoffs of 10 s and 20 s, on the harness's clock: none of it is slept.
    # The bound is far above the work (a few tenths of a second) and below the shortest real
    # wait, so a noisy machine does not fail it while a real sleep would.
    assert elapsed < 10.0, f"{elapsed:.2f}s of wall time: the harness slept"


def test_child_runs_and_controls_inside_the_harness(tmp_path: Path) -> None:
    ductor = make_shop(tmp_path)
    parent = Workflow("parent")
    parent.subworkflow("nap", workflow="naps")
    parent.scatter("each", workflow="naps", over="$.input.items", as_child_runs=True)
    ductor.register(parent)
    with testing.harness(ductor, start_at=T0) as h:
        handle = h.start("parent", input={"items": [1, 2]})
        view = h.run(handle)
        assert view.nodes["nap"].status == NodeStatus.WAITING  # its child sleeps
        assert len(ductor.list_runs(workflow="naps")) == 3
        h.advance(hours=2)
        view = h.run(handle)
        assert view.status == RunStatus.SUCCEEDED
        assert view.nodes["nap"].finished_at == T0 + timedelta(hours=2)

        # A control on the Ductor itself is applied before the call returns, on the clock.
        other = h.start("naps")
        ductor.cancel(other.run_id, reason="not needed")
        view = h.get(other)
        assert view.status == RunStatus.CANCELLED and view.finished_at == h.now
        assert h.run(other).status == RunStatus.CANCELLED


def test_advance_fires_schedules_and_delayed_starts_in_time_order(tmp_path: Path) -> None:
    """Schedules (their own table) and delayed starts (timer rows) fire as the clock passes
    them, each at its own time, with the runs they start driven to the end."""
    ductor = make_shop(tmp_path)
    with testing.harness(ductor, start_at=T0) as h:
        ductor.schedule("hourly", workflow="packing", every=3600, input={"items": ["a"]})
        later = ductor.start("packing", input={"items": ["late"]}, delay=5400)
        assert h.get(later.run_id).status == RunStatus.PENDING
        h.advance(hours=3)
        runs = [v for v in ductor.list_runs(limit=100) if v.workflow_id.startswith("hourly@")]
        fire_times = sorted(datetime.fromisoformat(v.workflow_id.split("@")[1]) for v in runs)
        assert fire_times == [T0 + timedelta(hours=n) for n in (1, 2, 3)]
        assert {v.status for v in runs} == {RunStatus.SUCCEEDED}
        assert h.get(later.run_id).status == RunStatus.SUCCEEDED
        assert h.get(later.run_id).output == {"packed": ["LATE"]}


# -- times at the edge of the calendar (issue 22 item 7) -----------------------------------


@pytest.mark.parametrize(
    ("amount", "needle"),
    [
        ({"days": 1e12}, "advance(days=1000000000000.0) is not a time the clock can move to"),
        ({"days": 2_600_000}, "past 9000-01-01"),
        ({"seconds": float("nan")}, "advance(seconds=nan) is not a time"),
        ({"hours": float("inf")}, "advance(hours=inf) is not a time"),
        ({"seconds": timedelta(days=999_999_999)}, "is not a time the clock can move to"),
    ],
)
def test_advance_refuses_amounts_past_the_calendar(
    tmp_path: Path, amount: dict[str, Any], needle: str
) -> None:
    ductor = make_shop(tmp_path)
    with testing.harness(ductor, start_at=T0) as h:
        handle = h.start("naps")
        with pytest.raises(ValueError) as raised:
            h.advance(**amount)
        assert type(raised.value) is ValueError and needle in str(raised.value)
        assert h.now == T0
        assert h.run(handle).nodes["first"].status == NodeStatus.WAITING


@pytest.mark.parametrize(
    "start_at",
    [
        datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=14))),
        datetime(9999, 12, 31, 23, tzinfo=UTC),
        datetime(1, 1, 1, tzinfo=UTC),
    ],
)
def test_a_harness_clock_past_the_calendar_is_refused(tmp_path: Path, start_at: datetime) -> None:
    ductor = make_shop(tmp_path)
    with pytest.raises(ValueError, match="start_at"):
        with testing.harness(ductor, start_at=start_at):
            pass


def test_start_at_is_bounded_by_the_harness_clock_and_runs_work_near_its_end(
    tmp_path: Path,
) -> None:
    ductor = make_shop(tmp_path)
    ten_years = timedelta(seconds=MAX_DURATION_S)
    near_the_end = LATEST_NOW - timedelta(days=1)
    with testing.harness(ductor, start_at=near_the_end) as h:
        # Ten years ahead of the harness's clock (the database's), not the wall clock's.
        with pytest.raises(ValueError, match="at most ten years"):
            h.start("naps", start_at=h.now + ten_years + timedelta(hours=1))
        later = h.start("naps", start_at=h.now + timedelta(hours=1), deadline=MAX_DURATION_S)
        h.advance(hours=3, minutes=1)
        view = h.run(later)
        assert view.status == RunStatus.SUCCEEDED
        assert view.deadline_at == near_the_end + timedelta(hours=1) + ten_years
        with pytest.raises(ValueError, match="past 9000-01-01"):
            h.advance(days=2)
