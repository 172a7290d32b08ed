"""compute_tick with external input: sleeps, signals, approvals, event sets and operator controls.

Pure tests: a spec, a state, ``TickInputs(signals=..., control=...)`` and a fixed aware ``now``
in, a payload out. Every tick asserts that its input state is untouched and that the state it
returns survives a JSON round trip; ``chain`` ticks feed that round-tripped state onwards, the
way the store does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import event as note
from hypothesis import strategies as st
from support import (
    CFG,
    NOW,
    RUN,
    RUN_STARTED,
    at,
    err,
    events_of,
    iso,
    literal_of,
    ok,
    payload_of,
    pure_tick,
    signal_of,
    summary,
    token_of,
)

from ductor_celery.coordinator import Coordinator
from ductor_celery.definition import RetryPolicy, Workflow, WorkflowSpec
from ductor_celery.definition.spec import approval_signal
from ductor_celery.engine import (
    AttemptResult,
    ClosedAttempt,
    ControlIn,
    Dispatch,
    EngineConfig,
    NodeStatus,
    RunState,
    RunStatus,
    SignalIn,
    TickInputs,
    TickPayload,
)
from ductor_celery.engine.inputs import AppliedSignal, HandledControl
from ductor_celery.engine.state import StepWork
from ductor_celery.engine.status import FINISHED_NODE_STATUSES, TERMINAL_RUN_STATUSES
from ductor_celery.engine.tick import describe
from ductor_celery.fakes import InMemoryStore, RecordingDispatcher

APPLIED = "applied"


def roundtrip(state: RunState) -> RunState:
    """What the store keeps: the state through real JSON text."""
    return RunState.from_json(json.loads(json.dumps(state.to_json())))


def tick(
    spec: WorkflowSpec,
    state: RunState,
    *,
    now: datetime = NOW,
    input: Any = None,
    results: Iterable[AttemptResult] = (),
    signals: Iterable[SignalIn | tuple[int, str, Any]] = (),
    control: ControlIn | None = None,
    outputs: dict[str, Any] | None = None,
    received: dict[int, Any] | None = None,
    config: EngineConfig = CFG,
    run_id: str = RUN,
) -> TickPayload:
    """compute_tick, asserting the input state is untouched and the output survives JSON."""
    inputs = TickInputs(
        run_id=run_id,
        input=input,
        results=tuple(results),
        outputs=dict(outputs or {}),
        config=config,
        signals=tuple(s if isinstance(s, SignalIn) else SignalIn(*s) for s in signals),
        control=control,
        received=dict(received or {}),
    )
    payload = pure_tick(spec, state, inputs, now)
    assert roundtrip(payload.state) == payload.state
    assert not any("refused" in tr.reason for tr in payload.transitions), payload.transitions
    applied = [a.id for a in payload.applied_signals]
    assert len(applied) == len(set(applied)), "a signal applied twice in one tick"
    assert set(applied) <= {s.id for s in inputs.signals}
    return payload


def chain(spec: WorkflowSpec, payload: TickPayload, **kw: Any) -> TickPayload:
    """The next tick, from the previous payload's state as the store would reload it."""
    return tick(spec, roundtrip(payload.state), **kw)


def decision(approved: bool, by: str = "alice", comment: str | None = "ok") -> dict[str, Any]:
    return {"approved": approved, "by": by, "comment": comment, "at": iso(0)}


def control(kind: str, id: int = 1, reason: str | None = None, **kw: Any) -> ControlIn:
    return ControlIn(id=id, kind=kind, reason=reason, **kw)


def statuses(p: TickPayload) -> dict[str, str]:
    return {k: v.status.value for k, v in p.state.nodes.items()}


def node_moves(p: TickPayload) -> list[tuple[str | None, str | None, str]]:
    return [(tr.node, tr.from_status, tr.to_status) for tr in p.transitions]


# --- sleep ---------------------------------------------------------------------------------------


def sleeper(seconds: float = 60) -> WorkflowSpec:
    return (
        Workflow("sleeper")
        .sleep("nap", seconds=seconds)
        .step("after", "s", after=["nap"], args={"slept": "$.nodes.nap.output"})
        .build()
    )


def test_sleep_parks_waiting_with_a_deadline_that_is_the_next_wake_up() -> None:
    spec = sleeper()
    p = tick(spec, RunState())
    assert describe(p) == summary(
        nodes={"nap": "waiting", "after": "pending"},
        transitions=[RUN_STARTED, ("nap", "pending", "waiting", "sleeping 60s")],
        next_wake_at=iso(60),
    )
    assert p.state.nodes["nap"].to_json() == {
        "status": "waiting",
        "deadline": iso(60),
        "started_at": iso(0),
    }


def test_sleep_before_its_deadline_changes_nothing() -> None:
    spec = sleeper()
    s = roundtrip(tick(spec, RunState()).state)
    for seconds in (0, 1, 59.999):
        early = tick(spec, s, now=at(seconds))
        assert early.changed is False
        assert early.state == s
        assert describe(early) == summary(
            nodes={"nap": "waiting", "after": "pending"}, next_wake_at=iso(60)
        )


@pytest.mark.parametrize("fire_at", [60, 61, 86400])
def test_sleep_fires_exactly_once_at_or_after_its_deadline(fire_at: float) -> None:
    spec = sleeper()
    p1 = tick(spec, RunState())
    p2 = chain(spec, p1, now=at(fire_at))
    assert describe(p2) == summary(
        nodes={"nap": "succeeded", "after": "running"},
        new_attempts=["r1:after:1"],
        dispatches=["r1:after:1"],
        transitions=[
            ("nap", "waiting", "succeeded", "timer fired"),
            ("after", "pending", "running", "attempt 1 dispatched"),
        ],
        next_wake_at=(at(fire_at) + timedelta(seconds=30)).isoformat(),
    )
    assert p2.new_attempts[0].args == {"slept": None}  # a sleep's output is None
    assert p2.state.nodes["nap"].deadline is None
    assert p2.state.nodes["nap"].finished_at == at(fire_at)
    # Ticking again, even much later, never fires it a second time.
    p3 = chain(spec, p2, now=at(fire_at + 1000))
    assert "nap" not in [tr.node for tr in p3.transitions]
    assert p3.new_attempts == []


def test_zero_second_sleep_fires_in_the_tick_that_reaches_it() -> None:
    spec = sleeper(seconds=0)
    p = tick(spec, RunState())
    assert statuses(p) == {"nap": "succeeded", "after": "running"}
    assert node_moves(p)[1:3] == [("nap", "pending", "waiting"), ("nap", "waiting", "succeeded")]


# --- wait_signal ---------------------------------------------------------------------------------


def test_wait_signal_output_is_the_payload_and_dependants_read_it_in_the_same_tick() -> None:
    spec = (
        Workflow("w")
        .wait_signal("paid", signal="payment")
        .step("ship", "s", after=["paid"], args={"amount": "$.nodes.paid.output.amount"})
        .output({"paid": "$.nodes.paid.output"})
        .build()
    )
    p1 = tick(spec, RunState())
    assert describe(p1) == summary(
        nodes={"paid": "waiting", "ship": "pending"},
        transitions=[RUN_STARTED, ("paid", "pending", "waiting", "waiting for signal 'payment'")],
    )
    # Unrelated signals are left alone and do not count as a change.
    quiet = chain(spec, p1, now=at(5), signals=[(3, "other", {"x": 1})])
    assert quiet.changed is False and quiet.applied_signals == []
    p2 = chain(
        spec, p1, now=at(5), signals=[(3, "other", {"x": 1}), (4, "payment", {"amount": 10})]
    )
    assert p2.applied_signals == [AppliedSignal(4, "paid")]
    assert describe(p2) == summary(
        nodes={"paid": "succeeded", "ship": "running"},
        new_attempts=["r1:ship:1"],
        dispatches=["r1:ship:1"],
        transitions=[
            ("paid", "waiting", "succeeded", "signal 'payment' received (#4)"),
            ("ship", "pending", "running", "attempt 1 dispatched"),
        ],
        next_wake_at=iso(35),
    )
    assert p2.new_attempts[0].args == {"amount": 10}
    assert signal_of(p2.state.nodes["paid"]) == 4  # a reference, never the payload
    assert "amount" not in json.dumps(p2.state.to_json())
    # Later ticks get the payload from the loader (by signal id) for the run output.
    p3 = chain(spec, p2, now=at(6), results=[ok("r1:ship:1")], outputs={"paid": {"amount": 10}})
    assert p3.status == RunStatus.SUCCEEDED
    assert p3.output == {"paid": {"amount": 10}}


def test_a_signal_that_arrives_early_is_consumed_when_its_node_is_reached() -> None:
    spec = (
        Workflow("w")
        .step("a", "s")
        .step("b", "s", after=["a"])
        .wait_signal("w", signal="go", after=["b"])
        .step("c", "s", after=["w"], args={"v": "$.nodes.w.output"})
        .build()
    )
    early = [(1, "go", "early")]
    p1 = tick(spec, RunState(), signals=early)
    assert p1.applied_signals == []
    p2 = chain(spec, p1, now=at(1), signals=early)
    assert p2.changed is False and p2.applied_signals == []
    p3 = chain(spec, p2, now=at(2), signals=early, results=[ok("r1:a:1")])
    assert p3.applied_signals == [] and statuses(p3)["w"] == "pending"
    # b finishes: w is reached, parks and takes the waiting signal in the same tick.
    p4 = chain(spec, p3, now=at(3), signals=early, results=[ok("r1:b:1")])
    assert p4.applied_signals == [AppliedSignal(1, "w")]
    assert node_moves(p4) == [
        ("b", "running", "succeeded"),
        ("w", "pending", "waiting"),
        ("w", "waiting", "succeeded"),
        ("c", "pending", "running"),
    ]
    assert p4.new_attempts[0].args == {"v": "early"}


def two_waits() -> WorkflowSpec:
    return (
        Workflow("w")
        .wait_signal("first", signal="go")
        .wait_signal("second", signal="go", after=["first"])
        .output({"first": "$.nodes.first.output", "second": "$.nodes.second.output"})
        .build()
    )


def test_two_signals_of_one_name_are_consumed_oldest_first_in_one_tick() -> None:
    spec = two_waits()
    p = tick(spec, RunState(), signals=[(7, "go", "older"), (9, "go", "newer")])
    assert p.applied_signals == [AppliedSignal(7, "first"), AppliedSignal(9, "second")]
    assert signal_of(p.state.nodes["first"]) == 7
    assert signal_of(p.state.nodes["second"]) == 9
    assert p.status == RunStatus.SUCCEEDED
    assert p.output == {"first": "older", "second": "newer"}


def test_two_signals_of_one_name_are_consumed_oldest_first_across_ticks() -> None:
    spec = two_waits()
    p1 = tick(spec, RunState(), signals=[(7, "go", "older")])
    assert p1.applied_signals == [AppliedSignal(7, "first")]
    assert statuses(p1) == {"first": "succeeded", "second": "waiting"}
    p2 = chain(spec, p1, now=at(1), signals=[(9, "go", "newer")], outputs={"first": "older"})
    assert p2.applied_signals == [AppliedSignal(9, "second")]
    assert p2.output == {"first": "older", "second": "newer"}


def test_wait_signal_timeout_fails_the_node_and_the_run() -> None:
    spec = (
        Workflow("w")
        .wait_signal("w", signal="go", timeout=30)
        .step("next", "s", after=["w"])
        .build()
    )
    p1 = tick(spec, RunState())
    assert p1.next_wake_at == at(30)
    assert p1.state.nodes["w"].deadline == at(30)
    assert chain(spec, p1, now=at(29.9)).changed is False
    p2 = chain(spec, p1, now=at(30))
    assert describe(p2) == summary(
        status="failed",
        nodes={"w": "failed", "next": "pending"},
        transitions=[
            ("w", "waiting", "failed", "timed out after 30s"),
            (None, "running", "failed", "node 'w' failed: no input within 30s"),
        ],
        error={"type": "Timeout", "message": "no input within 30s", "node": "w"},
    )
    # A signal after the timeout is not consumed by a finished run: it stays unapplied.
    p3 = chain(spec, p2, now=at(31), signals=[(1, "go", "late")])
    assert p3.applied_signals == [] and p3.changed is False


def test_wait_signal_timeout_with_continue_outputs_timed_out() -> None:
    spec = (
        Workflow("w")
        .wait_signal("w", signal="go", timeout=30, on_timeout="continue")
        .step("next", "s", after=["w"], args={"w": "$.nodes.w.output"})
        .build()
    )
    p = chain(spec, tick(spec, RunState()), now=at(45))
    assert node_moves(p) == [("w", "waiting", "succeeded"), ("next", "pending", "running")]
    assert p.transitions[0].reason == "timed out after 30s (on_timeout=continue)"
    assert p.new_attempts[0].args == {"w": {"timed_out": True}}
    assert p.state.nodes["w"].to_json() == {
        "status": "succeeded",
        "output_value": {"timed_out": True},
        "started_at": iso(0),
        "finished_at": iso(45),
    }
    # A late signal is not consumed by the finished node: it stays for a future consumer.
    late = chain(spec, p, now=at(46), signals=[(1, "go", "late")])
    assert late.applied_signals == []


def waits_with_timeout(kind: str, on_timeout: str = "fail") -> WorkflowSpec:
    wf = Workflow("race")
    if kind == "wait_signal":
        wf.wait_signal("n", signal="go", timeout=30, on_timeout=on_timeout)
    elif kind == "approval":
        wf.approval("n", timeout=30, on_timeout=on_timeout)
    else:
        wf.event_set("n", events=["go"], mode="all", timeout=30, on_timeout=on_timeout)
    return wf.output("$.nodes.n.output").build()


@pytest.mark.parametrize("on_timeout", ["fail", "continue"])
@pytest.mark.parametrize("kind", ["wait_signal", "approval", "event_set"])
def test_a_signal_racing_the_timeout_in_one_tick_wins_and_is_applied_once(
    kind: str, on_timeout: str
) -> None:
    spec = waits_with_timeout(kind, on_timeout)
    name = approval_signal("n") if kind == "approval" else "go"
    body = decision(True) if kind == "approval" else {"v": 1}
    p1 = tick(spec, RunState())
    # The deadline passed and the signal is there: the signal is consumed before the timeout
    # check, so the node succeeds with the signal and never times out.
    p2 = chain(spec, p1, now=at(300), signals=[(5, name, body)])
    assert p2.applied_signals == [AppliedSignal(5, "n")]
    assert p2.status == RunStatus.SUCCEEDED
    assert p2.output == ({"go": body} if kind == "event_set" else body)
    assert not any("timed out" in tr.reason for tr in p2.transitions)
    moves = [m for m in node_moves(p2) if m[0] == "n"]
    # An event set records the event, then finishes; the others finish at once.
    assert moves[-1] == ("n", "waiting", "succeeded")
    assert moves[:-1] == ([("n", "waiting", "waiting")] if kind == "event_set" else [])
    ns = p2.state.nodes["n"]
    assert literal_of(ns) is None
    assert (events_of(ns) == {"go": 5}) if kind == "event_set" else (signal_of(ns) == 5)


# --- approval ------------------------------------------------------------------------------------


def review(**kw: Any) -> WorkflowSpec:
    return (
        Workflow("review")
        .approval("review", **kw)
        .step("act", "s", after=["review"], args={"d": "$.nodes.review.output"})
        .output("$.nodes.review.output")
        .build()
    )


def test_approve_outputs_the_decision() -> None:
    spec = review()
    p1 = tick(spec, RunState())
    assert describe(p1)["transitions"] == [
        RUN_STARTED,
        ("review", "pending", "waiting", "waiting for approval"),
    ]
    assert p1.next_wake_at is None  # no timeout: nothing to wake for
    yes = decision(True, comment="fine")
    # Another node's approval name and a plain signal are not this node's decision.
    p2 = chain(
        spec,
        p1,
        now=at(10),
        signals=[
            (1, approval_signal("other"), decision(False)),
            (2, "review", decision(False)),
            (3, approval_signal("review"), yes),
        ],
    )
    # The other node's decision is consumed as ignored; the plain signal is left alone.
    assert p2.applied_signals == [AppliedSignal(3, "review"), AppliedSignal(1, None)]
    assert describe(p2)["transitions"] == [
        ("review", "waiting", "succeeded", "approved by 'alice'"),
        ("other", "unknown", "unknown", "approval ignored: node was not waiting"),
        ("act", "pending", "running", "attempt 1 dispatched"),
    ]
    assert p2.new_attempts[0].args == {"d": yes}
    assert signal_of(p2.state.nodes["review"]) == 3


def test_reject_fails_the_node_and_the_run() -> None:
    spec = review()
    p = chain(
        spec,
        tick(spec, RunState()),
        now=at(10),
        signals=[(3, approval_signal("review"), decision(False, by="bob", comment="no"))],
    )
    assert p.applied_signals == [AppliedSignal(3, "review")]
    assert describe(p) == summary(
        status="failed",
        nodes={"review": "failed", "act": "pending"},
        transitions=[
            ("review", "waiting", "failed", "rejected by 'bob'"),
            (None, "running", "failed", "node 'review' failed: rejected by 'bob': no"),
        ],
        error={"type": "Rejected", "message": "rejected by 'bob': no", "node": "review"},
    )


def test_reject_with_on_reject_continue_succeeds_with_the_decision() -> None:
    spec = review(on_reject="continue")
    no = decision(False, by="bob", comment="no")
    p = chain(
        spec, tick(spec, RunState()), now=at(10), signals=[(3, approval_signal("review"), no)]
    )
    assert node_moves(p)[:2] == [("review", "waiting", "succeeded"), ("act", "pending", "running")]
    assert p.transitions[0].reason == "rejected by 'bob' (on_reject=continue)"
    assert p.new_attempts[0].args == {"d": no}


def test_an_approval_for_a_node_that_timed_out_is_consumed_as_ignored() -> None:
    spec = review(timeout=60, on_timeout="continue")
    p1 = tick(spec, RunState())
    assert p1.next_wake_at == at(60)
    p2 = chain(spec, p1, now=at(60))
    assert statuses(p2) == {"review": "succeeded", "act": "running"}
    assert p2.new_attempts[0].args == {"d": {"timed_out": True}}
    p3 = chain(spec, p2, now=at(61), signals=[(8, approval_signal("review"), decision(True))])
    assert p3.applied_signals == [AppliedSignal(8, None)]
    assert p3.changed is True
    assert describe(p3)["transitions"] == [
        ("review", "succeeded", "succeeded", "approval ignored: node was not waiting")
    ]
    assert p3.state.nodes["review"] == p2.state.nodes["review"]  # the output stays timed_out
    # Once ignored it is gone: the next tick does not see it again (the store marked it).
    assert chain(spec, p3, now=at(62)).changed is False


def test_an_approval_for_an_unknown_node_is_consumed_as_ignored() -> None:
    spec = review()
    p = chain(
        spec,
        tick(spec, RunState()),
        now=at(1),
        signals=[(4, approval_signal("nope"), decision(True))],
    )
    assert p.applied_signals == [AppliedSignal(4, None)]
    assert describe(p)["transitions"] == [
        ("nope", "unknown", "unknown", "approval ignored: node was not waiting")
    ]
    assert statuses(p) == {"review": "waiting", "act": "pending"}


# --- event_set -----------------------------------------------------------------------------------


def kyc(
    mode: str | int = "all", events: tuple[str, ...] = ("id_ok", "address_ok"), **kw: Any
) -> WorkflowSpec:
    return (
        Workflow("kyc")
        .event_set("kyc", events=events, mode=mode, **kw)
        .step("open", "s", after=["kyc"], args={"kyc": "$.nodes.kyc.output"})
        .build()
    )


def event_output(p: TickPayload, node: str, payloads: dict[int, Any]) -> dict[str, Any]:
    """The output as the store reconstructs it: the node's event -> signal id references."""
    refs = events_of(p.state.nodes[node]) or {}
    applied = {a.id for a in p.applied_signals if a.node == node}
    assert applied <= set(refs.values())
    return {event: payloads[i] for event, i in refs.items()}


def test_event_set_all_collects_events_over_ticks_and_ignores_duplicates() -> None:
    spec = kyc()
    payloads = {1: {"doc": "passport"}, 2: {"doc": "again"}, 3: {"street": "x"}}
    p1 = tick(spec, RunState(), signals=[(1, "id_ok", payloads[1])])
    assert p1.applied_signals == [AppliedSignal(1, "kyc")]
    assert describe(p1)["transitions"] == [
        RUN_STARTED,
        ("kyc", "pending", "waiting", "waiting for events ['id_ok', 'address_ok'] (all)"),
        ("kyc", "waiting", "waiting", "event 'id_ok' received"),
    ]
    assert events_of(p1.state.nodes["kyc"]) == {"id_ok": 1}
    assert statuses(p1) == {"kyc": "waiting", "open": "pending"}
    # A second id_ok is not consumed: the event was already received.
    p2 = chain(spec, p1, now=at(1), signals=[(2, "id_ok", payloads[2])], received={1: payloads[1]})
    assert p2.changed is False and p2.applied_signals == []
    # address_ok completes the set; id_ok's payload comes from the loader (already applied).
    p3 = chain(
        spec,
        p2,
        now=at(2),
        signals=[(2, "id_ok", payloads[2]), (3, "address_ok", payloads[3])],
        received={1: payloads[1]},
    )
    assert p3.applied_signals == [AppliedSignal(3, "kyc")]
    assert node_moves(p3) == [
        ("kyc", "waiting", "waiting"),
        ("kyc", "waiting", "succeeded"),
        ("open", "pending", "running"),
    ]
    assert p3.transitions[1].reason == "events received: ['address_ok', 'id_ok']"
    expected = {"id_ok": payloads[1], "address_ok": payloads[3]}
    assert event_output(p3, "kyc", payloads) == expected
    assert p3.new_attempts[0].args == {"kyc": expected}


def test_event_set_all_in_one_tick_takes_one_signal_per_event() -> None:
    spec = kyc()
    p = tick(
        spec,
        RunState(),
        signals=[(1, "id_ok", "a"), (2, "id_ok", "b"), (3, "noise", "n"), (4, "address_ok", "c")],
    )
    assert p.applied_signals == [AppliedSignal(1, "kyc"), AppliedSignal(4, "kyc")]
    assert p.new_attempts[0].args == {"kyc": {"id_ok": "a", "address_ok": "c"}}


def test_event_set_any_finishes_on_the_first_event() -> None:
    spec = kyc(mode="any")
    p = tick(spec, RunState(), signals=[(5, "address_ok", "A"), (6, "id_ok", "I")])
    assert p.applied_signals == [AppliedSignal(5, "kyc")]  # id_ok is left for someone else
    assert events_of(p.state.nodes["kyc"]) == {"address_ok": 5}
    assert p.new_attempts[0].args == {"kyc": {"address_ok": "A"}}


def test_event_set_n_of_m_counts_distinct_events() -> None:
    spec = kyc(mode=2, events=("a", "b", "c"))
    p1 = tick(spec, RunState(), signals=[(1, "b", 1), (2, "b", 2)])
    assert p1.applied_signals == [AppliedSignal(1, "kyc")]
    assert statuses(p1)["kyc"] == "waiting"
    p2 = chain(
        spec, p1, now=at(1), signals=[(2, "b", 2), (3, "c", 3), (4, "a", 4)], received={1: 1}
    )
    assert p2.applied_signals == [AppliedSignal(3, "kyc")]
    assert events_of(p2.state.nodes["kyc"]) == {"b": 1, "c": 3}
    assert p2.new_attempts[0].args == {"kyc": {"b": 1, "c": 3}}


def test_event_set_timeout_fails_or_continues() -> None:
    failing = kyc(timeout=10)
    p1 = tick(failing, RunState(), signals=[(1, "id_ok", 1)])
    assert p1.next_wake_at == at(10)
    p2 = chain(failing, p1, now=at(10))
    assert p2.status == RunStatus.FAILED
    assert p2.error == {"type": "Timeout", "message": "no input within 10s", "node": "kyc"}
    lenient = kyc(timeout=10, on_timeout="continue")
    p3 = chain(lenient, tick(lenient, RunState(), signals=[(1, "id_ok", 1)]), now=at(10))
    assert statuses(p3) == {"kyc": "succeeded", "open": "running"}
    assert events_of(p3.state.nodes["kyc"]) is None
    assert literal_of(p3.state.nodes["kyc"]) == {"timed_out": True}
    assert p3.new_attempts[0].args == {"kyc": {"timed_out": True}}


# --- pause and resume ----------------------------------------------------------------------------


def busy() -> WorkflowSpec:
    """A step that will retry, a step in flight with a dependant, and a sleep."""
    return (
        Workflow("busy")
        .step("a", "s", retry=RetryPolicy(max_attempts=3, initial_interval=1.0))
        .step("b", "s")
        .step("c", "s", after=["b"])
        .sleep("nap", seconds=10)
        .build()
    )


def test_pause_folds_results_but_dispatches_nothing_and_fires_no_timer() -> None:
    spec = busy()
    p1 = tick(spec, RunState())
    p2 = chain(spec, p1, now=at(5), results=[err("r1:a:1")])  # retry due at 6
    assert p2.state.nodes["a"].step.retry_at == at(6)
    paused = chain(spec, p2, now=at(5), control=control("pause", id=11, reason="deploy"))
    assert paused.handled_control == HandledControl(11, APPLIED)
    assert describe(paused) == summary(
        status="paused",
        nodes={"a": "running", "b": "running", "c": "pending", "nap": "waiting"},
        transitions=[(None, "running", "paused", "pause: deploy")],
        # b's in-flight check still counts; a's retry (6) and the sleep (10) do not.
        next_wake_at=iso(30),
    )
    # Long after every timer: b's result folds, c is not started, the retry and sleep wait.
    p3 = chain(spec, paused, now=at(100), results=[ok("r1:b:1", "B")])
    assert describe(p3) == summary(
        status="paused",
        nodes={"a": "running", "b": "succeeded", "c": "pending", "nap": "waiting"},
        folded=["r1:b:1"],
        transitions=[("b", "running", "succeeded", "attempt 1 succeeded")],
    )
    assert chain(spec, p3, now=at(200)).changed is False
    # Resume: the due retry and the sleep fire, c starts.
    p4 = chain(spec, p3, now=at(200), control=control("resume", id=12), outputs={"b": "B"})
    assert p4.handled_control == HandledControl(12, APPLIED)
    assert describe(p4) == summary(
        nodes={"a": "running", "b": "succeeded", "c": "running", "nap": "succeeded"},
        new_attempts=["r1:a:2", "r1:c:1"],
        dispatches=["r1:a:2", "r1:c:1"],
        transitions=[
            (None, "paused", "running", "resume"),
            ("a", "running", "running", "attempt 2 dispatched (retry)"),
            ("c", "pending", "running", "attempt 1 dispatched"),
            ("nap", "waiting", "succeeded", "timer fired"),
        ],
        next_wake_at=iso(230),
    )


def test_pause_during_a_wait_holds_signals_and_timeouts_until_resume() -> None:
    spec = (
        Workflow("w")
        .wait_signal("w", signal="go", timeout=60)
        .approval("ok", timeout=60, on_timeout="continue")
        .build()
    )
    p1 = tick(spec, RunState())
    paused = chain(spec, p1, now=at(1), control=control("pause"))
    assert paused.status == RunStatus.PAUSED and paused.next_wake_at is None
    go = [(1, "go", "G")]
    held = chain(spec, paused, now=at(500), signals=go)
    assert held.changed is False and held.applied_signals == []
    assert statuses(held) == {"w": "waiting", "ok": "waiting"}
    # Resume after both deadlines: the waiting signal wins its race, the approval times out.
    p2 = chain(spec, held, now=at(500), signals=go, control=control("resume", id=2))
    assert p2.applied_signals == [AppliedSignal(1, "w")]
    assert statuses(p2) == {"w": "succeeded", "ok": "succeeded"}
    assert literal_of(p2.state.nodes["ok"]) == {"timed_out": True}
    assert p2.status == RunStatus.SUCCEEDED


def test_pause_of_a_pending_run_and_pause_of_a_paused_run() -> None:
    spec = busy()
    p = tick(spec, RunState(), control=control("pause"))
    assert p.handled_control == HandledControl(1, APPLIED)
    assert describe(p) == summary(
        status="paused",
        nodes={"a": "pending", "b": "pending", "c": "pending", "nap": "pending"},
        transitions=[(None, "pending", "paused", "pause")],
    )
    again = chain(spec, p, control=control("pause", id=2))
    assert again.handled_control == HandledControl(
        2, "rejected: run is paused, only a running run can be paused"
    )
    assert again.status == RunStatus.PAUSED
    resumed = chain(spec, again, control=control("resume", id=3))
    assert statuses(resumed) == {"a": "running", "b": "running", "c": "pending", "nap": "waiting"}


# --- cancel and terminate ------------------------------------------------------------------------


def many() -> WorkflowSpec:
    return (
        Workflow("many")
        .step("a", "s")  # in flight
        .step("r", "s", retry=RetryPolicy(max_attempts=3, initial_interval=5.0))  # retry pending
        .wait_signal("w", signal="go")  # parked
        .sleep("nap", seconds=100)  # parked
        .step("later", "s", after=["a"])  # never started
        .build()
    )


@pytest.mark.parametrize(("kind", "status"), [("cancel", "cancelled"), ("terminate", "terminated")])
def test_cancel_and_terminate_close_everything_open_and_revoke_in_flight(
    kind: str, status: str
) -> None:
    spec = many()
    p1 = tick(spec, RunState())
    p2 = chain(spec, p1, now=at(1), results=[err("r1:r:1")])
    assert p2.state.nodes["r"].step.retry_at == at(6) and p2.state.nodes["r"].step.token is None
    p3 = chain(spec, p2, now=at(2), control=control(kind, id=5, reason="ops"))
    reason = f"{kind}: ops"
    assert p3.handled_control == HandledControl(5, APPLIED)
    assert describe(p3) == summary(
        status=status,
        nodes={
            "a": "cancelled",
            "r": "cancelled",
            "w": "cancelled",
            "nap": "cancelled",
            "later": "pending",
        },
        closed=[("r1:a:1", "cancelled")],  # r has no open attempt: its last one failed
        dispatches=["r1:a:1"],
        transitions=[
            ("a", "running", "cancelled", reason),
            ("r", "running", "cancelled", reason),
            ("w", "waiting", "cancelled", reason),
            ("nap", "waiting", "cancelled", reason),
            (None, "running", status, reason),
        ],
        error={"type": kind.capitalize(), "message": reason},
    )
    # Terminate kills the step if it is running (revoke with terminate=True).
    assert p3.dispatches == [
        Dispatch("revoke", RUN, "a", "r1:a:1", "s", None, terminate=kind == "terminate")
    ]
    assert p3.closed == [
        ClosedAttempt("r1:a:1", "cancelled", {"type": "Cancelled", "message": reason})
    ]
    for ns in p3.state.nodes.values():
        step = ns.work if isinstance(ns.work, StepWork) else StepWork()
        assert step.token is None and step.retry_at is None and step.check_at is None
    assert p3.state.nodes["later"].to_json() == {"status": "pending"}
    # After the cancel: the retry time passes and a late result arrives; nothing moves.
    p4 = chain(spec, p3, now=at(50), results=[ok("r1:a:1", "late")], signals=[(1, "go", None)])
    assert p4.new_attempts == [] and p4.dispatches == [] and p4.applied_signals == []
    assert p4.folded == ["r1:a:1"] and p4.state == roundtrip(p3.state)
    assert p4.next_wake_at is None


def test_cancel_of_a_paused_run_with_a_retry_timer_pending() -> None:
    spec = many()
    p1 = tick(spec, RunState())
    p2 = chain(spec, p1, now=at(1), results=[err("r1:r:1"), ok("r1:a:1")])
    p3 = chain(spec, p2, now=at(1), control=control("pause"))
    p4 = chain(spec, p3, now=at(2), control=control("cancel", id=2))
    assert p4.handled_control == HandledControl(2, APPLIED)
    assert p4.status == RunStatus.CANCELLED
    assert statuses(p4)["r"] == "cancelled" and statuses(p4)["later"] == "cancelled"
    assert p4.closed == [
        ClosedAttempt("r1:later:1", "cancelled", {"type": "Cancelled", "message": "cancel"})
    ]
    assert [d.kind for d in p4.dispatches] == ["revoke"]
    assert (None, "paused", "cancelled") in node_moves(p4)
    assert chain(spec, p4, now=at(100)).changed is False


# --- controls on finished runs -------------------------------------------------------------------


def finished(status: RunStatus) -> tuple[WorkflowSpec, RunState]:
    spec = Workflow("one").step("a", "s", retry=RetryPolicy(max_attempts=1)).build()
    s = tick(spec, RunState()).state
    if status == RunStatus.SUCCEEDED:
        s = tick(spec, s, results=[ok("r1:a:1")]).state
    elif status == RunStatus.FAILED:
        s = tick(spec, s, results=[err("r1:a:1")]).state
    else:
        kind = "terminate" if status == RunStatus.TERMINATED else "cancel"
        s = tick(spec, s, control=control(kind)).state
    assert s.status == status
    return spec, roundtrip(s)


@pytest.mark.parametrize(
    ("status", "kind", "why"),
    [
        (RunStatus.SUCCEEDED, "pause", "run is succeeded, only a running run can be paused"),
        (RunStatus.SUCCEEDED, "resume", "run is succeeded, only a paused run can be resumed"),
        (RunStatus.SUCCEEDED, "cancel", "run is already succeeded"),
        (RunStatus.FAILED, "terminate", "run is already failed"),
        (
            RunStatus.SUCCEEDED,
            "redrive",
            "run is succeeded; only failed, cancelled, terminated or timed-out runs can be redriven"
            " (a succeeded run: with from_node)",
        ),
        (
            RunStatus.FAILED,
            "continue_as_new",
            "run is failed, only a running or paused run can continue as new",
        ),
        (RunStatus.CANCELLED, "pause", "run is cancelled, only a running run can be paused"),
        (RunStatus.TERMINATED, "cancel", "run is already terminated"),
        (RunStatus.SUCCEEDED, "explode", "unknown control 'explode'"),
    ],
)
def test_a_control_on_a_finished_run_is_rejected_with_a_reason(
    status: RunStatus, kind: str, why: str
) -> None:
    spec, s = finished(status)
    p = tick(spec, s, now=at(10), control=control(kind, id=9, input={"x": 1}, has_input=True))
    assert p.handled_control == HandledControl(9, f"rejected: {why}")
    assert describe(p) == summary(
        status=status.value,
        nodes={"a": s.nodes["a"].status.value},
        transitions=[(None, status.value, status.value, f"{kind} rejected: {why}")],
    )
    assert p.changed is True  # the control row is marked handled
    assert p.successor is None and p.reopened is False
    # Nothing but the transition count changed.
    assert p.state.nodes == s.nodes and p.state.context == s.context
    assert p.state.transitions == s.transitions + 1
    assert p.state.continue_pending is None


def test_resume_of_a_running_run_is_rejected_and_the_tick_carries_on() -> None:
    spec = many()
    p1 = tick(spec, RunState())
    p2 = chain(spec, p1, now=at(1), results=[ok("r1:a:1")], control=control("resume", id=3))
    assert p2.handled_control == HandledControl(
        3, "rejected: run is running, only a paused run can be resumed"
    )
    assert p2.transitions[0].reason == (
        "resume rejected: run is running, only a paused run can be resumed"
    )
    assert p2.status == RunStatus.RUNNING
    assert [a.token for a in p2.new_attempts] == ["r1:later:1"]


# --- redrive -------------------------------------------------------------------------------------


def redrivable() -> WorkflowSpec:
    return (
        Workflow("rd")
        .step("ok", "s")
        .step("bad", "s", retry=RetryPolicy(max_attempts=2, initial_interval=0.0))
        .step("next", "s", after=["ok", "bad"], args={"ok": "$.nodes.ok.output"})
        .sleep("nap", seconds=100)
        .output({"ok": "$.nodes.ok.output"})
        .build()
    )


def test_redrive_after_a_failure_reruns_failed_cancelled_and_pending_nodes() -> None:
    spec = redrivable()
    p1 = tick(spec, RunState())
    p2 = chain(spec, p1, now=at(1), results=[ok("r1:ok:1", "OK"), err("r1:bad:1")])
    assert [a.token for a in p2.new_attempts] == ["r1:bad:2"]  # zero backoff: at once
    p3 = chain(spec, p2, now=at(2), results=[err("r1:bad:2")])
    assert p3.status == RunStatus.FAILED
    assert statuses(p3) == {
        "ok": "succeeded",
        "bad": "failed",
        "next": "pending",
        "nap": "cancelled",
    }
    p4 = chain(spec, p3, now=at(10), control=control("redrive", id=4), outputs={"ok": "OK"})
    assert p4.handled_control == HandledControl(4, APPLIED)
    assert p4.reopened is True and p4.error is None
    assert describe(p4) == summary(
        nodes={"ok": "succeeded", "bad": "running", "next": "pending", "nap": "waiting"},
        new_attempts=["r1:bad:3"],  # generations keep counting: never an old token
        dispatches=["r1:bad:3"],
        transitions=[
            ("bad", "failed", "pending", "redrive"),
            ("nap", "cancelled", "pending", "redrive"),
            (None, "failed", "running", "redrive"),
            ("bad", "pending", "running", "attempt 1 dispatched"),
            ("nap", "pending", "waiting", "sleeping 100s"),
        ],
        next_wake_at=iso(40),
    )
    bad = p4.state.nodes["bad"]
    assert (bad.generation, bad.step.attempt, bad.error) == (3, 1, None)  # a fresh retry budget
    assert token_of(p4.state.nodes["ok"]) == "r1:ok:1"  # kept, never rerun
    assert p4.state.nodes["nap"].deadline == at(110)
    # The fresh budget: one failure retries again instead of failing the run.
    p5 = chain(spec, p4, now=at(11), results=[err("r1:bad:3")])
    assert [a.token for a in p5.new_attempts] == ["r1:bad:4"]
    assert p5.status == RunStatus.RUNNING
    # A stale result of a pre-redrive attempt is ignored.
    p6 = chain(spec, p5, now=at(12), results=[ok("r1:bad:2", "stale")])
    assert statuses(p6)["bad"] == "running"
    assert p6.transitions[0].reason == "stale result ignored (token r1:bad:2)"
    p7 = chain(spec, p6, now=at(200), results=[ok("r1:bad:4")], outputs={"ok": "OK"})
    assert statuses(p7)["next"] == "running" and p7.new_attempts[0].args == {"ok": "OK"}


@pytest.mark.parametrize("kind", ["terminate", "cancel"])
def test_redrive_after_terminate_or_cancel(kind: str) -> None:
    spec = redrivable()
    p1 = tick(spec, RunState())
    p2 = chain(spec, p1, now=at(1), results=[ok("r1:ok:1", "OK")])
    p3 = chain(spec, p2, now=at(2), control=control(kind))
    assert statuses(p3) == {
        "ok": "succeeded",
        "bad": "cancelled",
        "next": "pending",
        "nap": "cancelled",
    }
    p4 = chain(spec, p3, now=at(3), control=control("redrive", id=2))
    assert p4.reopened is True and p4.error is None and p4.status == RunStatus.RUNNING
    assert [a.token for a in p4.new_attempts] == ["r1:bad:2"]
    assert p4.state.nodes["bad"].step.attempt == 1
    assert statuses(p4) == {
        "ok": "succeeded",
        "bad": "running",
        "next": "pending",
        "nap": "waiting",
    }
    # The cancelled attempt's worker finishing late is stale.
    p5 = chain(spec, p4, now=at(4), results=[ok("r1:bad:1", "late")])
    assert statuses(p5)["bad"] == "running" and p5.state.nodes["bad"].step.token == "r1:bad:2"


def test_redrive_after_a_rejection_waits_for_a_new_decision() -> None:
    spec = review()
    p1 = tick(spec, RunState())
    p2 = chain(spec, p1, now=at(1), signals=[(1, approval_signal("review"), decision(False))])
    assert p2.status == RunStatus.FAILED
    p3 = chain(spec, p2, now=at(2), control=control("redrive"))
    assert statuses(p3) == {"review": "waiting", "act": "pending"}
    assert signal_of(p3.state.nodes["review"]) is None
    p4 = chain(spec, p3, now=at(3), signals=[(2, approval_signal("review"), decision(True))])
    assert p4.applied_signals == [AppliedSignal(2, "review")]
    assert statuses(p4) == {"review": "succeeded", "act": "running"}


# --- continue-as-new -----------------------------------------------------------------------------


def looping() -> WorkflowSpec:
    return (
        Workflow("loop")
        .step("a", "s", args={"n": "$.input.n"})
        .step("b", "s", retry=RetryPolicy(max_attempts=3, initial_interval=50.0))
        .step("c", "s", after=["a"], args={"a": "$.nodes.a.output"})
        .output({"c": "$.nodes.c.output"})
        .build()
    )


def test_continue_as_new_drains_attempts_in_flight_then_carries_finished_nodes() -> None:
    spec = looping()
    inp = {"n": 1}
    p1 = tick(spec, RunState(), input=inp)
    p2 = chain(spec, p1, now=at(1), input=inp, results=[ok("r1:b:1", "B")])
    p2.state.context["seen"] = 1  # as a patch would have done
    p3 = chain(spec, p2, now=at(2), input=inp, control=control("continue_as_new", id=7))
    assert p3.handled_control == HandledControl(7, APPLIED)
    assert describe(p3) == summary(
        nodes={"a": "running", "b": "succeeded", "c": "pending"},
        transitions=[(None, "running", "running", "continue_as_new: draining attempts in flight")],
        next_wake_at=iso(30),
    )
    assert p3.state.continue_pending == {"input": None, "has_input": False}
    assert p3.successor is None
    # Still draining: nothing new is dispatched, and a quiet tick changes nothing.
    p4 = chain(spec, p3, now=at(3), input=inp)
    assert p4.changed is False and p4.new_attempts == []
    # a finishes: its result is folded, c (now ready) is not started, the run closes.
    p5 = chain(spec, p4, now=at(4), input=inp, results=[ok("r1:a:1", "A")])
    succ = p5.successor
    assert succ is not None
    assert describe(p5) == summary(
        status="continued",
        nodes={"a": "succeeded", "b": "succeeded", "c": "pending"},
        folded=["r1:a:1"],
        transitions=[
            ("a", "running", "succeeded", "attempt 1 succeeded"),
            (None, "running", "continued", f"continued as {succ.run_id}"),
        ],
    )
    assert succ.input == inp
    assert succ.run_id != RUN
    assert succ.state.status == RunStatus.PENDING
    assert succ.state.context == {"seen": 1}
    assert succ.state.continue_pending is None and succ.state.transitions == 0
    assert {k: v.status.value for k, v in succ.state.nodes.items()} == {
        "a": "succeeded",
        "b": "succeeded",
        "c": "pending",
    }
    assert token_of(succ.state.nodes["a"]) == "r1:a:1"
    assert token_of(succ.state.nodes["b"]) == "r1:b:1"
    assert roundtrip(succ.state) == succ.state
    # The same tick recomputed names the same successor.
    again = chain(spec, p4, now=at(4), input=inp, results=[ok("r1:a:1", "A")])
    assert again.successor is not None and again.successor.run_id == succ.run_id
    # The successor runs only what was not finished: no finished step re-runs.
    s1 = tick(spec, roundtrip(succ.state), input=succ.input, run_id=succ.run_id, outputs={"a": "A"})
    assert [(a.node, a.args) for a in s1.new_attempts] == [("c", {"a": "A"})]
    assert s1.new_attempts[0].token == f"{succ.run_id}:c:1"
    s2 = chain(
        spec, s1, input=succ.input, run_id=succ.run_id, results=[ok(f"{succ.run_id}:c:1", "C")]
    )
    assert s2.status == RunStatus.SUCCEEDED and s2.output == {"c": "C"}
    # Its own successor would get a different id again.
    s_cont = chain(
        spec,
        s1,
        run_id=succ.run_id,
        results=[ok(f"{succ.run_id}:c:1", "C")],
        control=control("continue_as_new"),
    )
    assert s_cont.status == RunStatus.CONTINUED
    assert s_cont.successor is not None
    assert s_cont.successor.run_id not in (RUN, succ.run_id)


def test_continue_as_new_does_not_wait_for_a_pending_retry_and_reruns_its_node() -> None:
    spec = looping()
    p1 = tick(spec, RunState())
    p2 = chain(spec, p1, now=at(1), results=[ok("r1:a:1", "A"), err("r1:b:1")])
    assert p2.state.nodes["b"].step.retry_at == at(51)
    p3 = chain(spec, p2, now=at(2), control=control("continue_as_new"), results=[ok("r1:c:1", "C")])
    assert p3.status == RunStatus.CONTINUED
    assert p3.closed == []  # b had no attempt open
    assert statuses(p3)["b"] == "cancelled"
    assert p3.successor is not None
    assert p3.successor.state.nodes["b"].status == NodeStatus.PENDING
    assert token_of(p3.successor.state.nodes["c"]) == "r1:c:1"


def test_continue_as_new_with_input_starts_the_successor_from_the_top() -> None:
    spec = looping()
    p1 = tick(spec, RunState(), input={"n": 1})
    p2 = chain(
        spec,
        p1,
        now=at(1),
        input={"n": 1},
        results=[ok("r1:b:1")],
        control=control("continue_as_new", input={"n": 2}, has_input=True),
    )
    assert p2.successor is None and p2.state.continue_pending == {
        "input": {"n": 2},
        "has_input": True,
    }
    p3 = chain(spec, p2, now=at(2), input={"n": 1}, results=[ok("r1:a:1", "A")])
    succ = p3.successor
    assert succ is not None and p3.status == RunStatus.CONTINUED
    assert succ.input == {"n": 2}
    assert succ.state == RunState.initial(spec.graph.order)
    s1 = tick(spec, succ.state, input=succ.input, run_id=succ.run_id)
    assert [(a.node, a.args) for a in s1.new_attempts] == [("a", {"n": 2}), ("b", {})]


def test_continue_as_new_of_an_idle_run_closes_in_the_same_tick() -> None:
    spec = two_waits()
    p1 = tick(spec, RunState(), input={"i": 1})
    p2 = chain(spec, p1, now=at(1), input={"i": 1}, control=control("continue_as_new"))
    assert p2.status == RunStatus.CONTINUED
    assert p2.successor is not None and p2.successor.input == {"i": 1}
    assert describe(p2)["transitions"][0] == (
        None,
        "running",
        "running",
        "continue_as_new: draining attempts in flight",
    )


def test_continue_as_new_keeps_parked_nodes_parked_in_the_successor() -> None:
    spec = (
        Workflow("parked")
        .step("a", "s")
        .event_set("kyc", events=["x", "y"])
        .sleep("nap", seconds=100)
        .step("after", "s", after=["kyc", "nap"], args={"kyc": "$.nodes.kyc.output"})
        .build()
    )
    p1 = tick(spec, RunState(), signals=[(1, "x", "X")])
    assert events_of(p1.state.nodes["kyc"]) == {"x": 1}
    p2 = chain(
        spec,
        p1,
        now=at(50),
        control=control("continue_as_new"),
        results=[ok("r1:a:1")],
        received={1: "X"},
    )
    succ = p2.successor
    assert succ is not None
    # The event already consumed is not lost, and the sleep keeps its deadline.
    kyc_ns, nap_ns = succ.state.nodes["kyc"], succ.state.nodes["nap"]
    assert (kyc_ns.status, events_of(kyc_ns)) == (NodeStatus.WAITING, {"x": 1})
    assert (nap_ns.status, nap_ns.deadline) == (NodeStatus.WAITING, at(100))
    s1 = tick(
        spec,
        roundtrip(succ.state),
        now=at(60),
        run_id=succ.run_id,
        signals=[(2, "y", "Y")],
        received={1: "X"},
    )
    assert s1.applied_signals == [AppliedSignal(2, "kyc")]
    assert statuses(s1) == {
        "a": "succeeded",
        "kyc": "succeeded",
        "nap": "waiting",
        "after": "pending",
    }
    assert s1.next_wake_at == at(100)
    s2 = chain(spec, s1, now=at(100), run_id=succ.run_id, outputs={"kyc": {"x": "X", "y": "Y"}})
    assert s2.new_attempts[0].args == {"kyc": {"x": "X", "y": "Y"}}


def test_cancel_while_draining_drops_the_continue() -> None:
    spec = looping()
    p1 = tick(spec, RunState())
    p2 = chain(spec, p1, now=at(1), control=control("continue_as_new"))
    p3 = chain(spec, p2, now=at(2), control=control("cancel", id=2))
    assert p3.status == RunStatus.CANCELLED and p3.successor is None
    assert p3.state.continue_pending is None
    assert sorted(d.token for d in p3.dispatches) == ["r1:a:1", "r1:b:1"]
    assert {d.kind for d in p3.dispatches} == {"revoke"}


def test_a_failure_while_draining_drops_the_continue_so_redrive_runs_again() -> None:
    spec = Workflow("w").step("a", "s", retry=RetryPolicy(max_attempts=1)).step("b", "s").build()
    p1 = tick(spec, RunState())
    p2 = chain(spec, p1, now=at(1), control=control("continue_as_new"))
    p3 = chain(spec, p2, now=at(2), results=[err("r1:a:1")])
    assert p3.status == RunStatus.FAILED and p3.successor is None
    assert p3.state.continue_pending is None
    p4 = chain(spec, p3, now=at(3), control=control("redrive", id=2))
    assert p4.status == RunStatus.RUNNING and p4.successor is None
    assert [a.token for a in p4.new_attempts] == ["r1:a:2", "r1:b:2"]


def chain3() -> WorkflowSpec:
    return (
        Workflow("c3")
        .step("a", "s")
        .step("b", "s", after=["a"])
        .step("c", "s", after=["b"])
        .build()
    )


def test_automatic_continue_as_new_when_transitions_pass_the_limit() -> None:
    spec = chain3()
    cfg = EngineConfig(resend_unclaimed_after=30.0, max_transitions=4)
    p1 = tick(spec, RunState(), config=cfg)
    assert p1.state.transitions == 2
    p2 = chain(spec, p1, now=at(1), results=[ok("r1:a:1")], config=cfg)
    assert p2.state.transitions == 4 and p2.state.continue_pending is None
    # At the limit: the run asks to continue and drains b first.
    p3 = chain(spec, p2, now=at(2), config=cfg)
    assert describe(p3)["transitions"] == [
        (None, "running", "running", "4 transitions: continuing as new")
    ]
    assert p3.state.continue_pending == {"input": None, "has_input": False}
    assert p3.handled_control is None
    p4 = chain(spec, p3, now=at(3), results=[ok("r1:b:1")], config=cfg)
    assert p4.status == RunStatus.CONTINUED and p4.new_attempts == []
    assert p4.successor is not None
    assert {k: v.status.value for k, v in p4.successor.state.nodes.items()} == {
        "a": "succeeded",
        "b": "succeeded",
        "c": "pending",
    }
    # Under a default-sized limit the same history never continues.
    q = tick(spec, roundtrip(p2.state), now=at(2))
    assert q.state.continue_pending is None and q.changed is False


def test_automatic_continue_as_new_waits_for_a_paused_run_to_resume() -> None:
    spec = chain3()
    cfg = EngineConfig(resend_unclaimed_after=30.0, max_transitions=4)
    p1 = tick(spec, RunState(), config=cfg)
    p2 = chain(spec, p1, now=at(1), control=control("pause"), config=cfg)
    assert p2.state.transitions == 3
    # Folding a's result in the paused run passes the limit: no successor while paused.
    p3 = chain(spec, p2, now=at(2), results=[ok("r1:a:1")], config=cfg)
    assert p3.status == RunStatus.PAUSED and p3.state.continue_pending is None
    assert p3.successor is None and p3.new_attempts == []
    p4 = chain(spec, p3, now=at(3), control=control("resume", id=2), config=cfg)
    assert p4.status == RunStatus.CONTINUED and p4.successor is not None
    assert p4.new_attempts == []


# --- random interleavings ------------------------------------------------------------------------


def mixed() -> WorkflowSpec:
    return (
        Workflow("mixed")
        .sleep("nap", seconds=30)
        .wait_signal("w", signal="go")
        .event_set("ev", events=["e1", "e2"], mode="all", after=["nap"])
        .approval("ok", after=["w", "ev"])
        .output({"w": "$.nodes.w.output", "ev": "$.nodes.ev.output", "ok": "$.nodes.ok.output"})
        .build()
    )


MIXED = mixed()
APPROVE = approval_signal("ok")
SIGNAL_FOR = {"go": "w", "e1": "ev", "e2": "ev", APPROVE: "ok"}


class Store:
    """The run in the shipped in-memory store (its signal and control tables, its loader),
    ticked by the production tick loop, and the history checks."""

    def __init__(self) -> None:
        self.fake = InMemoryStore(now=NOW)
        self.coordinator = Coordinator(self.fake, RecordingDispatcher(self.fake))
        self.fake.start(MIXED, run_id=RUN)
        self.finished: dict[str, int] = {}
        self.ticks = 0

    @property
    def now(self) -> datetime:
        return self.fake.now

    @now.setter
    def now(self, later: datetime) -> None:
        self.fake.advance((later - self.fake.now).total_seconds())

    @property
    def state(self) -> RunState:
        return self.fake.state(RUN)

    @property
    def signals(self) -> list[SignalIn]:
        return [SignalIn(s.id, s.name, s.payload) for s in self.fake.tables.signals]

    @property
    def applied(self) -> dict[int, str | None]:
        return {s.id: s.applied_to for s in self.fake.tables.signals if s.applied_at is not None}

    @property
    def controls(self) -> list[int]:
        """Ids of the controls not handled yet, oldest first."""
        return [c.id for c in self.fake.tables.controls if c.handled_at is None]

    def signal(self, name: str, payload: Any) -> None:
        self.fake.signal(RUN, name, payload)

    def control(self, kind: str) -> None:
        self.fake.control(RUN, kind)

    def payload_of(self, signal_id: int) -> Any:
        return next(s.payload for s in self.signals if s.id == signal_id)

    def tick(self) -> TickPayload:
        before, applied, controls = self.state, self.applied, self.controls
        unapplied = {s.id: s for s in self.signals if s.id not in applied}
        p = payload_of(self.coordinator.tick(RUN), RUN, MIXED, before, EngineConfig(), self.now)
        self.ticks += 1
        if controls:
            assert p.handled_control is not None and p.handled_control.id == controls[0]
            assert self.controls == controls[1:]
        else:
            assert p.handled_control is None
        for a in p.applied_signals:
            assert a.id not in applied, f"signal {a.id} applied twice"
            assert self.applied[a.id] == a.node, "the store recorded where it went"
            name = unapplied[a.id].name
            if a.node is None:
                assert name.startswith("ductor.approval:")
            else:
                assert SIGNAL_FOR[name] == a.node
        for tr in p.transitions:
            if (
                tr.node is not None
                and tr.to_status in FINISHED_NODE_STATUSES
                and tr.from_status != tr.to_status
            ):
                self.finished[tr.node] = self.finished.get(tr.node, 0) + 1
                assert self.finished[tr.node] == 1, f"{tr.node} finished twice"
        was_paused = before.status == RunStatus.PAUSED
        resumed = (
            p.handled_control is not None
            and p.handled_control.result == APPLIED
            and "resume" in [tr.reason for tr in p.transitions if tr.node is None]
        )
        if was_paused and not resumed:
            assert p.applied_signals == [] and p.new_attempts == []
            assert all(tr.node is None for tr in p.transitions)
        if p.state.status == RunStatus.PAUSED:
            assert p.next_wake_at is None  # only parked nodes: nothing counts while paused
        if p.state.status in TERMINAL_RUN_STATUSES:
            assert p.next_wake_at is None
        else:
            deadlines = [
                ns.deadline
                for ns in p.state.nodes.values()
                if ns.status == NodeStatus.WAITING and ns.deadline
            ]
            if p.state.status == RunStatus.RUNNING:
                assert p.next_wake_at == (min(deadlines) if deadlines else None)
        # Every node consumes what it says it consumed.
        for node, ns in p.state.nodes.items():
            if signal_of(ns) is not None:
                assert self.applied.get(signal_of(ns)) == node
            for i in (events_of(ns) or {}).values():
                assert self.applied.get(i) == node
        assert self.state == roundtrip(p.state), "the store kept what the tick computed"
        return p


ACTIONS = st.one_of(
    st.tuples(
        st.just("signal"), st.sampled_from(["go", "e1", "e2", "noise", "e3"]), st.integers(0, 3)
    ),
    st.tuples(st.just("approve"), st.booleans(), st.integers(0, 3)),
    st.tuples(st.just("advance"), st.sampled_from([0.0, 1.0, 10.0, 29.0, 45.0]), st.just(0)),
    st.tuples(st.just("pause"), st.just(None), st.just(0)),
    st.tuples(st.just("resume"), st.just(None), st.just(0)),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ACTIONS, max_size=25))
def test_random_interleavings_apply_each_signal_once_and_end_terminal(
    actions: list[tuple[str, Any, int]],
) -> None:
    store = Store()
    store.tick()
    for kind, arg, n in actions:
        if kind == "signal":
            store.signal(arg, {"n": n, "name": arg})
        elif kind == "approve":
            store.signal(APPROVE, decision(arg, by=f"u{n}"))
        elif kind == "advance":
            store.now += timedelta(seconds=arg)
        else:
            store.control(kind)
        store.tick()
    # Eventually every input is supplied: controls drained, run resumed, signals sent.
    for _ in range(10):
        if not store.controls:
            break
        store.tick()
    if store.state.status == RunStatus.PAUSED:
        store.control("resume")
        store.tick()
    store.signal("go", {"final": "go"})
    store.signal("e1", {"final": "e1"})
    store.signal("e2", {"final": "e2"})
    store.now += timedelta(seconds=31)
    store.tick()
    if store.state.status == RunStatus.RUNNING:
        assert store.state.nodes["ok"].status == NodeStatus.WAITING
        store.signal(APPROVE, decision(True, by="final"))
        store.tick()
    assert store.state.status in (RunStatus.SUCCEEDED, RunStatus.FAILED)
    note(f"run {store.state.status.value}")
    note(f"{sum(1 for n in store.applied.values() if n is None)} approvals ignored")
    ok_ns = store.state.nodes["ok"]
    if store.state.status == RunStatus.FAILED:
        # Only a consumed rejection can fail this workflow.
        assert ok_ns.status == NodeStatus.FAILED
        assert signal_of(ok_ns) is not None
        assert store.payload_of(signal_of(ok_ns))["approved"] is False
    else:
        assert all(ns.status == NodeStatus.SUCCEEDED for ns in store.state.nodes.values())
        assert store.payload_of(signal_of(ok_ns))["approved"] is True  # type: ignore[arg-type]
        w_id = signal_of(store.state.nodes["w"])
        ev = events_of(store.state.nodes["ev"]) or {}
        assert set(ev) == {"e1", "e2"}
        # Oldest first: w took the first "go" ever sent and ev the first e1 and e2, however
        # long before the node was reached they arrived.
        gos = [s.id for s in store.signals if s.name == "go"]
        assert w_id == gos[0]
        for event, i in ev.items():
            assert i == next(s.id for s in store.signals if s.name == event)
    # Whatever happened, a quiet tick afterwards changes nothing.
    after = tick(MIXED, store.state, now=store.now + timedelta(days=1))
    assert after.changed is False
