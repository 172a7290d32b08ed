"""The engine's side of concurrency leases: the key an attempt asks for, and no re-sends
while it waits for a slot (the release that grants it sends it)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from support import FakeStep

from ductor_celery.definition import Workflow
from ductor_celery.definition.paths import Scope
from ductor_celery.definition.retry import ConcurrencyLimit
from ductor_celery.engine import AttemptCheck, RunState, TickInputs, compute_tick
from ductor_celery.engine.slots import lease_key_for

T0 = datetime(2026, 1, 1, tzinfo=UTC)


LIMITED = FakeStep(
    "s.partner", timeout=60.0, concurrency=ConcurrencyLimit(key="$.input.customer", limit=2)
)


def _spec() -> object:
    wf = Workflow("lim")
    wf.step("call", LIMITED)
    wf.scatter("each", LIMITED, over="$.input.items", after=["call"])
    return wf.build()


def test_the_key_is_the_step_and_the_resolved_value() -> None:
    spec = _spec()
    node = spec.graph.nodes["call"]  # type: ignore[attr-defined]

    def key(customer: object) -> str | None:
        return lease_key_for(node, Scope(input={"customer": customer}, context={}, outputs={}))

    assert key("acme") == "s.partner|acme"
    assert key({"b": 1, "a": 2}) == 's.partner|{"a": 2, "b": 1}'
    long_key = key("x" * 1000)
    assert long_key is not None and len(long_key) <= 500 and "sha256:" in long_key


def test_new_attempts_carry_the_key_and_limit() -> None:
    p = compute_tick(_spec(), RunState(), TickInputs(run_id="r", input={"customer": "acme"}), T0)
    [attempt] = p.new_attempts
    assert (attempt.lease_key, attempt.lease_limit) == ("s.partner|acme", 2)


def test_an_attempt_waiting_for_a_lease_is_not_re_sent() -> None:
    spec = _spec()
    s0 = compute_tick(spec, RunState(), TickInputs(run_id="r", input={"customer": "a"}), T0).state
    later = T0 + timedelta(seconds=61)
    waiting = AttemptCheck("r:call:1", claimed_at=None, finished=False, lease_waiting=True)
    p = compute_tick(
        spec,
        s0,
        TickInputs(run_id="r", input={"customer": "a"}, checks={"r:call:1": waiting}),
        later,
    )
    assert p.dispatches == [] and p.transitions == []
    assert p.state.nodes["call"].step.check_at == later + timedelta(seconds=60)
    lost = AttemptCheck("r:call:1", claimed_at=None, finished=False)
    p2 = compute_tick(
        spec,
        s0,
        TickInputs(run_id="r", input={"customer": "a"}, checks={"r:call:1": lost}),
        later,
    )
    assert [d.kind for d in p2.dispatches] == ["step"], "an unclaimed, unleased one is re-sent"
