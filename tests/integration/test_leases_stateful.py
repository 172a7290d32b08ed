"""Concurrency leases under random interleavings: a Hypothesis state machine on the real store.

The machine plays every actor by hand, as ``test_leases.py`` does: a client starting runs, the
coordinator (``load_tick``/``compute_tick``/``commit_tick``), step workers
(``attempts.claim``/``attempts.finish``), an operator (cancel, terminate, redrive controls) and
the sweeper (``sweep.reclaim_leases``). Runs use one of two keys, limit 1 and limit 2; each run
has two parallel steps on its key followed by a third, with retries. After every rule the
machine reads the lease and attempt tables and checks:

- a key never has more lease rows than its limit;
- every lease row names an attempt that exists, of the same key;
- every claimed, unfinished attempt holds a lease (only holders run);
- no finished attempt holds a lease;
- no key has a free slot while one of its attempts waits (every release and sweep hands
  slots on in its own transaction, and a new attempt never overtakes a waiter);
- waiters are served oldest first: every open holder is older (``created_at``, token) than
  every waiter of its key. This holds here because the machine never interleaves two ticks:
  ``created_at`` is the tick's transaction start, so two coordinators whose ticks overlap can
  take the key's lock in the other order, and the later-started one may then hold a slot while
  the earlier-started one waits (a fairness detail, not a limit violation).

Rules check their own effects too: a claim succeeds exactly when the attempt holds a lease
and is open and unclaimed; a finish writes exactly when the attempt was open, frees its lease,
and hands the slot to the key's oldest waiter; a timed-out claim is closed; a cancelled or
terminated run has no open attempt; a tick whose load predates a worker's finish of an
attempt it closes conflicts, and the worker's outcome stands; the sweeper neither frees nor
grants a slot (nothing is left behind in steady state), extends the expired leases of open
holders and only sends holders' messages. ``drain`` checks liveness (workers that always
succeed finish every run and leave no lease); ``teardown`` cancels everything, ticks, sweeps
and asserts no attempt is open and no lease is left on the example's keys.

Time: the coordinator's clock is virtual. Each run has an offset, only ever growing, added to
the database time its tick loads (``compute_tick(..., now + offset)``), and the claim checks
due at that later time are loaded for it. ``tick_run`` may move a run's clock by 31 s (past
the 30 s retry back-off and the 30 s re-send of unclaimed attempts), ``time_out`` by more than
the 300 s step timeout. Real time between two rules (milliseconds) stays far below those
margins, so a replayed example behaves the same. The database's own times (claims, attempt
creation, lease expiry) stay real; the sweeper's clock is moved by making the example's leases
look expired (as ``test_leases.py`` does).

Store: PostgreSQL, the store that counts (advisory key locks are only taken there), through
the ``database_url`` fixture. One database serves every example (a fresh one per example
would cost a database copy and a connection pool each): each example uses its own run ids and
its own two keys (a random prefix), reads only its own rows, and its teardown ends with a
clean-up that closes whatever the example left open, even after a failure, so the sweeper's
passes over the whole table never meet an earlier example's rows. 30 examples of 25 steps run
in about 25 s.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from support import CONFIG, commit_tick, load_tick

from ductor_celery import ConcurrencyLimit, RetryPolicy
from ductor_celery.definition import Workflow
from ductor_celery.engine import compute_tick
from ductor_celery.engine.status import RunStatus
from ductor_celery.runtime.step_context import Step
from ductor_celery.store import attempts, external, runs, sweep
from ductor_celery.store.db import get_engine
from ductor_celery.store.load import _checks
from ductor_celery.store.outbox import OutboxRow
from ductor_celery.store.ticks import VersionConflict

STEP_NAME = "lease.stateful"
TIMEOUT = 300.0  # the step timeout (start-to-close), in seconds of the virtual clock
RETRY_AFTER = 30.0  # every retry's back-off
WAIT = RETRY_AFTER + 1.0  # what ``tick_run`` may move a run's clock by
LIMITS = (1, 2)  # key 0 has limit 1, key 1 limit 2
MAX_RUNS = 8  # per example: enough to queue on both keys, few enough to reach the later rules
OPEN_RUN = {RunStatus.PENDING.value, RunStatus.RUNNING.value, RunStatus.PAUSED.value}
REDRIVABLE = {RunStatus.FAILED.value, RunStatus.CANCELLED.value, RunStatus.TERMINATED.value}


def _noop(ctx: Any, **_: Any) -> None:
    return None


def _spec(limit: int) -> Any:
    """Two parallel steps on the run's key, then a third after both: one tick can ask for two
    slots of one key, and a run asks again after its first slots end."""
    step = Step(
        name=STEP_NAME,
        fn=_noop,
        retry=RetryPolicy(max_attempts=3, initial_interval=RETRY_AFTER, backoff=1.0),
        timeout=TIMEOUT,
        concurrency=ConcurrencyLimit(key="$.input.customer", limit=limit),
    )
    wf = Workflow(f"stateful_limit_{limit}")
    wf.step("a", step, args={"c": "$.input.customer"})
    wf.step("b", step, args={"c": "$.input.customer"})
    wf.step("c", step, after=["a", "b"], args={"c": "$.input.customer"})
    wf.output("$.nodes.c.output")
    return wf.build()


SPECS = {limit: _spec(limit) for limit in LIMITS}


@dataclass(frozen=True)
class Row:
    token: str
    run_id: str
    lease_key: str | None
    created_at: datetime
    claimed: bool
    finished: bool
    outcome: str | None


@dataclass(frozen=True)
class Snapshot:
    attempts: dict[str, Row]
    leases: dict[str, list[str]]  # key -> holder tokens
    holder_key: dict[str, str]  # holder token -> key

    def holds(self, token: str) -> bool:
        return token in self.holder_key

    def waiters(self, key: str) -> list[Row]:
        return sorted(
            (
                r
                for r in self.attempts.values()
                if r.lease_key == key and not r.finished and not self.holds(r.token)
            ),
            key=lambda r: (r.created_at, r.token),
        )


def _step_tokens(rows: list[OutboxRow]) -> list[str]:
    return [r.payload["token"] for r in rows if r.kind == "step"]


class LeaseMachine(RuleBasedStateMachine):
    def __init__(self, engine: Any) -> None:
        super().__init__()
        self.engine = engine
        prefix = uuid.uuid4().hex[:10]
        self.prefix = prefix
        self.customers = [f"{prefix}-k{i}" for i in range(len(LIMITS))]
        self.keys = [f"{STEP_NAME}|{c}" for c in self.customers]
        self.limit = dict(zip(self.keys, LIMITS, strict=True))
        self.runs: list[str] = []
        self.spec_of: dict[str, Any] = {}
        self.offset: dict[str, float] = {}
        self.claimed: set[str] = set()  # tokens a worker of ours claimed and has not finished
        self.claims = 0
        self.drained = False

    # -- reading the database ----------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        with self.engine.connect() as conn:
            lease_rows = conn.execute(
                sa.text(
                    "SELECT key, token FROM eec_concurrency_lease WHERE key IN :keys "
                    "ORDER BY key, slot"
                ).bindparams(sa.bindparam("keys", expanding=True)),
                {"keys": self.keys},
            ).all()
            rows = conn.execute(
                sa.text(
                    "SELECT token, run_id, lease_key, created_at, claimed_at, finished_at, "
                    "outcome FROM eec_workflow_step_attempt "
                    "WHERE run_id LIKE :p OR token IN :holders"
                ).bindparams(sa.bindparam("holders", expanding=True)),
                {"p": f"{self.prefix}-%", "holders": [r.token for r in lease_rows] or [""]},
            ).all()
        leases: dict[str, list[str]] = {k: [] for k in self.keys}
        for r in lease_rows:
            leases[r.key].append(r.token)
        return Snapshot(
            attempts={
                r.token: Row(
                    r.token,
                    r.run_id,
                    r.lease_key,
                    r.created_at,
                    r.claimed_at is not None,
                    r.finished_at is not None,
                    r.outcome,
                )
                for r in rows
            },
            leases=leases,
            holder_key={r.token: r.key for r in lease_rows},
        )

    def statuses(self) -> dict[str, str]:
        with self.engine.connect() as conn:
            return dict(
                conn.execute(
                    sa.text("SELECT run_id, status FROM eec_workflow_run WHERE run_id LIKE :p"),
                    {"p": f"{self.prefix}-%"},
                ).all()
            )

    def open_runs(self) -> list[str]:
        statuses = self.statuses()
        return [r for r in self.runs if statuses[r] in OPEN_RUN]

    def closed_runs(self) -> list[str]:
        """Runs a redrive may reopen: failed, cancelled or terminated."""
        statuses = self.statuses()
        return [r for r in self.runs if statuses[r] in REDRIVABLE]

    # -- the actors ----------------------------------------------------------------------------

    def compute(self, run_id: str) -> tuple[Any, Any]:
        """The coordinator's load and compute at the run's virtual time."""
        spec = self.spec_of[run_id]
        got = load_tick(self.engine, run_id, lambda _h: spec, CONFIG)
        assert got is not None
        loaded, spec2, inputs = got
        now = loaded.now + timedelta(seconds=self.offset[run_id])
        if self.offset[run_id]:
            # The claim checks due at the later time (the loader looked at the real one).
            with self.engine.connect() as conn:
                inputs = dataclasses.replace(inputs, checks=_checks(conn, loaded.state, now))
        return loaded, compute_tick(spec2, loaded.state, inputs, now)

    def tick(self, run_id: str, advance: float = 0.0) -> list[OutboxRow]:
        """One coordinator tick at the run's virtual time (moved on by ``advance`` first)."""
        self.offset[run_id] += advance
        for _ in range(20):
            loaded, payload = self.compute(run_id)
            if not payload.changed:
                return []
            try:
                return commit_tick(self.engine, loaded, payload)
            except VersionConflict:
                continue
        raise AssertionError(f"run {run_id}: too many conflicts")

    def claim(self, token: str) -> bool:
        self.claims += 1
        got = attempts.claim(self.engine, token, f"worker-{self.claims}")
        if got is not None:
            self.claimed.add(token)
        return got is not None

    def finish(self, token: str, outcome: str, retryable: bool = True) -> tuple[bool, list[str]]:
        error = None if outcome == "succeeded" else {"message": "boom"}
        written, granted = attempts.finish(
            self.engine,
            token,
            outcome=outcome,
            output={"token": token} if outcome == "succeeded" else None,
            error=error,
            retryable=retryable,
            leased=True,
        )
        self.claimed.discard(token)
        return written, _step_tokens(granted)

    def control(self, run_id: str, kind: str) -> list[OutboxRow]:
        external.insert_control(self.engine, run_id=run_id, kind=kind, reason="stateful test")
        return self.tick(run_id)

    def reclaim(self) -> Any:
        sent: list[OutboxRow] = []
        done = sweep.reclaim_leases(self.engine, sent.extend)
        after = self.snapshot()
        for token in _step_tokens(sent):
            if token in after.attempts:  # this example's (earlier ones leave nothing behind)
                assert after.holds(token), f"the sweeper sent {token}, which holds no lease"
        return done

    # -- rules ---------------------------------------------------------------------------------

    @precondition(lambda self: len(self.runs) < MAX_RUNS)
    @rule(which=st.sampled_from(range(len(LIMITS))), and_tick=st.booleans())
    def start_run(self, which: int, and_tick: bool) -> None:
        spec = SPECS[LIMITS[which]]
        run_id = f"{self.prefix}-r{len(self.runs)}"
        runs.save_definition(self.engine, spec)
        _, created = runs.insert_run(
            self.engine,
            run_id=run_id,
            workflow_id=run_id,
            spec=spec,
            input={"customer": self.customers[which]},
        )
        assert created
        self.runs.append(run_id)
        self.spec_of[run_id] = spec
        self.offset[run_id] = 0.0
        if and_tick:
            self.tick(run_id)

    @precondition(lambda self: self.runs)
    @rule(data=st.data(), advance=st.sampled_from([0.0, WAIT]))
    def tick_run(self, data: st.DataObject, advance: float) -> None:
        self.tick(data.draw(st.sampled_from(self.runs), label="run"), advance)

    def try_claim(self, data: st.DataObject, *, granted_only: bool) -> None:
        before = self.snapshot()
        tokens = sorted(t for t, r in before.attempts.items() if r.run_id in self.spec_of)
        if granted_only:
            tokens = [t for t in tokens if before.holds(t) and not before.attempts[t].claimed]
        if not tokens:
            return
        token = data.draw(st.sampled_from(tokens), label="token")
        row = before.attempts[token]
        expected = before.holds(token) and not row.claimed and not row.finished
        assert self.claim(token) == expected, (token, row, before.holds(token))
        if not row.finished and not row.claimed and not before.holds(token):
            event("claim refused: the attempt waits for a slot")

    @precondition(lambda self: self.claimed)
    @rule(data=st.data(), advance=st.sampled_from([0.0, WAIT, TIMEOUT + 1.0]))
    def tick_racing_a_worker(self, data: st.DataObject, advance: float) -> None:
        """A worker's finish lands between a tick's load and its commit. A tick that would close
        that attempt (timeout, cancel) must conflict and recompute: the worker's outcome stands."""
        token = data.draw(st.sampled_from(sorted(self.claimed)), label="token")
        own_run = token.rsplit(":", 2)[0]  # tokens are run:node:generation
        run_id = data.draw(st.sampled_from([own_run, *self.runs]), label="run")
        ok = data.draw(st.booleans(), label="succeeded")
        self.offset[run_id] += advance
        loaded, payload = self.compute(run_id)
        written, _ = self.finish(token, "succeeded" if ok else "failed")
        closes = token in {c.token for c in payload.closed}
        if payload.changed:
            try:
                commit_tick(self.engine, loaded, payload)
                assert not (written and closes), f"{token}: a close overwrote a finish"
            except VersionConflict:
                event("a tick conflicted with a worker's finish")
                self.tick(run_id)
        if written:
            row = self.snapshot().attempts[token]
            assert row.outcome == ("succeeded" if ok else "failed"), row

    @precondition(lambda self: self.runs)
    @rule(data=st.data())
    def claim_granted(self, data: st.DataObject) -> None:
        """A holder's step message arrives: a worker claims it."""
        self.try_claim(data, granted_only=True)

    @precondition(lambda self: self.runs)
    @rule(data=st.data())
    def claim_any(self, data: st.DataObject) -> None:
        """Any attempt's message arrives (re-sent, duplicated, stale): the claim succeeds only
        for an open, unclaimed holder."""
        self.try_claim(data, granted_only=False)

    @precondition(lambda self: self.claimed)
    @rule(data=st.data())
    def finish_succeeded(self, data: st.DataObject) -> None:
        self.try_finish(data, "succeeded", retryable=True)

    @precondition(lambda self: self.claimed)
    @rule(data=st.data(), retryable=st.booleans())
    def finish_failed(self, data: st.DataObject, retryable: bool) -> None:
        self.try_finish(data, "failed", retryable=retryable)

    def try_finish(self, data: st.DataObject, outcome: str, *, retryable: bool) -> None:
        """A worker that claimed an attempt writes its outcome (maybe after it was closed)."""
        token = data.draw(st.sampled_from(sorted(self.claimed)), label="token")
        before = self.snapshot()
        was_open = not before.attempts[token].finished
        written, granted = self.finish(token, outcome, retryable=retryable)
        assert written == was_open, (token, before.attempts[token])
        after = self.snapshot()
        assert not after.holds(token)
        if not written:
            assert granted == []
            return
        key = before.holder_key.get(token)
        assert key is not None, f"{token} ran without a lease"
        assert len(granted) == len(set(granted))
        waiting = [w.token for w in before.waiters(key)]
        # The freed slot goes to the oldest waiter of the key, if any.
        assert granted == waiting[: len(granted)], (granted, waiting)
        assert len(granted) == min(1, len(waiting)), (granted, waiting)
        for g in granted:
            assert after.holds(g) and after.holder_key[g] == key
        if granted:
            event("finish handed its slot to a waiter")

    @precondition(lambda self: self.open_runs())
    @rule(data=st.data(), kind=st.sampled_from(["cancel", "terminate"]))
    def cancel_run(self, data: st.DataObject, kind: str) -> None:
        run_id = data.draw(st.sampled_from(self.open_runs()), label="run")
        before = self.snapshot()
        self.control(run_id, kind)
        assert self.statuses()[run_id] == ("cancelled" if kind == "cancel" else "terminated")
        after = self.snapshot()
        left = [r.token for r in after.attempts.values() if r.run_id == run_id and not r.finished]
        assert left == [], f"{kind} left attempts of {run_id} open: {left}"
        if any(before.holds(t) for t, r in before.attempts.items() if r.run_id == run_id):
            event("a cancel released a held slot")

    @precondition(lambda self: self.closed_runs())
    @rule(data=st.data())
    def redrive_run(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(self.closed_runs()), label="run")
        self.control(run_id, "redrive")
        assert self.statuses()[run_id] in OPEN_RUN | {"succeeded"}

    @precondition(lambda self: self.claimed)
    @rule(data=st.data())
    def time_out(self, data: st.DataObject) -> None:
        """A claimed attempt's worker is silent: its run's clock moves past the step timeout."""
        before = self.snapshot()
        running = sorted(t for t in self.claimed if not before.attempts[t].finished)
        if not running:
            return
        token = data.draw(st.sampled_from(running), label="token")
        self.tick(before.attempts[token].run_id, advance=TIMEOUT + 1.0)
        after = self.snapshot()
        assert after.attempts[token].finished, f"{token} outlived its timeout"
        assert not after.holds(token)
        key = before.holder_key[token]
        if before.waiters(key):
            event("a timeout handed its slot to a waiter")

    @precondition(lambda self: self.runs)
    @rule(expire=st.booleans())
    def run_sweeper(self, expire: bool) -> None:
        """The sweeper's lease pass; with ``expire`` this example's leases look expired."""
        if expire:
            with self.engine.begin() as conn:
                conn.execute(
                    sa.text(
                        "UPDATE eec_concurrency_lease SET expires_at = now() - interval '1 second' "
                        "WHERE key IN :keys"
                    ).bindparams(sa.bindparam("keys", expanding=True)),
                    {"keys": self.keys},
                )
        before = self.snapshot()
        done = self.reclaim()
        after = self.snapshot()
        # Every holder is open (see the invariants), so the sweeper frees none of this
        # example's leases; and no slot is free while an attempt waits, so it grants none.
        assert after.holder_key == before.holder_key, (before.leases, after.leases)
        if expire:
            with self.engine.connect() as conn:
                stale = conn.execute(
                    sa.text(
                        "SELECT token FROM eec_concurrency_lease "
                        "WHERE key IN :keys AND expires_at <= now()"
                    ).bindparams(sa.bindparam("keys", expanding=True)),
                    {"keys": self.keys},
                ).all()
            assert stale == [], f"open holders' expired leases not extended: {stale}"
            if done.sent:
                event("the sweeper re-sent an unclaimed holder's message")
        for run_id in sorted(set(done.wake) & set(self.spec_of)):
            self.tick(run_id)  # the sweeper wakes runs whose holder outlived its lease

    @precondition(lambda self: len(self.runs) >= 3 and not self.drained)
    @rule()
    def drain(self) -> None:
        """Liveness: workers that always succeed and a coordinator that keeps ticking finish
        every run; then no attempt is open and no lease is left. Once per example (it closes
        everything, so the rules after it start from a clean slate)."""
        self.drained = True
        for _ in range(60):
            open_runs = self.open_runs()
            if not open_runs:
                break
            snap = self.snapshot()
            for token in sorted(snap.holder_key):
                row = snap.attempts[token]
                assert not row.claimed or token in self.claimed, token
                if not row.claimed:
                    assert self.claim(token)
                written, _ = self.finish(token, "succeeded")
                assert written
            for run_id in open_runs:
                self.tick(run_id, advance=WAIT)
        assert self.open_runs() == []
        for run_id in self.runs:  # fold late outcomes of closed attempts
            self.tick(run_id)
        after = self.snapshot()
        assert [r.token for r in after.attempts.values() if not r.finished] == []
        assert after.leases == {k: [] for k in self.keys}
        event("drain finished every run")

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def leases_are_consistent(self) -> None:
        snap = self.snapshot()
        for key, holders in snap.leases.items():
            limit = self.limit[key]
            assert len(holders) <= limit, f"{key}: {len(holders)} leases over limit {limit}"
            for token in holders:
                row = snap.attempts.get(token)
                assert row is not None, f"{key}: lease held by {token}, which does not exist"
                assert row.lease_key == key, (token, row.lease_key, key)
                assert not row.finished, f"{key}: lease held by finished {token} ({row.outcome})"
            waiters = snap.waiters(key)
            if waiters:
                event(
                    f"limit {limit}: {len(waiters)} waiting"
                    if len(waiters) < 3
                    else f"limit {limit}: 3+ waiting"
                )
                assert len(holders) >= limit, (
                    f"{key}: {len(holders)}/{limit} slots held while "
                    f"{[w.token for w in waiters]} wait"
                )
                oldest_waiter = (waiters[0].created_at, waiters[0].token)
                for token in holders:
                    row = snap.attempts[token]
                    assert (row.created_at, row.token) < oldest_waiter, (
                        f"{key}: {token} holds a slot while older {waiters[0].token} waits"
                    )
        for row in snap.attempts.values():
            if row.claimed and not row.finished and row.lease_key is not None:
                assert snap.holds(row.token), f"{row.token} is claimed and open without a lease"

    def teardown(self) -> None:
        """Cancel everything, tick, sweep: no lease may be left on this example's keys."""
        try:
            for run_id in self.open_runs():
                self.control(run_id, "cancel")
            for run_id in self.runs:
                self.tick(run_id)
            for token in sorted(self.claimed):  # late outcomes of cancelled attempts: refused
                assert self.finish(token, "succeeded") == (False, [])
            self.reclaim()
            after = self.snapshot()
            assert [r.token for r in after.attempts.values() if not r.finished] == []
            assert after.leases == {k: [] for k in self.keys}
        finally:
            # Whatever happened, the next example starts from a database with nothing open,
            # so its sweeps (which look at every key) behave the same on every replay.
            with self.engine.begin() as conn:
                conn.execute(
                    sa.text("DELETE FROM eec_concurrency_lease WHERE key IN :keys").bindparams(
                        sa.bindparam("keys", expanding=True)
                    ),
                    {"keys": self.keys},
                )
                conn.execute(
                    sa.text(
                        "UPDATE eec_workflow_step_attempt SET finished_at = now(), "
                        "outcome = 'cancelled', folded = true "
                        "WHERE run_id LIKE :p AND finished_at IS NULL"
                    ),
                    {"p": f"{self.prefix}-%"},
                )


@pytest.fixture
def engine(database_url: str) -> Any:
    return get_engine(database_url)


def test_leases_hold_under_random_interleavings(engine: Any) -> None:
    run_state_machine_as_test(
        lambda: LeaseMachine(engine),
        settings=settings(
            max_examples=30,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
