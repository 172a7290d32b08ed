"""Rate limits without a database: the declarations refused with one clear error, and the
bucket's arithmetic (store/rates.py ``Bucket``) against its promise, by Hypothesis: claims
admitted one by one never exceed ``N + floor(w * N / period)`` over any window ``w``, and a
claim that finds a token is never refused one."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ductor_celery import DefinitionError, Ductor, RateLimit, Workflow
from ductor_celery.definition.paths import Scope
from ductor_celery.definition.spec import RateLimitSpec
from ductor_celery.engine.slots import rate_key_for
from ductor_celery.store.rates import Bucket

T0 = datetime(2026, 12, 3, tzinfo=UTC)


@pytest.mark.parametrize(
    ("rate", "key", "problem"),
    [
        ("10/d", None, "must be 'N/s', 'N/m' or 'N/h'"),
        ("ten/s", None, "must be 'N/s', 'N/m' or 'N/h'"),
        ("10 per second", None, "must be 'N/s', 'N/m' or 'N/h'"),
        ("1.5/s", None, "must be 'N/s', 'N/m' or 'N/h'"),
        (10, None, "must be 'N/s', 'N/m' or 'N/h'"),
        ("0/s", None, "N must be at least 1"),
        ("10/s", "customer", "key must be a path"),
        ("10/s", "", "key must be a path"),
        ("10/s", "$.input..x", "malformed path"),
        ("10/s", "$.secret.api", "a secret cannot key a bucket"),
    ],
)
def test_a_bad_rate_limit_is_refused_at_declaration(rate: Any, key: Any, problem: str) -> None:
    with pytest.raises(DefinitionError, match="RateLimit") as raised:
        RateLimit(rate, key=key)
    assert problem in str(raised.value)


def test_the_three_periods() -> None:
    assert RateLimit("10/s").to_spec() == RateLimitSpec(limit=10, period=1)
    assert RateLimit("100/m", key="$.input.a").to_spec() == RateLimitSpec(
        limit=100, period=60, key="$.input.a"
    )
    assert (RateLimit("5/h").limit, RateLimit("5/h").period) == (5, 3600)


def _ductor() -> Ductor:
    from celery import Celery

    return Ductor(Celery("rate_rules"), database_url="sqlite://")


def test_a_rate_key_path_is_checked_against_the_graph_at_registration() -> None:
    ductor = _ductor()

    @ductor.step(rate_limit=RateLimit("5/s", key="$.nodes.nowhere.output.id"))
    def call(ctx: Any) -> None: ...

    wf = Workflow("bad_key")
    wf.step("a", call)
    with pytest.raises(DefinitionError, match="unknown node 'nowhere'"):
        ductor.register(wf)


def test_the_wrong_type_and_the_places_a_rate_limit_cannot_go() -> None:
    ductor = _ductor()
    with pytest.raises(DefinitionError, match="rate_limit= takes a RateLimit"):

        @ductor.step(rate_limit="10/s")  # type: ignore[arg-type]
        def call(ctx: Any) -> None: ...

    @ductor.step
    def item(ctx: Any, item: Any) -> None: ...

    wf = Workflow("batched")
    wf.scatter(
        "s",
        item,
        over="$.input.items",
        batch_size=10,
        rate_limit=RateLimit("5/s", key="$.item.tenant"),
    )
    with pytest.raises(DefinitionError, match=r"cannot read \$\.item"):
        ductor.register(wf)
    wf = Workflow("children")
    with pytest.raises(DefinitionError, match="scatter over child runs"):
        wf.scatter(
            "s",
            workflow="other",
            as_child_runs=True,
            over="$.input.items",
            rate_limit=RateLimit("5/s"),
        )
    wf = Workflow("node_wrong_type")
    wf.step("a", item, args={"item": 1}, rate_limit=5)  # type: ignore[arg-type]
    with pytest.raises(DefinitionError, match="node 'a': rate_limit= takes a RateLimit"):
        ductor.register(wf)


def test_a_node_limit_replaces_the_steps_and_keys_are_per_step() -> None:
    ductor = _ductor()

    @ductor.step(rate_limit=RateLimit("5/s", key="$.input.customer"))
    def call(ctx: Any, customer: str) -> None: ...

    wf = Workflow("override")
    wf.step("own", call, args={"customer": "$.input.customer"})
    wf.step("node", call, args={"customer": "$.input.customer"}, rate_limit=RateLimit("1/m"))
    spec = ductor.register(wf)
    nodes = spec.graph.nodes
    scope = Scope(input={"customer": {"id": 7}}, context={}, outputs={})
    assert nodes["own"].rate_limit == RateLimitSpec(limit=5, period=1, key="$.input.customer")
    assert nodes["node"].rate_limit == RateLimitSpec(limit=1, period=60)
    # A value that is not a string is keyed by its canonical JSON; no key: the step alone.
    assert rate_key_for(nodes["own"], scope) == f'{call.name}|{{"id": 7}}'
    assert rate_key_for(nodes["node"], scope) == call.name


# -- the bucket's arithmetic -----------------------------------------------------------------


def _admit(limit: int, period: float, arrivals: list[float]) -> list[float]:
    """Claims at these times (seconds, in order), each admitted if the bucket has a token."""
    tat = T0
    admitted = []
    for at in arrivals:
        bucket = Bucket("k", tat, T0 + timedelta(seconds=at), limit, period)
        if bucket.tokens() > 0:
            tat = bucket.taken()
            admitted.append(at)
    return admitted


@settings(max_examples=300, deadline=None)
@given(
    limit=st.integers(1, 20),
    period=st.sampled_from([1.0, 60.0, 3600.0]),
    gaps=st.lists(st.floats(0, 2.0, allow_nan=False), min_size=1, max_size=120),
)
def test_admitted_claims_never_exceed_the_bucket(
    limit: int, period: float, gaps: list[float]
) -> None:
    scale = period / limit  # gaps measured in tokens' worth of time
    arrivals = []
    now = 0.0
    for gap in gaps:
        now += gap * scale
        arrivals.append(now)
    admitted = _admit(limit, period, arrivals)
    interval = period / limit
    for i, start in enumerate(admitted):
        for j in range(i, len(admitted)):
            window = admitted[j] - start
            # 1e-9: the float sums above, not the bucket, blur the exact boundary.
            assert j - i + 1 <= limit + math.floor(window / interval + 1e-9)
    # A full bucket admits a burst of N at one instant, and not one more.
    assert _admit(limit, period, [0.0] * (limit + 1)) == [0.0] * limit


@settings(max_examples=200, deadline=None)
@given(limit=st.integers(1, 50), spent=st.integers(0, 60), waited=st.floats(0, 5000))
def test_tokens_come_back_one_interval_at_a_time_up_to_n(
    limit: int, spent: int, waited: float
) -> None:
    period = 60.0
    # ``spent`` claims at T0 (as many as were admitted), then ``waited`` seconds pass.
    tat = T0
    for _ in range(spent):
        bucket = Bucket("k", tat, T0, limit, period)
        if bucket.tokens() == 0:
            break
        tat = bucket.taken()
    interval = Bucket("k", T0, T0, limit, period).interval  # period / N, rounded up to 1 µs
    used = (tat - T0) // interval
    assert used == min(spent, limit)
    waited_for = timedelta(seconds=waited)
    later = Bucket("k", tat, T0 + waited_for, limit, period)
    assert later.tokens() == max(0, min(limit, limit - used + waited_for // interval))
