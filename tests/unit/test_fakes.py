"""The shipped fakes (``ductor_celery.fakes``) under the production tick loop
(``coordinator.Coordinator``): runs driven with no database and no broker, version checks,
rollback, the busy lock, and what the fake refuses to pretend."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from support import FakeStep

from ductor_celery.coordinator import (
    Coordinator,
    OutcomeNotCarried,
    TickClaim,
    TickOutcome,
    TickResult,
    TickStats,
    VersionConflict,
)
from ductor_celery.definition import RetryPolicy, Workflow
from ductor_celery.definition.retry import ConcurrencyLimit
from ductor_celery.definition.spec import approval_signal
from ductor_celery.engine import AttemptOutcome, AttemptResult, RunStatus, compute_tick
from ductor_celery.engine.kinds import DispatchKind
from ductor_celery.fakes import (
    InMemoryStore,
    InMemoryTransaction,
    NotModelled,
    RecordingDispatcher,
)


def _world() -> tuple[InMemoryStore, RecordingDispatcher, Coordinator[Any]]:
    store = InMemoryStore()
    sent = RecordingDispatcher(store)
    return store, sent, Coordinator(store, sent)


def _work(store: InMemoryStore, sent: RecordingDispatcher, results: dict[str, Any]) -> int:
    """Play the step workers for every step message sent since the last call: claim, then
    finish with ``results[node]`` (an exception instance fails it). How many ran."""
    ran = 0
    for row in sent.take():
        if row.kind != DispatchKind.STEP:
            continue
        token = row.payload["token"]
        assert store.claim(token)
        outcome = results[row.payload["node"]]
        if isinstance(outcome, Exception):
            store.finish(token, error={"type": type(outcome).__name__, "message": str(outcome)})
        elif callable(outcome):
            store.finish(token, output=outcome(store.attempt(token).args))
        else:
            store.finish(token, output=outcome)
        ran += 1
    return ran


def test_a_run_goes_from_start_to_its_output_through_the_real_tick_loop() -> None:
    store, sent, coordinator = _world()
    wf = Workflow("two")
    wf.step("a", "s.a", args={"x": "$.input.x"})
    wf.step("b", "s.b", after=["a"], args={"y": "$.nodes.a.output"})
    wf.output({"a": "$.nodes.a.output", "b": "$.nodes.b.output"})
    run_id = store.start(wf.build(), input={"x": 2})

    assert coordinator.tick(run_id).outcome == "committed"
    assert store.run(run_id).status == "running"
    assert _work(store, sent, {"a": lambda args: args["x"] * 10}) == 1
    assert coordinator.tick(run_id).outcome == "committed"
    assert _work(store, sent, {"b": lambda args: args["y"] + 1}) == 1
    result = coordinator.tick(run_id)

    run = store.run(run_id)
    assert (run.status, run.output, run.record_version) == ("succeeded", {"a": 20, "b": 21}, 3)
    assert result.payload is not None and result.payload.status == RunStatus.SUCCEEDED
    assert [(t.node, t.to_status) for t in store.tables.transitions] == [
        (None, "running"),
        ("a", "running"),
        ("a", "succeeded"),
        ("b", "running"),
        ("b", "succeeded"),
        (None, "succeeded"),
    ]
    assert store.tables.outbox == {}, "every sent row was deleted, as the janitor does"
    assert run_id not in store.tables.timers
    duplicate = coordinator.tick(run_id)
    assert duplicate.outcome == TickOutcome.NOOP, "a duplicate wake-up commits nothing"
    assert str(result) == "committed" and result != TickResult(TickOutcome.NOOP)
    assert store.run(run_id).record_version == 3


def test_a_retry_waits_for_its_backoff_on_the_store_clock_and_copies_its_arguments() -> None:
    store, sent, coordinator = _world()
    wf = Workflow("flaky")
    wf.step("a", "s.a", args={"n": 1}, retry=RetryPolicy(max_attempts=2, initial_interval=5.0))
    run_id = store.start(wf.build())
    coordinator.tick(run_id)
    _work(store, sent, {"a": RuntimeError("first time")})
    coordinator.tick(run_id)
    assert store.state(run_id).nodes["a"].step.retry_at is not None
    assert store.tables.timers[run_id] == store.now + timedelta(seconds=5)
    assert coordinator.tick(run_id).outcome == "noop", "the backoff has not passed"
    store.advance(5)
    assert coordinator.tick(run_id).outcome == "committed"
    [retry] = store.open_attempts(run_id)
    assert (retry.attempt, retry.args) == (2, {"n": 1})
    _work(store, sent, {"a": "ok"})
    coordinator.tick(run_id)
    assert (store.run(run_id).status, store.run(run_id).output) == ("succeeded", None)
    assert store.state(run_id).nodes["a"].step.attempt == 2


def test_a_commit_on_a_version_that_moved_is_refused_and_writes_nothing() -> None:
    store, sent, coordinator = _world()
    wf = Workflow("one")
    wf.step("a", "s.a")
    run_id = store.start(wf.build())
    with store.transaction() as tx:
        found = tx.load(run_id, wait_for_lock=True)
    assert found is not None
    loaded, spec, inputs = found
    stale = compute_tick(spec, loaded.state, inputs, loaded.now)
    assert coordinator.tick(run_id).outcome == "committed"  # another tick commits first
    before = store.tables.snapshot()
    with pytest.raises(VersionConflict):
        with store.transaction() as tx:
            tx.commit(loaded, stale, None)
    assert store.tables == before, "the refused commit left every row as it was"


def test_a_conflict_found_half_way_rolls_the_whole_commit_back() -> None:
    store, sent, coordinator = _world()
    wf = Workflow("timeout")
    wf.step("a", "s.a", timeout=10.0, retry=RetryPolicy(max_attempts=2))
    run_id = store.start(wf.build())
    coordinator.tick(run_id)
    [token] = sent.step_tokens()
    store.claim(token)
    store.advance(11)  # past its timeout: the next tick closes it as timed out

    with store.transaction() as tx:
        found = tx.load(run_id, wait_for_lock=True)
    assert found is not None
    loaded, spec, inputs = found
    closing = compute_tick(spec, loaded.state, inputs, loaded.now)
    assert [c.token for c in closing.closed] == [token]
    store.finish(token, output="late but in time")  # the worker finishes it meanwhile
    before = store.tables.snapshot()
    with pytest.raises(VersionConflict, match="finished meanwhile"):
        with store.transaction() as tx:
            tx.commit(loaded, closing, None)
    assert store.tables == before, "the run update made before the conflict was undone"
    # The coordinator recomputes from the store as it is: the worker's result is folded.
    coordinator.tick(run_id)
    assert store.run(run_id).output is None and store.run(run_id).status == "succeeded"
    assert store.attempt(token).outcome == "succeeded"


def test_the_coordinator_recomputes_after_a_conflict_and_counts_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = InMemoryStore()
    stats = TickStats()
    coordinator = Coordinator(store, RecordingDispatcher(store), stats=stats)
    wf = Workflow("one")
    wf.step("a", "s.a")
    run_id = store.start(wf.build())
    real_load = InMemoryTransaction.load
    raced: list[int] = []

    def load_then_race(
        self: InMemoryTransaction, rid: str, *, wait_for_lock: bool, lock_late: bool = False
    ) -> Any:
        found = real_load(self, rid, wait_for_lock=wait_for_lock, lock_late=lock_late)
        if not raced:  # another writer commits the run between this load and its commit
            store.run(rid).record_version += 1
            raced.append(1)
        return found

    monkeypatch.setattr(InMemoryTransaction, "load", load_then_race)
    assert coordinator.tick(run_id).outcome == "committed"
    assert (stats.conflicts, stats.outcomes["committed"]) == (1, 1)
    # The first commit rolled back with the race's bump; the recomputed one committed.
    assert store.run(run_id).record_version == 1
    assert len(store.open_attempts(run_id)) == 1


def test_an_eager_tick_carries_an_outcome_and_writes_nothing_of_it_unless_it_commits() -> None:
    store, sent, coordinator = _world()
    wf = Workflow("one")
    wf.step("a", "s.a")
    run_id = store.start(wf.build())
    coordinator.tick(run_id)
    [token] = sent.step_tokens()
    store.claim(token)
    carried = AttemptResult(token=token, node="a", outcome=AttemptOutcome.SUCCEEDED, output=5)

    with store.held_elsewhere(run_id):
        assert coordinator.tick(run_id, eager=True, carried=carried).outcome == "busy"
    assert store.attempt(token).finished_at is None, "busy: nothing of it is written"
    assert coordinator.tick(run_id, eager=True, carried=carried).outcome == "committed"
    row = store.attempt(token)
    assert (row.outcome, row.output, row.folded) == ("succeeded", 5, True)
    assert store.run(run_id).status == "succeeded"
    version = store.run(run_id).record_version
    with pytest.raises(OutcomeNotCarried):  # carried again: applied once, never twice
        coordinator.tick(run_id, eager=True, carried=carried)
    assert store.run(run_id).record_version == version


def test_signals_approvals_and_controls_go_through_the_fake_as_through_the_tables() -> None:
    store, sent, coordinator = _world()
    wf = Workflow("wait")
    wf.wait_signal("paid", signal="payment")
    wf.approval("review", after=["paid"])
    wf.step("ship", "s.ship", after=["review"], args={"paid": "$.nodes.paid.output"})
    wf.output({"paid": "$.nodes.paid.output", "review": "$.nodes.review.output.approved"})
    run_id = store.start(wf.build(), workflow_id="order-1")
    coordinator.tick(run_id)
    assert store.state(run_id).nodes["paid"].status == "waiting"
    signal_id = store.signal(run_id, "payment", {"amount": 3})
    coordinator.tick(run_id)
    assert store.tables.signals[0].applied_to == "paid" and signal_id == store.tables.signals[0].id
    store.signal(run_id, approval_signal("review"), {"approved": True, "by": "al"})
    coordinator.tick(run_id)
    assert _work(store, sent, {"ship": lambda args: args["paid"]}) == 1
    coordinator.tick(run_id)
    assert store.run(run_id).output == {"paid": {"amount": 3}, "review": True}

    second = store.start(wf.build(), workflow_id="order-2")
    coordinator.tick(second)
    store.control(second, "cancel", reason="changed my mind")
    coordinator.tick(second)
    assert store.run(second).status == "cancelled"
    assert store.tables.controls[-1].result == "applied"


def test_scatters_and_child_runs_gather_from_the_fake_rows() -> None:
    store, sent, coordinator = _world()
    child = Workflow("child")
    child.step("c", "s.c", args={"v": "$.input.v"})
    child.output("$.nodes.c.output")
    child_spec = child.build()
    parent = Workflow("parent")
    parent.scatter("each", "s.each", over="$.input.items", item_arg="item", max_parallel=2)
    parent.subworkflow("sub", workflow="child", input={"v": "$.nodes.each.output"}, after=["each"])
    parent.output("$.nodes.sub.output")
    store.add_definition(child_spec)
    run_id = store.start(parent.build(None, {"child": child_spec}.get), input={"items": [1, 2, 3]})

    results = {"each": lambda args: args["item"] * 2, "c": lambda args: sum(args["v"])}
    for _ in range(20):
        woken = [r.run_id for r in sent.sent if r.kind == DispatchKind.WAKEUP]
        _work(store, sent, results)
        for rid in [run_id, *woken, *(r for r in store.tables.runs if r != run_id)]:
            coordinator.tick(rid)
        if store.run(run_id).status == "succeeded":
            break
    assert store.run(run_id).output == 12
    [child_row] = [r for r in store.tables.runs.values() if r.parent_run_id == run_id]
    assert child_row.input == {"v": [2, 4, 6]} and child_row.status == "succeeded"


def test_a_concurrency_limit_is_refused_as_not_modelled_and_nothing_is_written() -> None:
    store, sent, coordinator = _world()
    wf = Workflow("limited")
    wf.step("a", FakeStep(concurrency=ConcurrencyLimit(key="$.input.k", limit=1)))
    run_id = store.start(wf.build(), input={"k": "x"})
    with pytest.raises(NotModelled, match="concurrency leases"):
        coordinator.tick(run_id)
    assert store.run(run_id).record_version == 0 and store.tables.attempts == {}


def test_the_fake_refuses_values_json_cannot_hold_and_a_clock_that_goes_back() -> None:
    store = InMemoryStore()
    wf = Workflow("one")
    wf.step("a", "s.a")
    with pytest.raises(ValueError, match="not storable as JSON"):
        store.start(wf.build(), input={"when": object()})
    assert store.tables.runs == {}
    with pytest.raises(ValueError, match="only moves forward"):
        store.advance(-1)
    with pytest.raises(ValueError, match="aware datetime"):
        InMemoryStore(now=datetime(2024, 1, 1))  # noqa: DTZ001 - the naive clock refused


def test_an_eager_tick_claims_the_attempt_its_worker_keeps_and_sends_no_message_for_it() -> None:
    store, sent, coordinator = _world()
    wf = Workflow("two")
    wf.step("a", "s.a")
    wf.step("b", "s.b", after=["a"])
    run_id = store.start(wf.build())
    coordinator.tick(run_id)
    [first] = sent.step_tokens()
    sent.take()
    store.claim(first)
    store.finish(first, output=1)

    class Keep:
        chosen: list[str] = []

        def choose(self, loaded: Any, payload: Any) -> TickClaim | None:
            return TickClaim(payload.new_attempts[0].token, "w-inline")

        def committed(self) -> None:
            self.chosen.append("committed")

        def refused(self) -> None:
            self.chosen.append("refused")

    keep = Keep()
    result = coordinator.tick(run_id, eager=True, keep=keep)
    assert result.outcome == "committed" and keep.chosen == ["committed"]
    [second] = store.open_attempts(run_id)
    assert (second.claimed_by, second.claimed_at) == ("w-inline", store.now)
    assert sent.step_tokens() == [], "the worker runs it itself: no step message"
    assert not store.claim(second.token), "a duplicate message would find it claimed"


def test_a_terminate_also_kills_the_carrier_of_an_attempt_with_no_message_of_its_own() -> None:
    """The fake's commit reads each closed attempt's carrier as the SQL one does, and a
    revoke that terminates also names it (coordinator/rows.py, ``carrier_revokes``)."""
    store, sent, coordinator = _world()
    wf = Workflow("two")
    wf.step("a", "s.a")
    wf.step("b", "s.b", after=["a"])
    run_id = store.start(wf.build())
    coordinator.tick(run_id)
    [first] = sent.step_tokens()
    sent.take()
    store.claim(first, carrier=first)
    store.finish(first, output=1)

    class Keep:
        def choose(self, loaded: Any, payload: Any) -> TickClaim | None:
            return TickClaim(payload.new_attempts[0].token, "w-inline", carrier=first)

        def committed(self) -> None:
            pass

        def refused(self) -> None:
            pass

    coordinator.tick(run_id, eager=True, keep=Keep())
    [second] = store.open_attempts(run_id)
    assert second.carrier == first
    store.control(run_id, "terminate", reason="stop")
    coordinator.tick(run_id)
    assert store.run(run_id).status == "terminated"
    revokes = [r.payload for r in sent.take() if r.kind == DispatchKind.REVOKE]
    assert [(p["token"], p.get("terminate"), p.get("carrier_of")) for p in revokes] == [
        (second.token, True, None),
        (first, True, second.token),
    ]


def test_carrier_revokes_name_each_killing_revokes_carrier_once() -> None:
    """Only a revoke that terminates names a carrier; one that is the attempt's own token, or
    was revoked already (another revoke, another attempt of the same chain), is not sent
    twice; an attempt with no recorded carrier has none."""
    from ductor_celery.coordinator.rows import carrier_revokes
    from ductor_celery.engine import RunState, TickPayload
    from ductor_celery.engine.inputs import Dispatch

    def revoke(token: str, terminate: bool = True) -> Dispatch:
        return Dispatch(DispatchKind.REVOKE, "r", "n", token, "s", None, terminate)

    payload = TickPayload(state=RunState())
    payload.dispatches = [revoke("t1"), revoke("t2"), revoke("t3"), revoke("t4"), revoke("m")]
    carriers = {"t1": "m", "t2": "c", "t3": "c", "t4": None, "m": "m"}
    assert [
        (r["payload"]["token"], r["payload"]["carrier_of"])
        for r in carrier_revokes(payload, carriers)
    ] == [("c", "t2")]
    payload.dispatches = [revoke("t1", terminate=False)]
    assert carrier_revokes(payload, {"t1": "m"}) == []


def test_a_coordinator_tick_cannot_wait_for_a_lock_in_one_thread_and_says_so() -> None:
    store, _, coordinator = _world()
    wf = Workflow("one")
    wf.step("a", "s.a")
    run_id = store.start(wf.build())
    with store.held_elsewhere(run_id), pytest.raises(RuntimeError, match="cannot wait"):
        coordinator.tick(run_id)
    assert store.run(run_id).record_version == 0


def test_a_redrive_racing_a_start_of_its_workflow_id_is_rejected_and_the_run_kept() -> None:
    store, sent, coordinator = _world()
    wf = Workflow("one")
    wf.step("a", "s.a", retry=RetryPolicy(max_attempts=1))
    spec = wf.build()
    failed = store.start(spec, workflow_id="order-7")
    coordinator.tick(failed)
    _work(store, sent, {"a": RuntimeError("no")})
    coordinator.tick(failed)
    assert store.run(failed).status == "failed"
    newer = store.start(spec, workflow_id="order-7")  # the workflow id is free again
    store.control(failed, "redrive")
    assert coordinator.tick(failed).outcome == "noop"  # recomputed after the rejection
    assert store.run(failed).status == "failed" and store.run(newer).status == "pending"
    assert store.tables.controls[-1].result == ("rejected: another run of this workflow id is open")


def test_the_fake_keeps_deadlines_and_the_cooperative_cancel_as_the_tables_do() -> None:
    store, sent, coordinator = _world()
    wf = Workflow("long")
    wf.step("a", "s.a")
    spec = wf.build()
    timed = store.start(spec, deadline=60)
    coordinator.tick(timed)
    assert store.state(timed).deadline_at == store.now + timedelta(seconds=60)
    store.advance(60)
    coordinator.tick(timed)
    assert store.run(timed).status == "timed_out"
    revoke = [r for r in sent.take() if r.kind == DispatchKind.REVOKE]
    assert [r.payload.get("terminate") for r in revoke] == [True]

    asked = store.start(spec)
    coordinator.tick(asked)
    token = sent.take()[0].payload["token"]
    assert store.claim(token) and not store.should_stop(token)
    store.control(asked, "cancel")
    coordinator.tick(asked)
    assert store.run(asked).status == "running" and store.should_stop(token)
    assert store.finish(token, error={"type": "StepCancelled"}, cancelled=True)
    coordinator.tick(asked)
    assert store.run(asked).status == "cancelled"
    assert store.attempt(token).outcome == "cancelled"


def _lock_late_asked(monkeypatch: Any) -> list[bool]:
    """Each load's ``lock_late``, in order, as the coordinator asks the in-memory store."""
    real_load = InMemoryTransaction.load
    asked: list[bool] = []

    def recording(self: InMemoryTransaction, rid: str, **kwargs: Any) -> Any:
        asked.append(kwargs.get("lock_late", False))
        return real_load(self, rid, **kwargs)

    monkeypatch.setattr(InMemoryTransaction, "load", recording)
    return asked


@pytest.mark.parametrize(
    ("branch", "lock_late"),
    [(None, True), (3, False)],
    ids=["a plain step's outcome", "a scatter branch's"],
)
def test_only_a_plain_steps_carried_outcome_lets_the_tick_lock_the_run_late(
    monkeypatch: Any, branch: int | None, lock_late: bool
) -> None:
    """docs/tick-without-transaction.md: a scatter's branches finish together, and a tick
    that locks only at its commit computes for nothing when another wins; theirs lock at the
    load, as a tick that carries nothing does."""
    store = InMemoryStore()
    coordinator = Coordinator(store, RecordingDispatcher(store))
    wf = Workflow("one")
    wf.step("a", "s.a")
    run_id = store.start(wf.build())
    asked = _lock_late_asked(monkeypatch)
    coordinator.tick(run_id)
    carried = AttemptResult(
        token="t", node="a", outcome=AttemptOutcome.SUCCEEDED, output=None, branch=branch
    )
    try:
        coordinator.tick(run_id, eager=True, carried=carried)
    except OutcomeNotCarried:
        pass  # the token is made up: what matters is how the load was asked
    assert asked == [False, lock_late]


def test_a_runs_first_tick_lets_the_tick_lock_the_run_late(monkeypatch: Any) -> None:
    """The first tick of a run just started (``first``, on a step worker) meets no other
    tick but a coordinator woken for the run: it locks the run at its commit only; an eager
    tick that carries nothing and is not a first tick locks at its load."""
    store = InMemoryStore()
    coordinator = Coordinator(store, RecordingDispatcher(store))
    wf = Workflow("one")
    wf.step("a", "s.a")
    wf.step("b", "s.b", after=["a"])
    run_id = store.start(wf.build())
    asked = _lock_late_asked(monkeypatch)
    assert coordinator.tick(run_id, eager=True, first=True).outcome == "committed"
    coordinator.tick(run_id, eager=True)
    assert asked == [True, False]
