"""Rate limits against a real PostgreSQL and the embedded SQLite, driven without Celery
(docs/flow-control.md).

The tests play coordinator, worker and sweeper by hand: a tick commits the attempts,
``attempts.claim`` is the worker's claim (which takes the bucket's token), and
``rates.release_waiters`` is the sweeper's pass. Limits are per hour so that no token comes
back on its own during a test; a test that needs one moves the bucket's ``tat`` back.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from support import CONFIG, commit_tick, load_tick

from ductor_celery import RateLimit, RetryPolicy
from ductor_celery.coordinator.port import RateTake, TickClaim
from ductor_celery.definition import Workflow
from ductor_celery.engine import compute_tick
from ductor_celery.runtime.step_context import Step
from ductor_celery.store import attempts, external, rates, runs
from ductor_celery.store.db import aware, get_engine
from ductor_celery.store.migrate import upgrade
from ductor_celery.store.outbox import OutboxRow
from ductor_celery.store.rates import RateHeld
from ductor_celery.store.schema import rate_bucket, step_attempt
from ductor_celery.store.ticks import VersionConflict, commit_on

LIMIT = 3
PERIOD = 3600.0
ONE_TOKEN = timedelta(seconds=PERIOD / LIMIT)


def _noop(ctx: Any, **_: Any) -> None:
    return None


def _spec(rate: str = f"{LIMIT}/h") -> Any:
    step = Step(name="rate.work", fn=_noop, retry=RetryPolicy(max_attempts=2, initial_interval=0))
    wf = Workflow("rated")
    wf.step(
        "w0",
        step,
        args={"c": "$.input.customer"},
        rate_limit=RateLimit(rate, key="$.input.customer"),
    )
    wf.output("$.nodes.w0.output")
    return wf.build()


@pytest.fixture(params=["postgresql", "sqlite"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'ductor.db'}"
        upgrade(url)
        return get_engine(url)
    return get_engine(request.getfixturevalue("database_url"))


def _start(engine: Any, spec: Any, run_id: str, customer: str = "acme") -> list[str]:
    """Start a run and tick it; the tokens of the step messages the tick sends."""
    runs.save_definition(engine, spec)
    run_id, created = runs.insert_run(
        engine, run_id=run_id, workflow_id=run_id, spec=spec, input={"customer": customer}
    )
    assert created
    return _steps(_tick(engine, spec, run_id))


def _tick(engine: Any, spec: Any, run_id: str) -> list[OutboxRow]:
    for _ in range(20):
        loaded, spec2, inputs = load_tick(engine, run_id, lambda _h: spec, CONFIG)  # type: ignore[misc]
        payload = compute_tick(spec2, loaded.state, inputs, loaded.now)
        if not payload.changed:
            return []
        try:
            return commit_tick(engine, loaded, payload)
        except VersionConflict:
            continue
    raise AssertionError(f"run {run_id}: too many conflicts")


def _steps(rows: list[OutboxRow]) -> list[str]:
    return [r.payload["token"] for r in rows if r.kind == "step"]


def _token(run_id: str, generation: int = 1) -> str:
    return f"{run_id}:w0:{generation}"


def _claim(engine: Any, run_id: str, worker: str | None = None) -> Any:
    token = _token(run_id)
    return attempts.claim(engine, token, worker or f"w-{token}", step="rate.work")


def _waiting(engine: Any) -> list[str]:
    """Runs whose attempt waits in line and has not been released (sent) yet."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT run_id FROM eec_workflow_step_attempt WHERE rate_wait_since IS NOT "
                    "NULL AND rate_released_at IS NULL AND finished_at IS NULL "
                    "ORDER BY created_at, token"
                )
            ).scalars()
        )


def _refill(engine: Any, tokens: int, key: str = "rate.work|acme") -> None:
    """Move the bucket's clock back by ``tokens`` tokens' worth: as if that much time passed."""
    with engine.begin() as conn:
        tat = conn.execute(
            sa.select(rates.rate_bucket.c.tat).where(rates.rate_bucket.c.key == key)
        ).scalar_one()
        conn.execute(
            sa.update(rates.rate_bucket)
            .where(rates.rate_bucket.c.key == key)
            .values(tat=tat - ONE_TOKEN * tokens)
        )


def _released(engine: Any) -> list[str]:
    sent: list[OutboxRow] = []
    result = rates.release_waiters(engine, sent.extend)
    assert result.released == len(sent)
    return [r.run_id for r in sent]


def test_a_full_bucket_admits_n_claims_and_holds_the_rest_without_slowing_other_keys(
    engine: Any,
) -> None:
    spec = _spec()
    for i in range(1, 6):
        # Every attempt's message goes out as usual: the claim, not the tick, takes tokens.
        assert _start(engine, spec, f"r{i}") == [_token(f"r{i}")]
    claims = [_claim(engine, f"r{i}") for i in range(1, 6)]
    assert [type(c).__name__ for c in claims] == ["ClaimedAttempt"] * 3 + ["RateHeld"] * 2
    held = claims[3]
    assert isinstance(held, RateHeld)
    assert held.key == "rate.work|acme"
    assert _waiting(engine) == ["r4", "r5"]
    # Another key has its own bucket: not slowed by acme's waiters.
    _start(engine, spec, "g1", customer="globex")
    assert isinstance(_claim(engine, "g1"), attempts.ClaimedAttempt)
    # A waiter's duplicate message (the coordinator's re-send) claims nothing.
    assert isinstance(_claim(engine, "r4"), RateHeld)
    assert _waiting(engine) == ["r4", "r5"]


def test_the_sweeper_releases_the_oldest_waiters_as_tokens_come_back(engine: Any) -> None:
    spec = _spec()
    for i in range(1, 6):
        _start(engine, spec, f"r{i}")
        _claim(engine, f"r{i}")
    assert _released(engine) == []  # the bucket is empty: nothing to hand out
    _refill(engine, 1)
    assert _released(engine) == ["r4"]  # one token, the oldest waiter
    assert _waiting(engine) == ["r5"]
    # A new attempt does not overtake r5, even though its claim comes first.
    _start(engine, spec, "r6")
    claimed = _claim(engine, "r4")
    assert isinstance(claimed, attempts.ClaimedAttempt)
    assert isinstance(_claim(engine, "r6"), RateHeld)
    assert _waiting(engine) == ["r5", "r6"]
    _refill(engine, 5)
    # At most N at once, whatever the time since: a full bucket holds N tokens.
    assert _released(engine) == ["r5", "r6"]
    assert isinstance(_claim(engine, "r5"), attempts.ClaimedAttempt)
    assert isinstance(_claim(engine, "r6"), attempts.ClaimedAttempt)
    assert _waiting(engine) == []


def test_a_claim_retried_by_its_own_worker_takes_one_token(engine: Any) -> None:
    spec = _spec()
    _start(engine, spec, "r1")
    first = _claim(engine, "r1", worker="w-1")
    again = _claim(engine, "r1", worker="w-1")  # the first commit's answer was lost
    assert isinstance(first, attempts.ClaimedAttempt)
    assert isinstance(again, attempts.ClaimedAttempt)
    assert again.token == first.token
    # Two tokens are left of three: r2 and r3 run, r4 waits.
    for i in (2, 3, 4):
        _start(engine, spec, f"r{i}")
    got = [type(_claim(engine, f"r{i}")).__name__ for i in (2, 3, 4)]
    assert got == ["ClaimedAttempt", "ClaimedAttempt", "RateHeld"]
    # Another worker's message for a claimed attempt is a duplicate: nothing, no token.
    assert _claim(engine, "r1", worker="w-other") is None


def test_a_waiter_closed_by_its_run_leaves_the_queue(engine: Any) -> None:
    spec = _spec()
    for i in range(1, 6):
        _start(engine, spec, f"r{i}")
        _claim(engine, f"r{i}")
    external.insert_control(engine, run_id="r4", kind="terminate", reason="test")
    _tick(engine, spec, "r4")
    assert _waiting(engine) == ["r5"]  # closed: out of the queue, and never claimed
    assert _claim(engine, "r4") is None
    _refill(engine, 1)
    assert _released(engine) == ["r5"]


def test_a_retry_takes_a_token_from_its_first_attempts_bucket(engine: Any) -> None:
    spec = _spec()
    _start(engine, spec, "r1")
    claimed = _claim(engine, "r1")
    assert isinstance(claimed, attempts.ClaimedAttempt)
    written, _ = attempts.finish(
        engine, claimed.token, outcome="failed", error={"type": "Boom", "message": "x"}
    )
    assert written
    sent = _steps(_tick(engine, spec, "r1"))  # retry with no backoff: dispatched at once
    assert sent == [_token("r1", 2)]
    with engine.connect() as conn:
        key = conn.execute(
            sa.text("SELECT rate_key FROM eec_workflow_step_attempt WHERE token = :t"),
            {"t": _token("r1", 2)},
        ).scalar_one()
    assert key == "rate.work|acme"
    for i in (2, 3):
        _start(engine, spec, f"r{i}")
    # r1's first attempt and the retry, r2: three tokens; r3 waits.
    retry = attempts.claim(engine, _token("r1", 2), "w-retry", step="rate.work")
    assert isinstance(retry, attempts.ClaimedAttempt)
    assert isinstance(_claim(engine, "r2"), attempts.ClaimedAttempt)
    assert isinstance(_claim(engine, "r3"), RateHeld)


def test_a_step_without_a_rate_limit_never_touches_a_bucket(engine: Any) -> None:
    step = Step(name="plain.work", fn=_noop)
    wf = Workflow("plain")
    wf.step("w0", step, args={"c": "$.input.customer"})
    spec = wf.build()
    assert "rate_limit" not in spec.model_dump()["nodes"][0]  # hashes of old specs unchanged
    _start(engine, spec, "p1")
    claimed = attempts.claim(engine, _token("p1"), "w", step="plain.work")
    assert isinstance(claimed, attempts.ClaimedAttempt)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM eec_rate_bucket")).scalar_one() == 0


def _tick_claiming(engine: Any, spec: Any, run_id: str, worker: str) -> bool | None:
    """A tick run by a step worker that claims the new attempt in its commit (an inline
    chain's next step, runtime/inline.py), the commit taking its token; whether it did."""
    loaded, spec2, inputs = load_tick(engine, run_id, lambda _h: spec, CONFIG)  # type: ignore[misc]
    payload = compute_tick(spec2, loaded.state, inputs, loaded.now)
    rate = RateTake("rate.work|acme", LIMIT, PERIOD)
    claim = TickClaim(payload.new_attempts[0].token, worker, rate=rate)
    with engine.begin() as conn:
        assert _steps(commit_on(conn, loaded, payload, claim)) == []  # no message either way
    return rate.taken


def _claim_row(engine: Any, run_id: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT claimed_at, claimed_by, rate_wait_since FROM eec_workflow_step_attempt "
                "WHERE token = :t"
            ),
            {"t": _token(run_id)},
        ).one()


def test_an_inline_claim_takes_its_token_in_the_commit_or_waits_in_line_unclaimed(
    engine: Any,
) -> None:
    spec = _spec()
    runs.save_definition(engine, spec)
    taken = []
    for i in range(1, 6):
        runs.insert_run(
            engine, run_id=f"r{i}", workflow_id=f"r{i}", spec=spec, input={"customer": "acme"}
        )
        taken.append(_tick_claiming(engine, spec, f"r{i}", f"w{i}"))
    assert taken == [True, True, True, False, False]  # a bucket of 3
    held = _claim_row(engine, "r4")
    assert held.claimed_at is None and held.claimed_by is None
    assert held.rate_wait_since is not None
    assert _claim_row(engine, "r3").claimed_by == "w3"
    assert _waiting(engine) == ["r4", "r5"]
    _refill(engine, 1)
    # A token is back, but r4 is ahead of a newcomer's inline claim: the newcomer waits too.
    runs.insert_run(engine, run_id="r6", workflow_id="r6", spec=spec, input={"customer": "acme"})
    assert _tick_claiming(engine, spec, "r6", "w6") is False
    assert _released(engine) == ["r4"]  # served in line, by a message
    assert isinstance(_claim(engine, "r4"), attempts.ClaimedAttempt)


def test_an_inline_claim_that_takes_a_token_is_stamped_with_the_takes_time(
    engine: Any,
) -> None:
    """The bucket admits claims by the times it takes their tokens at; an attempt an inline
    tick's commit claims is inserted at the tick's time (its transaction's start, or its
    load on SQLite), so the take stamps it again, as a worker's own claim is stamped: a window
    of ``claimed_at`` times is then never shorter than the bucket's own."""
    spec = _spec()
    runs.save_definition(engine, spec)
    runs.insert_run(engine, run_id="t1", workflow_id="t1", spec=spec, input={"customer": "acme"})
    loaded, spec2, inputs = load_tick(engine, "t1", lambda _h: spec, CONFIG)  # type: ignore[misc]
    payload = compute_tick(spec2, loaded.state, inputs, loaded.now)
    rate = RateTake("rate.work|acme", LIMIT, PERIOD)
    claim = TickClaim(payload.new_attempts[0].token, "w1", rate=rate)
    time.sleep(0.05)  # the take comes later than the tick's clock, as on a loaded machine
    with engine.begin() as conn:
        commit_on(conn, loaded, payload, claim)
    assert rate.taken
    with engine.connect() as conn:
        claimed_at, claimed_by = conn.execute(
            sa.select(step_attempt.c.claimed_at, step_attempt.c.claimed_by).where(
                step_attempt.c.token == claim.token
            )
        ).one()
        took_at = conn.execute(
            sa.select(rate_bucket.c.updated_at).where(rate_bucket.c.key == "rate.work|acme")
        ).scalar_one()
    claimed_at, took_at = aware(claimed_at), aware(took_at)
    assert claimed_by == "w1"
    assert claimed_at == took_at
    assert (claimed_at - loaded.now).total_seconds() >= 0.04


def test_waiters_of_a_higher_priority_run_are_released_first(engine: Any) -> None:
    spec = _spec()
    runs.save_definition(engine, spec)
    for i, priority in ((1, 0), (2, 0), (3, 0), (4, 0), (5, 9), (6, 4)):
        runs.insert_run(
            engine,
            run_id=f"r{i}",
            workflow_id=f"r{i}",
            spec=spec,
            input={"customer": "acme"},
            priority=priority,
        )
        sent = _tick(engine, spec, f"r{i}")
        # The step message carries the run's priority to the broker (docs/flow-control.md).
        assert [r.payload.get("priority", 0) for r in sent] == [priority]
        _claim(engine, f"r{i}")
    assert _waiting(engine) == ["r4", "r5", "r6"]  # arrival order in the table
    _refill(engine, 2)
    assert _released(engine) == ["r5", "r6"]  # priority 9, then 4, before r4's 0


def test_a_released_waiter_keeps_its_turn_and_its_token_is_not_handed_out_twice(
    engine: Any,
) -> None:
    spec = _spec()
    for i in range(1, 5):
        _start(engine, spec, f"r{i}")
        _claim(engine, f"r{i}")
    _refill(engine, 1)
    assert _released(engine) == ["r4"]
    assert _released(engine) == []  # r4's claim has not come yet: its token is spoken for
    # A newer attempt's claim comes first, with a token in the bucket: r4 is still ahead.
    _start(engine, spec, "r5")
    assert isinstance(_claim(engine, "r5"), RateHeld)
    assert isinstance(_claim(engine, "r4"), attempts.ClaimedAttempt)
    assert _waiting(engine) == ["r5"]


def test_every_key_with_waiters_gets_its_turn_however_many_there_are(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rates, "KEYS_PER_SWEEP", 2)
    spec = _spec("1/h")
    customers = ["a", "b", "c", "d", "e"]
    for c in customers:  # each key: one holder (its only token) and one waiter
        for n in (1, 2):
            _start(engine, spec, f"{c}{n}", customer=c)
            _claim(engine, f"{c}{n}")
    for c in customers:
        _refill(engine, LIMIT, key=f"rate.work|{c}")  # one hour: one token of 1/h
    cursor, served = None, []
    for _ in range(3):  # two keys a pass: three passes reach all five
        sent: list[OutboxRow] = []
        result = rates.release_waiters(engine, sent.extend, cursor)
        cursor = result.last_key
        served += [r.run_id for r in sent]
    assert sorted(served) == [f"{c}2" for c in customers]
