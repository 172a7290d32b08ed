"""Compensation (sagas) on both databases (docs/compensation.md): the real store, ticks and
the worker's own attempt code (``execute_attempt``) in this process, so every step is
deterministic. tests/e2e/test_compensation_e2e.py does it with real Celery workers."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from support import unclaimed_attempts

from ductor_celery import (
    DefinitionError,
    Ductor,
    InvalidOperation,
    NodeStatus,
    NonRetryableError,
    RetryPolicy,
    RunStatus,
    StepContext,
    Workflow,
)
from ductor_celery.runtime.steps import execute_attempt
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store.migrate import upgrade
from ductor_celery.store.schema import step_attempt, workflow_definition

FAST = RetryPolicy(max_attempts=3, initial_interval=0.01, backoff=1.0)


class Ledger:
    """What the steps did, in order, and how the test wants the flaky ones to behave."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, Any]] = []
        self.refund_failures = 0  # the next N refund attempts raise
        self.refund_refuses = False  # refunds fail without retry
        self.refusal = "refund refused by the bank"


@pytest.fixture(params=["sqlite", "postgresql"])
def setup(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Ductor, Ledger]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/saga.sqlite3"
        upgrade(url)
    else:
        url = request.getfixturevalue("database_url")
    app = Celery(f"saga{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    app.conf.ductor_eager_ticks = False
    app.conf.ductor_cancel_grace = 0  # a cancel closes attempts in flight at once
    d = Ductor(app, database_url=url)
    # Nothing is consumed from the broker here: this test runs ticks and attempts itself.
    d.runtime.dispatcher.send = lambda rows: None  # type: ignore[method-assign]
    d.runtime.dispatcher.wake = lambda run_id: None  # type: ignore[method-assign]
    d.runtime.dispatcher.first_tick = lambda run_id: None  # type: ignore[method-assign]
    ledger = Ledger()

    @d.step(name="saga.reserve")
    def reserve(ctx: StepContext, item: str) -> dict[str, str]:
        ledger.entries.append(("reserve", item))
        return {"reservation": f"res-{item}"}

    @d.step(name="saga.charge")
    def charge(ctx: StepContext, amount: int) -> dict[str, Any]:
        ledger.entries.append(("charge", amount))
        return {"charge_id": "ch_1", "amount": amount}

    @d.step(name="saga.ship", retry=RetryPolicy(max_attempts=1))
    def ship(ctx: StepContext) -> None:
        ledger.entries.append(("ship", None))
        raise RuntimeError("carrier unavailable")

    @d.step(name="saga.release", retry=FAST)
    def release(ctx: StepContext, output: dict[str, str], input: dict[str, Any]) -> str:
        ledger.entries.append(("release", output["reservation"]))
        return f"released {output['reservation']} of order {input['order']}"

    @d.step(name="saga.refund", retry=FAST)
    def refund(ctx: StepContext, output: dict[str, Any], input: dict[str, Any]) -> dict[str, Any]:
        if ledger.refund_refuses:
            raise NonRetryableError(ledger.refusal)
        if ledger.refund_failures > 0:
            ledger.refund_failures -= 1
            raise RuntimeError("gateway timeout")
        ledger.entries.append(("refund", output["charge_id"]))
        return {"refunded": output["amount"], "order": input["order"]}

    wf = Workflow("order", compensate_on_cancel=True)
    wf.step("reserve", reserve, args={"item": "$.input.item"}, compensate=release)
    wf.step("charge", charge, after=["reserve"], args={"amount": 30}, compensate=refund)
    wf.step("ship", ship, after=["charge"])
    d.register(wf)

    held = Workflow("held_order")  # compensate_on_cancel not set: a cancel does not compensate
    held.step("charge", charge, args={"amount": 5}, compensate=refund)
    held.wait_signal("paid", signal="paid", after=["charge"])
    d.register(held)
    held_saga = Workflow("held_saga", compensate_on_cancel=True)
    held_saga.step("charge", charge, args={"amount": 5}, compensate=refund)
    held_saga.wait_signal("paid", signal="paid", after=["charge"])
    d.register(held_saga)
    return d, ledger


def _open_attempts(d: Ductor, run_id: str) -> list[tuple[str, str]]:
    return unclaimed_attempts(d.runtime.engine(), run_id)


def _drive(d: Ductor, run_id: str, *, skip: tuple[str, ...] = (), rounds: int = 200) -> Any:
    """Tick and run attempts until the run is finished or parked (nothing left to run but the
    steps named in ``skip``, which are left dispatched)."""
    for _ in range(rounds):
        run_tick(d.runtime, run_id)
        todo = [(t, s) for t, s in _open_attempts(d, run_id) if s not in skip]
        view = d.get(run_id)
        if not todo:
            # A compensation waiting for a retry's backoff, or for the wake-up its run sent
            # itself to read the output it is called with (no attempt open at all).
            saga = any(
                c.status in (NodeStatus.PENDING, NodeStatus.RUNNING) for c in view.compensations
            )
            if view.done or not saga or _open_attempts(d, run_id):
                return view
            time.sleep(0.02)
            continue
        for token, name in todo:
            step = d.runtime.step_named(name)
            assert step is not None
            execute_attempt(d.runtime, step, token)
    raise AssertionError(f"run {run_id} did not settle")


def _attempt_nodes(d: Ductor, run_id: str) -> list[tuple[str, str | None]]:
    with d.runtime.engine().connect() as conn:
        rows = conn.execute(
            sa.select(step_attempt.c.node, step_attempt.c.outcome)
            .where(step_attempt.c.run_id == run_id)
            .order_by(step_attempt.c.created_at, step_attempt.c.token)
        ).all()
    return [(r.node, r.outcome) for r in rows]


def test_a_failed_run_compensates_in_reverse_order_then_ends_failed(
    setup: tuple[Ductor, Ledger],
) -> None:
    d, ledger = setup
    handle = d.start("order", input={"item": "book", "order": 42})
    view = _drive(d, handle.run_id)
    assert ledger.entries == [
        ("reserve", "book"),
        ("charge", 30),
        ("ship", None),
        ("refund", "ch_1"),
        ("release", "res-book"),
    ]
    assert view.status == RunStatus.FAILED
    assert view.error["node"] == "ship" and view.error["message"] == "carrier unavailable"
    assert [(c.node, c.status, c.output) for c in view.compensations] == [
        ("charge", NodeStatus.SUCCEEDED, {"refunded": 30, "order": 42}),
        ("reserve", NodeStatus.SUCCEEDED, "released res-book of order 42"),
    ]
    # The run's nodes are the definition's: compensations are listed apart.
    assert sorted(view.nodes) == ["charge", "reserve", "ship"]
    # Ordinary attempt rows, under the compensation ids.
    assert ("charge~compensate", "succeeded") in _attempt_nodes(d, handle.run_id)
    assert ("reserve~compensate", "succeeded") in _attempt_nodes(d, handle.run_id)


def test_a_compensation_is_retried_then_succeeds(setup: tuple[Ductor, Ledger]) -> None:
    d, ledger = setup
    ledger.refund_failures = 2
    handle = d.start("order", input={"item": "pen", "order": 1})
    view = _drive(d, handle.run_id)
    assert view.status == RunStatus.FAILED
    refund = view.compensations[0]
    assert refund.node == "charge" and refund.status == NodeStatus.SUCCEEDED
    assert refund.attempts == 3
    assert [e for e in ledger.entries if e[0] in ("refund", "release")] == [
        ("refund", "ch_1"),
        ("release", "res-pen"),
    ]
    outcomes = [o for n, o in _attempt_nodes(d, handle.run_id) if n == "charge~compensate"]
    assert outcomes == ["failed", "failed", "succeeded"]


def test_a_compensation_that_fails_for_good_leaves_the_run_failed_with_both_errors(
    setup: tuple[Ductor, Ledger],
) -> None:
    d, ledger = setup
    ledger.refund_refuses = True
    handle = d.start("order", input={"item": "cup", "order": 2})
    view = _drive(d, handle.run_id)
    assert view.status == RunStatus.FAILED
    assert view.error["type"] == "CompensationFailed"
    assert view.error["error"]["message"] == "carrier unavailable"
    assert view.error["compensation"]["node"] == "charge"
    assert view.error["compensation"]["error"]["message"] == "refund refused by the bank"
    assert [(c.node, c.status) for c in view.compensations] == [
        ("charge", NodeStatus.FAILED),
        ("reserve", NodeStatus.PENDING),  # the saga stopped: not released
    ]
    assert view.compensations[0].error["message"] == "refund refused by the bank"
    assert ("release", "res-cup") not in ledger.entries


@pytest.mark.parametrize("workflow", ["held_order", "held_saga"])
def test_cancel_compensates_only_with_compensate_on_cancel(
    setup: tuple[Ductor, Ledger], workflow: str
) -> None:
    d, ledger = setup
    handle = d.start(workflow, input={"order": 3})
    view = _drive(d, handle.run_id)
    assert view.status == RunStatus.RUNNING and view.nodes["paid"].status == NodeStatus.WAITING
    d.cancel(handle.run_id, reason="customer left")
    view = _drive(d, handle.run_id)
    assert view.status == RunStatus.CANCELLED
    assert view.error == {"type": "Cancel", "message": "cancel: customer left"}
    if workflow == "held_order":
        assert view.compensations == [] and ("refund", "ch_1") not in ledger.entries
    else:
        assert [(c.node, c.status) for c in view.compensations] == [
            ("charge", NodeStatus.SUCCEEDED)
        ]
        assert ledger.entries.count(("refund", "ch_1")) == 1


def test_terminate_during_compensation_stops_it_and_ends_the_run(
    setup: tuple[Ductor, Ledger],
) -> None:
    d, ledger = setup
    handle = d.start("order", input={"item": "hat", "order": 4})
    view = _drive(d, handle.run_id, skip=("saga.refund",))
    assert view.status == RunStatus.RUNNING
    assert [(c.node, c.status) for c in view.compensations] == [
        ("charge", NodeStatus.RUNNING),
        ("reserve", NodeStatus.PENDING),
    ]
    with pytest.raises(InvalidOperation, match="compensating"):
        d.cancel(handle.run_id)
    d.terminate(handle.run_id, reason="stop it")
    view = d.get(handle.run_id)
    assert view.status == RunStatus.TERMINATED
    assert [(c.node, c.status) for c in view.compensations] == [
        ("charge", NodeStatus.CANCELLED),
        ("reserve", NodeStatus.PENDING),
    ]
    assert _open_attempts(d, handle.run_id) == []
    assert not any(e[0] in ("refund", "release") for e in ledger.entries)


def test_redrive_after_compensation_runs_the_undone_nodes_again(
    setup: tuple[Ductor, Ledger],
) -> None:
    d, ledger = setup
    handle = d.start("order", input={"item": "mug", "order": 5})
    assert _drive(d, handle.run_id).status == RunStatus.FAILED
    ledger.entries.clear()
    d.redrive(handle.run_id)
    view = d.get(handle.run_id)
    assert view.status == RunStatus.RUNNING and view.compensations == []
    view = _drive(d, handle.run_id)
    # Reserve and charge were undone, so they run again; ship fails again, and the new saga
    # undoes them again.
    assert ledger.entries == [
        ("reserve", "mug"),
        ("charge", 30),
        ("ship", None),
        ("refund", "ch_1"),
        ("release", "res-mug"),
    ]
    assert view.status == RunStatus.FAILED
    assert [c.status for c in view.compensations] == [NodeStatus.SUCCEEDED] * 2
    assert view.nodes["charge"].attempts == 2 and view.compensations[0].attempts == 2


def test_an_unregistered_compensation_step_is_refused_at_register(
    setup: tuple[Ductor, Ledger],
) -> None:
    d, _ = setup
    wf = Workflow("bad_saga")
    wf.step("charge", "saga.charge", args={"amount": 1}, compensate="saga.nope")
    with pytest.raises(DefinitionError, match="node 'charge', compensate=: unknown step"):
        d.register(wf)
    with d.runtime.engine().connect() as conn:
        names = conn.execute(sa.select(workflow_definition.c.name)).scalars().all()
    assert "bad_saga" not in names


def test_the_run_page_and_the_json_api_show_the_compensations_escaped(
    setup: tuple[Ductor, Ledger],
) -> None:
    from starlette.testclient import TestClient

    from ductor_celery.web import create_app

    d, ledger = setup
    ledger.refund_refuses = True
    ledger.refusal = "<script>alert('refund')</script>"
    handle = d.start("order", input={"item": "ink", "order": 6})
    assert _drive(d, handle.run_id).status == RunStatus.FAILED
    with TestClient(create_app(d, allowed_hosts=["testserver"])) as client:
        html = client.get(f"/runs/{handle.run_id}").text
        as_json = client.get(f"/api/runs/{handle.run_id}").json()
    assert '<tr data-compensation="charge" data-status="failed">' in html
    assert '<tr data-compensation="reserve" data-status="pending">' in html
    assert "<script>alert" not in html
    assert "&lt;script&gt;alert(&#39;refund&#39;)&lt;/script&gt;" in html
    assert [(c["node"], c["status"]) for c in as_json["compensations"]] == [
        ("charge", "failed"),
        ("reserve", "pending"),
    ]
    assert as_json["error"]["type"] == "CompensationFailed"


def test_ductor_show_lists_the_compensations(setup: tuple[Ductor, Ledger]) -> None:
    from types import SimpleNamespace

    from click.testing import CliRunner

    from ductor_celery.cli import ductor as ductor_cli

    d, _ = setup
    handle = d.start("order", input={"item": "lamp", "order": 8})
    assert _drive(d, handle.run_id).status == RunStatus.FAILED
    shown = CliRunner().invoke(
        ductor_cli, ["show", handle.run_id], obj=SimpleNamespace(app=d.app), terminal_width=200
    )
    assert shown.exit_code == 0, shown.output
    table = shown.output.split("compensations", 1)[1]
    assert table.index("charge") < table.index("reserve")
    assert "released res-lamp" in table
    as_json = CliRunner().invoke(
        ductor_cli, ["show", handle.run_id, "--json"], obj=SimpleNamespace(app=d.app)
    )
    assert as_json.exit_code == 0, as_json.output
    assert '"compensations"' in as_json.output


def test_the_testing_harness_runs_a_saga_through_its_retries(tmp_path: Path) -> None:
    """``h.run`` counts a compensation waiting for its retry's backoff as work in progress, so
    it moves the clock on until the saga is done (ductor_celery.testing)."""
    from ductor_celery import testing

    app = Celery(f"sagah{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    d = Ductor(app, database_url=f"sqlite:///{tmp_path}/harness.sqlite3")
    calls: list[int] = []

    @d.step(name="h.charge")
    def charge(ctx: StepContext) -> str:
        return "ch_9"

    @d.step(name="h.ship", retry=RetryPolicy(max_attempts=1))
    def ship(ctx: StepContext) -> None:
        raise RuntimeError("no truck")

    @d.step(name="h.refund", retry=RetryPolicy(max_attempts=5, initial_interval=60.0))
    def refund(ctx: StepContext, output: str, input: Any) -> str:
        calls.append(ctx.attempt)
        if ctx.attempt < 3:
            raise RuntimeError("bank closed")
        return f"refunded {output}"

    wf = Workflow("h_order")
    wf.step("charge", charge, compensate=refund)
    wf.step("ship", ship, after=["charge"])
    d.register(wf)
    with testing.harness(d) as h:
        view = h.run(h.start("h_order"))
    assert view.status == RunStatus.FAILED and calls == [1, 2, 3]
    assert [(c.node, c.status, c.output) for c in view.compensations] == [
        ("charge", NodeStatus.SUCCEEDED, "refunded ch_9")
    ]


def test_an_exported_saga_replays_its_compensation(setup: tuple[Ductor, Ledger]) -> None:
    """docs/replay.md: a compensation's attempts are in the export under its id, and
    ``testing.replay`` calls the compensation step with the output and input it received."""
    from ductor_celery import testing
    from ductor_celery.cli.export import export_of

    d, ledger = setup
    handle = d.start("order", input={"item": "lamp", "order": 7})
    assert _drive(d, handle.run_id).status == RunStatus.FAILED
    document = export_of(d, handle.run_id)
    nodes = [a["node"] for a in document["attempts"]]
    assert "charge~compensate" in nodes and "reserve~compensate" in nodes
    assert document["run"]["state"]["compensation"]

    ledger.entries.clear()
    assert testing.replay(document, node="charge~compensate", ductor=d) == {
        "refunded": 30,
        "order": 7,
    }
    assert ledger.entries == [("refund", "ch_1")]
    with pytest.raises(ValueError, match="charge~compensate"):  # ship has no compensation
        testing.replay(document, node="ship~compensate", ductor=d)
