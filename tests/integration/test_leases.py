"""Concurrency leases against a real PostgreSQL (and once on SQLite), driven without Celery.

The tests play coordinator and worker by hand: ``load_tick``/``compute_tick``/``commit_tick``
for the coordinator, ``attempts.claim``/``attempts.finish`` for the worker, and
``sweep.reclaim_leases`` for the sweeper. What they check is the database's own record: lease
rows per key, which attempts may be claimed, which step messages go out and in what order.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from support import CONFIG, commit_tick, load_tick

from ductor_celery import ConcurrencyLimit, RetryPolicy
from ductor_celery.definition import Workflow
from ductor_celery.engine import RunStatus, compute_tick
from ductor_celery.runtime.step_context import Step
from ductor_celery.store import attempts, external, runs, sweep
from ductor_celery.store.db import get_engine
from ductor_celery.store.outbox import OutboxRow
from ductor_celery.store.ticks import VersionConflict

KEY = "lease.work|acme"


def _noop(ctx: Any, **_: Any) -> None:
    return None


def _step(
    limit: int = 2,
    *,
    timeout: float | None = None,
    retry: RetryPolicy | None = None,
    key: str = "$.input.customer",
) -> Step:
    return Step(
        name="lease.work",
        fn=_noop,
        retry=retry or RetryPolicy(max_attempts=1),
        timeout=timeout,
        concurrency=ConcurrencyLimit(key=key, limit=limit),
    )


def _spec(step: Step, *, version: int = 1, steps: int = 1) -> Any:
    wf = Workflow("limited", version=version)
    for i in range(steps):
        wf.step(f"w{i}", step, after=[f"w{i - 1}"] if i else [], args={"c": "$.input.customer"})
    wf.output(f"$.nodes.w{steps - 1}.output")
    return wf.build()


@pytest.fixture
def engine(database_url: str) -> Any:
    return get_engine(database_url)


def _start(engine: Any, spec: Any, run_id: str, customer: str = "acme") -> str:
    runs.save_definition(engine, spec)
    run_id, created = runs.insert_run(
        engine, run_id=run_id, workflow_id=run_id, spec=spec, input={"customer": customer}
    )
    assert created
    return run_id


def _tick(engine: Any, spec: Any, run_id: str) -> list[OutboxRow]:
    """One coordinator tick; the outbox rows it would send (none for a waiting attempt)."""
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


def _token(run_id: str, node: str = "w0", generation: int = 1) -> str:
    return f"{run_id}:{node}:{generation}"


def _holders(engine: Any, key: str = KEY) -> list[str]:
    with engine.connect() as conn:
        return sorted(
            conn.execute(
                sa.text("SELECT token FROM eec_concurrency_lease WHERE key = :k"), {"k": key}
            ).scalars()
        )


def _lease_count(engine: Any) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM eec_concurrency_lease")).scalar_one())


def _start_five(engine: Any, spec: Any) -> list[str]:
    """r1 .. r5 on one key, ticked in order: r1 and r2 hold, r3 .. r5 wait (oldest first)."""
    sent: list[str] = []
    ids = []
    for i in range(1, 6):
        run_id = _start(engine, spec, f"r{i}")
        sent += _steps(_tick(engine, spec, run_id))
        ids.append(run_id)
    assert sent == [_token("r1"), _token("r2")]
    return ids


def _run(engine: Any, token: str, outcome: str = "succeeded", **kw: Any) -> list[str]:
    """Claim and finish one attempt like a worker; the step messages its release sends."""
    assert attempts.claim(engine, token, f"w-{token}") is not None, token
    written, granted = attempts.finish(engine, token, outcome=outcome, **kw)
    assert written
    return _steps(granted)


# -- the limit and the queue ------------------------------------------------------------------


def test_the_limit_holds_across_runs_and_each_key_has_its_own(engine: Any) -> None:
    spec = _spec(_step(limit=2))
    _start_five(engine, spec)
    assert _holders(engine) == [_token("r1"), _token("r2")]
    # Another customer is another key: its first attempt runs at once.
    other = _start(engine, spec, "g1", customer="globex")
    assert _steps(_tick(engine, spec, other)) == [_token("g1")]
    assert _holders(engine, "lease.work|globex") == [_token("g1")]
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT token, lease_key, lease_limit FROM eec_workflow_step_attempt "
                "WHERE finished_at IS NULL ORDER BY token"
            )
        ).all()
    assert {r.lease_key for r in rows} == {KEY, "lease.work|globex"}
    assert {r.lease_limit for r in rows} == {2}
    # A waiting attempt's node is running (dispatched), only its message is held back.
    found = runs.find_run(engine, "r3")
    assert found is not None and found.state.nodes["w0"].status == "running"


def test_a_waiting_attempt_cannot_be_claimed_until_it_is_granted(engine: Any) -> None:
    spec = _spec(_step(limit=2))
    _start_five(engine, spec)
    # A duplicate or re-sent message for a waiting attempt: the claim refuses, nothing runs.
    assert attempts.claim(engine, _token("r3"), "early") is None
    assert _tick(engine, spec, "r3") == []  # nothing due yet
    assert _run(engine, _token("r1")) == [_token("r3")]
    claimed = attempts.claim(engine, _token("r3"), "granted")
    assert claimed is not None and claimed.args == {"c": "acme"}


def test_released_slots_go_to_the_oldest_waiter_first(engine: Any) -> None:
    spec = _spec(_step(limit=2))
    _start_five(engine, spec)
    order = _run(engine, _token("r2"))  # the second holder ends first
    order += _run(engine, _token("r1"), outcome="failed", error={"message": "x"})
    order += _run(engine, _token("r4"))
    order += _run(engine, _token("r3"))
    assert order == [_token("r3"), _token("r4"), _token("r5")]
    # Released in the worker's own transaction, granted messages already sent (by the caller)
    # and in the outbox until deleted.
    assert _holders(engine) == [_token("r5")]
    assert _run(engine, _token("r5")) == []
    assert _lease_count(engine) == 0


def test_a_new_attempt_queues_behind_older_waiters_even_when_a_slot_just_freed(
    engine: Any,
) -> None:
    spec = _spec(_step(limit=1))
    for run_id in ("r1", "r2"):
        _tick(engine, spec, _start(engine, spec, run_id))
    assert _holders(engine) == [_token("r1")]
    assert _run(engine, _token("r1")) == [_token("r2")]
    r3 = _start(engine, spec, "r3")
    assert _steps(_tick(engine, spec, r3)) == []  # r2 holds the only slot
    assert _run(engine, _token("r2")) == [_token("r3")]


def test_a_lowered_limit_counts_every_holder_not_slot_numbers(engine: Any) -> None:
    """Version 2 lowers the limit from 3 to 1 while version 1 attempts still hold slots."""
    v1, v2 = _spec(_step(limit=3), version=1), _spec(_step(limit=1), version=2)
    for run_id in ("a1", "a2", "a3"):
        assert len(_steps(_tick(engine, v1, _start(engine, v1, run_id)))) == 1
    b1 = _start(engine, v2, "b1")
    assert _steps(_tick(engine, v2, b1)) == []
    # Slots 0 and 1 free up, slot 2 is still held: one holder already fills a limit of 1.
    assert _run(engine, _token("a1")) == []
    assert _run(engine, _token("a2")) == []
    assert _holders(engine) == [_token("a3")]
    assert attempts.claim(engine, _token("b1"), "w") is None
    assert _run(engine, _token("a3")) == [_token("b1")]


# -- closing an attempt releases its lease ----------------------------------------------------


def test_cancelling_a_holder_releases_its_slot_to_the_oldest_waiter(engine: Any) -> None:
    spec = _spec(_step(limit=2))
    _start_five(engine, spec)
    assert attempts.claim(engine, _token("r1"), "w1") is not None
    external.insert_control(engine, run_id="r1", kind="cancel", reason="test")
    rows = _tick(engine, spec, "r1")
    assert _steps(rows) == [_token("r3")]  # the grant goes out with the cancel's commit
    assert [r.payload["token"] for r in rows if r.kind == "revoke"] == [_token("r1")]
    assert _holders(engine) == [_token("r2"), _token("r3")]
    found = runs.find_run(engine, "r1")
    assert found is not None and found.status == RunStatus.CANCELLED
    # The cancelled worker's late outcome is refused and frees nothing a second time.
    assert attempts.finish(engine, _token("r1"), outcome="succeeded", output=1) == (False, [])
    assert _holders(engine) == [_token("r2"), _token("r3")]


def test_cancelling_a_waiting_run_drops_it_from_the_queue(engine: Any) -> None:
    spec = _spec(_step(limit=2))
    _start_five(engine, spec)
    external.insert_control(engine, run_id="r3", kind="cancel", reason="test")
    assert _steps(_tick(engine, spec, "r3")) == []
    assert _holders(engine) == [_token("r1"), _token("r2")]
    assert _run(engine, _token("r1")) == [_token("r4")]  # r3 is gone from the queue


def test_a_timed_out_holder_releases_and_its_retry_queues_with_the_same_key(
    engine: Any,
) -> None:
    step = _step(limit=2, timeout=0.3, retry=RetryPolicy(max_attempts=2, initial_interval=0.05))
    spec = _spec(step)
    _start_five(engine, spec)
    assert attempts.claim(engine, _token("r1"), "doomed") is not None
    time.sleep(0.5)  # the claim's worker is silent past its step timeout
    rows = _tick(engine, spec, "r1")
    assert _steps(rows) == [_token("r3")]
    assert _holders(engine) == [_token("r2"), _token("r3")]
    time.sleep(0.1)
    assert _steps(_tick(engine, spec, "r1")) == []  # the retry waits: both slots are taken
    retry = _token("r1", generation=2)
    with engine.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT lease_key, lease_limit, args FROM eec_workflow_step_attempt "
                "WHERE token = :t"
            ),
            {"t": retry},
        ).one()
    assert (row.lease_key, row.lease_limit, row.args) == (KEY, 2, {"c": "acme"})
    # ... behind r4 and r5, which were queued before it.
    order = _run(engine, _token("r2"))
    order += _run(engine, _token("r3"))
    order += _run(engine, _token("r4"))
    assert order == [_token("r4"), _token("r5"), retry]


def test_a_retry_after_a_failure_keeps_the_key_its_first_attempt_resolved(engine: Any) -> None:
    step = _step(limit=1, retry=RetryPolicy(max_attempts=2, initial_interval=0.05))
    spec = _spec(step)
    run_id = _start(engine, spec, "r1")
    _tick(engine, spec, run_id)
    assert _run(engine, _token("r1"), outcome="failed", error={"message": "try again"}) == []
    _tick(engine, spec, run_id)  # folds the failure, schedules the retry
    time.sleep(0.1)
    assert _steps(_tick(engine, spec, run_id)) == [_token("r1", generation=2)]
    assert _holders(engine) == [_token("r1", generation=2)]


# -- many coordinators and workers at once ----------------------------------------------------


def test_concurrent_ticks_claims_and_finishes_never_exceed_the_limit(engine: Any) -> None:
    """Eight threads, each a coordinator and a worker for its own runs, all on two keys.
    A watcher reads the tables all along: never more lease rows, nor claimed open attempts,
    than the limit; and the threads themselves never run more than the limit at once."""
    limits = {"acme": 3, "globex": 1}
    spec = _spec(_step(limit=3), steps=3)
    spec_one = _spec(_step(limit=1), version=2, steps=3)
    threads_n, runs_per_thread = 8, 4
    owned: list[list[tuple[str, Any]]] = [[] for _ in range(threads_n)]
    for i in range(threads_n * runs_per_thread):
        customer = "acme" if (i // threads_n) % 2 == 0 else "globex"
        s = spec if customer == "acme" else spec_one
        owned[i % threads_n].append((_start(engine, s, f"c{i}", customer=customer), s))

    running = {"acme": 0, "globex": 0}
    seen_running = {"acme": 0, "globex": 0}
    seen_rows: dict[str, int] = {}
    errors: list[BaseException] = []
    mutex = threading.Lock()
    stop = threading.Event()

    def work(mine: list[tuple[str, Any]]) -> None:
        rng = random.Random(len(mine))
        try:
            open_runs = dict(mine)
            while open_runs:
                for run_id, s in list(open_runs.items()):
                    _tick(engine, s, run_id)
                    found = runs.find_run(engine, run_id)
                    assert found is not None
                    if found.status != RunStatus.RUNNING:
                        assert found.status == RunStatus.SUCCEEDED
                        del open_runs[run_id]
                        continue
                    customer = "acme" if s is spec else "globex"
                    for node in ("w0", "w1", "w2"):
                        token = found.state.nodes[node].step.token
                        if token is None:
                            continue
                        if attempts.claim(engine, token, f"t-{token}") is None:
                            continue  # waiting for a slot (or claimed already)
                        with mutex:
                            running[customer] += 1
                            seen_running[customer] = max(seen_running[customer], running[customer])
                        time.sleep(rng.uniform(0.03, 0.08))
                        with mutex:
                            running[customer] -= 1
                        attempts.finish(engine, token, outcome="succeeded", output=1)
                time.sleep(0.001)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    def watch() -> None:
        while not stop.is_set():
            with engine.connect() as conn:
                for key, count in conn.execute(
                    sa.text("SELECT key, count(*) FROM eec_concurrency_lease GROUP BY key")
                ):
                    seen_rows[key] = max(seen_rows.get(key, 0), int(count))
                for key, count in conn.execute(
                    sa.text(
                        "SELECT lease_key, count(*) FROM eec_workflow_step_attempt "
                        "WHERE claimed_at IS NOT NULL AND finished_at IS NULL GROUP BY lease_key"
                    )
                ):
                    seen_rows["claimed:" + key] = max(seen_rows.get("claimed:" + key, 0), count)

    watcher = threading.Thread(target=watch)
    watcher.start()
    workers = [threading.Thread(target=work, args=(owned[i],)) for i in range(threads_n)]
    started = time.monotonic()
    for t in workers:
        t.start()
    for t in workers:
        t.join(120)
    stop.set()
    watcher.join()
    assert not errors, errors
    assert time.monotonic() - started < 120
    for customer, limit in limits.items():
        key = f"lease.work|{customer}"
        assert seen_running[customer] <= limit
        assert seen_rows.get(key, 0) <= limit
        assert seen_rows.get("claimed:" + key, 0) <= limit
    assert seen_running["acme"] == 3  # the limit was reached, not just respected
    assert _lease_count(engine) == 0
    with engine.connect() as conn:
        assert (
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM eec_workflow_step_attempt WHERE outcome = 'succeeded'"
                )
            ).scalar_one()
            == 3 * threads_n * runs_per_thread
        )


def test_racing_acquires_on_one_key_grant_exactly_the_limit(engine: Any) -> None:
    """Twelve coordinators commit first attempts of one key at the same moment."""
    spec = _spec(_step(limit=4))
    ids = [_start(engine, spec, f"q{i}") for i in range(12)]
    barrier = threading.Barrier(len(ids))
    sent: list[str] = []
    errors: list[BaseException] = []

    def tick(run_id: str) -> None:
        try:
            loaded, _, inputs = load_tick(engine, run_id, lambda _h: spec, CONFIG)  # type: ignore[misc]
            payload = compute_tick(spec, loaded.state, inputs, loaded.now)
            barrier.wait()
            sent.extend(_steps(commit_tick(engine, loaded, payload)))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=tick, args=(r,)) for r in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(sent) == 4
    assert sorted(sent) == _holders(engine)


# -- the sweeper's backstop -------------------------------------------------------------------


def _expire(engine: Any, token: str) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE eec_concurrency_lease SET expires_at = now() - interval '1 second' "
                "WHERE token = :t"
            ),
            {"t": token},
        )


def test_the_sweeper_reclaims_a_lease_whose_holder_was_finished_behind_its_back(
    engine: Any,
) -> None:
    spec = _spec(_step(limit=2))
    _start_five(engine, spec)
    assert attempts.claim(engine, _token("r1"), "w") is not None
    with engine.begin() as conn:  # the outcome written without the release (an old bug, a hand)
        conn.execute(
            sa.text(
                "UPDATE eec_workflow_step_attempt SET finished_at = now(), outcome = 'succeeded' "
                "WHERE token = :t"
            ),
            {"t": _token("r1")},
        )
    sent: list[OutboxRow] = []
    # Not expired yet: the sweeper leaves it alone (one cheap query, nothing else).
    assert sweep.reclaim_leases(engine, sent.extend).keys == 0
    _expire(engine, _token("r1"))
    done = sweep.reclaim_leases(engine, sent.extend)
    assert (done.released, done.granted, done.extended) == (1, 1, 0)
    assert _steps(sent) == [_token("r3")]
    assert _holders(engine) == [_token("r2"), _token("r3")]
    with engine.connect() as conn:  # what was sent is not left in the outbox
        tokens = conn.execute(sa.text("SELECT payload FROM eec_workflow_outbox")).scalars()
        assert _token("r3") not in [p["token"] for p in tokens if "token" in p]
    assert sweep.reclaim_leases(engine, sent.extend).keys == 0


def test_the_sweeper_releases_a_lease_whose_holder_row_is_gone(engine: Any) -> None:
    spec = _spec(_step(limit=1))
    for run_id in ("r1", "r2"):
        _tick(engine, spec, _start(engine, spec, run_id))
    with engine.begin() as conn:
        conn.execute(
            sa.text("DELETE FROM eec_workflow_step_attempt WHERE token = :t"), {"t": _token("r1")}
        )
    _expire(engine, _token("r1"))
    sent: list[OutboxRow] = []
    done = sweep.reclaim_leases(engine, sent.extend)
    assert (done.released, done.granted) == (1, 1)
    assert _steps(sent) == [_token("r2")]


def test_the_sweeper_keeps_an_open_holders_lease_and_pushes_its_expiry(engine: Any) -> None:
    spec = _spec(_step(limit=1, timeout=60))
    for run_id in ("r1", "r2", "r3"):
        _tick(engine, spec, _start(engine, spec, run_id))
    assert attempts.claim(engine, _token("r1"), "w") is not None
    # r1 runs (claimed, open); r2 was granted nothing. Make r1's lease look expired.
    _expire(engine, _token("r1"))
    sent: list[OutboxRow] = []
    done = sweep.reclaim_leases(engine, sent.extend)
    assert (done.released, done.extended, done.granted) == (0, 1, 0)
    assert done.wake == ["r1"]  # its tick decides whether the claim is lost
    assert sent == []  # claimed: nothing to re-send
    assert _holders(engine) == [_token("r1")]
    with engine.connect() as conn:
        left = conn.execute(
            sa.text("SELECT expires_at - now() FROM eec_concurrency_lease WHERE token = :t"),
            {"t": _token("r1")},
        ).scalar_one()
    assert 55 < left.total_seconds() <= 60
    assert sweep.reclaim_leases(engine, sent.extend).keys == 0


def test_the_sweeper_resends_an_unclaimed_holders_message(engine: Any) -> None:
    """A grant's step message was lost: the holder sits unclaimed. After its lease's expiry
    the sweeper sends the message again instead of waiting for the run's re-send backoff."""
    spec = _spec(_step(limit=1, timeout=60))
    _tick(engine, spec, _start(engine, spec, "r1"))
    _expire(engine, _token("r1"))
    sent: list[OutboxRow] = []
    done = sweep.reclaim_leases(engine, sent.extend)
    assert (done.released, done.extended) == (0, 1)
    assert _steps(sent) == [_token("r1")]
    assert _holders(engine) == [_token("r1")]


def test_the_sweeper_grants_free_slots_to_waiters(engine: Any) -> None:
    """An operator raises the limit of attempts already waiting: the next sweep grants."""
    spec = _spec(_step(limit=1))
    for run_id in ("r1", "r2", "r3", "r4"):
        _tick(engine, spec, _start(engine, spec, run_id))
    assert _holders(engine) == [_token("r1")]
    sent: list[OutboxRow] = []
    assert sweep.reclaim_leases(engine, sent.extend).keys == 0
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE eec_workflow_step_attempt SET lease_limit = 3 WHERE lease_key = :k"),
            {"k": KEY},
        )
    done = sweep.reclaim_leases(engine, sent.extend)
    assert (done.keys, done.granted) == (1, 2)
    assert _steps(sent) == [_token("r2"), _token("r3")]
    assert _holders(engine) == [_token("r1"), _token("r2"), _token("r3")]
    assert sweep.reclaim_leases(engine, sent.extend).keys == 0


def test_the_sweeper_skips_a_key_another_transaction_is_changing(engine: Any) -> None:
    from ductor_celery.store import leases

    spec = _spec(_step(limit=1))
    for run_id in ("r1", "r2"):
        _tick(engine, spec, _start(engine, spec, run_id))
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE eec_workflow_step_attempt SET finished_at = now() WHERE token = :t"),
            {"t": _token("r1")},
        )
    _expire(engine, _token("r1"))
    sent: list[OutboxRow] = []
    with engine.begin() as busy:
        leases.lock_keys(busy, [KEY])
        done = sweep.reclaim_leases(engine, sent.extend)
        assert (done.skipped, done.released) == (1, 0)
    assert sweep.reclaim_leases(engine, sent.extend).released == 1
    assert _steps(sent) == [_token("r2")]


def test_no_leases_means_nothing_to_sweep(engine: Any) -> None:
    wf = Workflow("plain")
    wf.step("a", "s.a")
    plain = wf.build()
    _tick(engine, plain, _start(engine, plain, "p1"))
    assert sweep.lease_keys_to_sweep(engine, now=sweep._now(engine)) == []
    assert sweep.reclaim_leases(engine, lambda rows: None).keys == 0


# -- the embedded SQLite store ----------------------------------------------------------------


def test_leases_on_the_embedded_sqlite_store(tmp_path: Path) -> None:
    from ductor_celery.store.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'ductor.db'}"
    upgrade(url)
    engine = get_engine(url)
    spec = _spec(_step(limit=2))
    sent = []
    for i in range(1, 5):
        sent += _steps(_tick(engine, spec, _start(engine, spec, f"r{i}")))
    assert sent == [_token("r1"), _token("r2")]
    assert attempts.claim(engine, _token("r3"), "early") is None
    assert _run(engine, _token("r2")) == [_token("r3")]
    # The sweeper's backstop runs on SQLite too.
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE eec_workflow_step_attempt SET finished_at = :now, outcome = 'succeeded' "
                "WHERE token = :t"
            ),
            {"t": _token("r1"), "now": sweep._now(engine)},
        )
        conn.execute(
            sa.text("UPDATE eec_concurrency_lease SET expires_at = :past WHERE token = :t"),
            {"t": _token("r1"), "past": sweep._now(engine).replace(year=2000)},
        )
    rows: list[OutboxRow] = []
    done = sweep.reclaim_leases(engine, rows.extend)
    assert (done.released, done.granted) == (1, 1)
    assert _steps(rows) == [_token("r4")]
    assert _holders(engine) == [_token("r3"), _token("r4")]
    assert _run(engine, _token("r3")) == []
    assert _run(engine, _token("r4")) == []
    assert _holders(engine) == []


# -- scatter branches share keys like runs do -------------------------------------------------


def test_scatter_branches_keyed_by_item_queue_per_key(engine: Any) -> None:
    step = Step(
        name="lease.work",
        fn=_noop,
        retry=RetryPolicy(max_attempts=1),
        concurrency=ConcurrencyLimit(key="$.item.sku", limit=1),
    )
    wf = Workflow("fan")
    wf.scatter("each", step, over="$.input.items")
    wf.output("$.nodes.each.output")
    spec = wf.build()
    items = [{"sku": s} for s in ("a", "b", "a", "a", "b", "b")]
    runs.save_definition(engine, spec)
    run_id, _ = runs.insert_run(
        engine, run_id="f1", workflow_id="f1", spec=spec, input={"items": items}
    )

    def branch_token(branch: int) -> str:
        with engine.connect() as conn:
            return str(
                conn.execute(
                    sa.text(
                        "SELECT token FROM eec_workflow_step_attempt WHERE run_id = :r "
                        "AND branch = :b"
                    ),
                    {"r": run_id, "b": branch},
                ).scalar_one()
            )

    first = _steps(_tick(engine, spec, run_id))
    assert sorted(first) == sorted([branch_token(0), branch_token(1)])  # one per sku
    assert _holders(engine, "lease.work|a") == [branch_token(0)]
    order = _run(engine, branch_token(0), output=0)
    order += _run(engine, branch_token(1), output=1)
    order += _run(engine, branch_token(2), output=2)
    order += _run(engine, branch_token(4), output=4)
    assert order == [branch_token(i) for i in (2, 4, 3, 5)]
    _run(engine, branch_token(3), output=3)
    _run(engine, branch_token(5), output=5)
    for _ in range(5):
        _tick(engine, spec, run_id)
    found = runs.find_run(engine, run_id)
    assert found is not None and found.status == RunStatus.SUCCEEDED
    assert _lease_count(engine) == 0
