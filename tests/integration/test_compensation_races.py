"""Compensation at its edges, on both databases (docs/compensation.md, "Attempts in flight
when the saga starts" and after): a step still running when another fails, outcomes written
but not folded when a cancel or terminate arrives, a lost wake-up, a cancel of a paused run,
and the idempotency keys of a node rerun after being undone. The real store, ticks and the
worker's own attempt code (``execute_attempt``) run in this process."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from support import unclaimed_attempts

from ductor_celery import Ductor, NodeStatus, RetryPolicy, RunStatus, StepContext, Workflow
from ductor_celery.runtime.outcome import _non_retryable_of
from ductor_celery.runtime.steps import execute_attempt
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store import sweep
from ductor_celery.store.migrate import upgrade
from ductor_celery.store.schema import workflow_outbox, workflow_run

ONE = RetryPolicy(max_attempts=1)


class Ledger:
    def __init__(self) -> None:
        self.entries: list[tuple[Any, ...]] = []
        self.gate = threading.Event()  # a "slow" charge waits for it


@pytest.fixture(params=["sqlite", "postgresql"])
def setup(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Ductor, Ledger]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/races.sqlite3"
        upgrade(url)
    else:
        url = request.getfixturevalue("database_url")
    app = Celery(f"races{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    app.conf.ductor_eager_ticks = False
    app.conf.ductor_cancel_grace = 0  # the hardest case: nothing waits for a cooperative stop
    d = Ductor(app, database_url=url)
    d.runtime.dispatcher.send = lambda rows: None  # type: ignore[method-assign]
    d.runtime.dispatcher.wake = lambda run_id: None  # type: ignore[method-assign]
    d.runtime.dispatcher.first_tick = lambda run_id: None  # type: ignore[method-assign]
    ledger = Ledger()

    @d.step(name="races.charge")
    def charge(ctx: StepContext, slow: bool = False) -> dict[str, str]:
        if slow:
            ledger.gate.wait(20)
        charge_id = f"ch_{sum(1 for e in ledger.entries if e[0] == 'charge') + 1}"
        ledger.entries.append(("charge", charge_id, ctx.idempotency_key))
        return {"charge_id": charge_id}

    @d.step(name="races.ship", retry=ONE)
    def ship(ctx: StepContext) -> None:
        ledger.entries.append(("ship",))
        raise RuntimeError("no truck")

    @d.step(name="races.refund", retry=RetryPolicy(max_attempts=1, non_retryable=(LookupError,)))
    def refund(ctx: StepContext, output: dict[str, str], input: Any) -> str:
        ledger.entries.append(("refund", output["charge_id"], ctx.idempotency_key))
        return f"refunded {output['charge_id']}"

    side = Workflow("side_by_side")
    side.step("charge", charge, args={"slow": True}, compensate=refund)
    side.step("ship", ship)
    d.register(side)
    seq = Workflow("in_sequence", compensate_on_cancel=True)
    seq.step("charge", charge, compensate=refund)
    seq.step("ship", ship, after=["charge"])
    d.register(seq)
    held = Workflow("held", compensate_on_cancel=True)
    held.step("charge", charge, compensate=refund)
    held.wait_signal("paid", signal="paid", after=["charge"])
    d.register(held)
    return d, ledger


def _open(d: Ductor, run_id: str) -> list[tuple[str, str]]:
    return unclaimed_attempts(d.runtime.engine(), run_id)


def _run_open(d: Ductor, run_id: str, skip: tuple[str, ...] = ()) -> None:
    for token, name in _open(d, run_id):
        if name not in skip:
            step = d.runtime.step_named(name)
            assert step is not None
            execute_attempt(d.runtime, step, token)


def _drive(d: Ductor, run_id: str, rounds: int = 60) -> Any:
    for _ in range(rounds):
        run_tick(d.runtime, run_id)
        _run_open(d, run_id)
        view = d.get(run_id)
        if view.done:
            return view
        time.sleep(0.01)
    return d.get(run_id)


def _refunded(ledger: Ledger) -> list[str]:
    return [e[1] for e in ledger.entries if e[0] == "refund"]


def test_a_charge_still_running_when_ship_fails_is_refunded(
    setup: tuple[Ductor, Ledger],
) -> None:
    d, ledger = setup
    handle = d.start("side_by_side")
    run_tick(d.runtime, handle.run_id)
    tokens = {name: token for token, name in _open(d, handle.run_id)}
    worker = threading.Thread(
        target=execute_attempt,
        args=(d.runtime, d.runtime.step_named("races.charge"), tokens["races.charge"]),
    )
    worker.start()
    deadline = time.monotonic() + 10
    while any(name == "races.charge" for _, name in _open(d, handle.run_id)):
        assert time.monotonic() < deadline, "the charge was never claimed"
        time.sleep(0.02)
    execute_attempt(d.runtime, d.runtime.step_named("races.ship"), tokens["races.ship"])
    run_tick(d.runtime, handle.run_id)  # ship failed while the charge runs
    view = d.get(handle.run_id)
    assert view.status == RunStatus.RUNNING and view.nodes["charge"].status == NodeStatus.RUNNING
    ledger.gate.set()
    worker.join()
    view = _drive(d, handle.run_id)
    assert view.status == RunStatus.FAILED
    assert _refunded(ledger) == ["ch_1"]
    assert [(c.node, c.status) for c in view.compensations] == [("charge", NodeStatus.SUCCEEDED)]


def test_a_cancel_folds_a_charge_already_written_and_refunds_it(
    setup: tuple[Ductor, Ledger],
) -> None:
    d, ledger = setup
    handle = d.start("in_sequence")
    run_tick(d.runtime, handle.run_id)
    _run_open(d, handle.run_id)  # the charge succeeded; its outcome is not folded yet
    d.cancel(handle.run_id, reason="customer changed their mind")
    view = _drive(d, handle.run_id)
    assert view.status == RunStatus.CANCELLED
    assert view.nodes["charge"].status == NodeStatus.SUCCEEDED
    assert _refunded(ledger) == ["ch_1"]


def test_a_cancel_of_a_paused_run_runs_its_saga(setup: tuple[Ductor, Ledger]) -> None:
    d, ledger = setup
    handle = d.start("held")
    for _ in range(3):
        run_tick(d.runtime, handle.run_id)
        _run_open(d, handle.run_id)
    assert d.get(handle.run_id).nodes["paid"].status == NodeStatus.WAITING
    d.pause(handle.run_id)
    d.cancel(handle.run_id, reason="bye")
    view = _drive(d, handle.run_id)
    assert view.status == RunStatus.CANCELLED
    assert _refunded(ledger) == ["ch_1"]


def test_terminate_racing_a_finished_refund_then_redrive_refunds_each_charge_once(
    setup: tuple[Ductor, Ledger],
) -> None:
    d, ledger = setup
    handle = d.start("in_sequence")
    for _ in range(4):  # charge, ship fails, the saga wakes itself, the refund is dispatched
        run_tick(d.runtime, handle.run_id)
        _run_open(d, handle.run_id, skip=("races.refund",))
    assert [name for _, name in _open(d, handle.run_id)] == ["races.refund"]
    _run_open(d, handle.run_id)  # the refund succeeded; not folded yet
    d.terminate(handle.run_id, reason="stop")
    view = d.get(handle.run_id)
    assert view.status == RunStatus.TERMINATED
    assert [(c.node, c.status) for c in view.compensations] == [("charge", NodeStatus.SUCCEEDED)]
    d.redrive(handle.run_id)
    view = _drive(d, handle.run_id)
    assert view.status == RunStatus.FAILED
    charges = [e[1] for e in ledger.entries if e[0] == "charge"]
    assert charges == ["ch_1", "ch_2"]  # the undone charge ran again
    assert _refunded(ledger) == ["ch_1", "ch_2"]  # each charge refunded once


def test_idempotency_keys_change_when_an_undone_node_runs_again(
    setup: tuple[Ductor, Ledger],
) -> None:
    d, ledger = setup
    handle = d.start("in_sequence")
    assert _drive(d, handle.run_id).status == RunStatus.FAILED
    d.redrive(handle.run_id)
    assert _drive(d, handle.run_id).status == RunStatus.FAILED
    run = handle.run_id
    keys = [(e[0], e[2]) for e in ledger.entries if e[0] != "ship"]
    assert keys == [
        ("charge", f"{run}:charge"),  # a run without a saga behind it: as always
        ("refund", f"{run}:charge~compensate"),
        ("charge", f"{run}:charge#2"),  # a new charge: the first one was refunded
        ("refund", f"{run}:charge~compensate#2"),  # its own refund
    ]


def test_a_lost_wake_up_of_the_saga_is_backed_by_a_timer(setup: tuple[Ductor, Ledger]) -> None:
    d, ledger = setup
    handle = d.start("in_sequence")
    engine = d.runtime.engine()
    run_tick(d.runtime, handle.run_id)
    _run_open(d, handle.run_id)  # charge succeeds
    run_tick(d.runtime, handle.run_id)
    _run_open(d, handle.run_id)  # ship fails
    run_tick(d.runtime, handle.run_id)  # the saga starts; it wakes itself to read charge's output
    assert _open(d, handle.run_id) == []
    with engine.begin() as conn:  # sent, then lost by the broker
        conn.execute(sa.delete(workflow_outbox).where(workflow_outbox.c.run_id == handle.run_id))
    deadline = time.monotonic() + 10
    while handle.run_id not in sweep.due_timer_runs(engine, rewake_after=0):
        assert time.monotonic() < deadline, "nothing would ever tick this run again"
        time.sleep(0.1)
    view = _drive(d, handle.run_id)
    assert view.status == RunStatus.FAILED and _refunded(ledger) == ["ch_1"]


def test_a_compensations_non_retryable_comes_from_its_pinned_spec(
    setup: tuple[Ductor, Ledger],
) -> None:
    """Not from the step object the worker has now (a deploy may have changed it)."""
    d, _ = setup
    handle = d.start("in_sequence")
    with d.runtime.engine().connect() as conn:
        spec_hash = conn.execute(
            sa.select(workflow_run.c.spec_hash).where(workflow_run.c.run_id == handle.run_id)
        ).scalar_one()
    now = SimpleNamespace(retry=RetryPolicy(non_retryable=(KeyError,)))
    claimed = SimpleNamespace(spec_hash=spec_hash, node="charge~compensate", token="t")
    found = _non_retryable_of(d.runtime, now, claimed)  # type: ignore[arg-type]
    assert found == frozenset({"builtins.LookupError"})
