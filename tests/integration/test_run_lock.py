"""The run's tick lock on PostgreSQL: an eager tick never waits for it, a coordinator tick does,
and ticks racing on one run do not recompute (issue 10: eager ticks, several coordinators)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from ductor_celery import Ductor, Workflow
from ductor_celery.engine import AttemptResult
from ductor_celery.engine.status import AttemptOutcome
from ductor_celery.runtime import steps, tick_task
from ductor_celery.runtime.outcome import Outcome
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store import attempts, tick_store
from ductor_celery.store.db import get_engine


@pytest.fixture
def ductor(database_url: str, tmp_path: Path) -> Any:
    app = Celery(f"lock{tmp_path.name}", set_as_current=False)
    app.conf.broker_url = "memory://"
    d = Ductor(app, database_url=database_url)
    sent: list[Any] = []
    d.runtime.dispatcher.send = sent.extend  # type: ignore[method-assign]
    d.runtime.dispatcher.wake = lambda run_id: None  # type: ignore[method-assign]
    d.runtime.dispatcher.first_tick = lambda run_id: None  # type: ignore[method-assign]
    d.step(name="t.noop")(lambda ctx, item=None: item)
    wf = Workflow("fan")
    wf.scatter("each", "t.noop", over="$.input.items", max_parallel=64)
    wf.step("after", "t.noop", after=["each"])
    d.register(wf)
    return d


def _record_version(url: str, run_id: str) -> int:
    with get_engine(url).connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT record_version FROM eec_workflow_run WHERE run_id = :r"),
                {"r": run_id},
            ).scalar_one()
        )


def _hold_run_lock(url: str, run_id: str, release: threading.Event, held: threading.Event) -> None:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(
            sa.text("SELECT 1 FROM eec_workflow_run WHERE run_id = :r FOR UPDATE"), {"r": run_id}
        )
        held.set()
        release.wait(10)
    engine.dispose()


def test_an_eager_tick_does_not_wait_for_a_run_another_tick_holds(
    ductor: Any, database_url: str
) -> None:
    run_id = ductor.start("fan", input={"items": [1, 2]}).run_id
    release, held = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_run_lock, args=(database_url, run_id, release, held))
    holder.start()
    try:
        assert held.wait(5)
        started = time.monotonic()
        assert run_tick(ductor.runtime, run_id, eager=True) == "busy"
        assert time.monotonic() - started < 1.0
        assert _record_version(database_url, run_id) == 0  # nothing written
    finally:
        release.set()
        holder.join()
    assert run_tick(ductor.runtime, run_id, eager=True) == "committed"
    assert _record_version(database_url, run_id) == 1


def test_a_coordinator_tick_waits_for_the_run_lock_and_then_commits(
    ductor: Any, database_url: str
) -> None:
    run_id = ductor.start("fan", input={"items": [1]}).run_id
    release, held = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_run_lock, args=(database_url, run_id, release, held))
    holder.start()
    assert held.wait(5)
    threading.Timer(0.5, release.set).start()
    started = time.monotonic()
    assert run_tick(ductor.runtime, run_id) == "committed"
    assert time.monotonic() - started >= 0.45
    holder.join()
    assert _record_version(database_url, run_id) == 1


def test_a_coordinator_tick_gives_up_on_a_lock_held_by_a_stalled_tick(
    ductor: Any, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tick whose process stopped or was cut off mid-tick keeps the run's lock: the
    coordinator (one tick at a time) must not wait on it with every other run behind it. It
    returns "busy" after TICK_LOCK_TIMEOUT, writes nothing, and the run stays for the sweeper
    (whose lost-wake-up scan ticks it again)."""
    monkeypatch.setattr(tick_store, "TICK_LOCK_TIMEOUT", "300ms")
    run_id = ductor.start("fan", input={"items": [1]}).run_id
    release, held = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_run_lock, args=(database_url, run_id, release, held))
    holder.start()
    try:
        assert held.wait(5)
        started = time.monotonic()
        assert run_tick(ductor.runtime, run_id) == "busy"
        assert 0.25 <= time.monotonic() - started < 3.0
        assert _record_version(database_url, run_id) == 0
    finally:
        release.set()
        holder.join()
    assert run_tick(ductor.runtime, run_id) == "committed"


@pytest.mark.parametrize("wait_for_lock", [True, False], ids=["coordinator", "eager"])
def test_the_server_ends_a_tick_that_stalls_holding_the_lock(
    ductor: Any, database_url: str, monkeypatch: pytest.MonkeyPatch, wait_for_lock: bool
) -> None:
    """A tick stalled between its load and its commit (a SIGSTOP, a partition: its
    transaction idle while holding the run's row lock) is ended by the server after
    TICK_IDLE_TIMEOUT, which frees the lock for the next tick; the stalled tick's next
    statement fails as a lost connection (retried from the start, fenced by record_version)."""
    monkeypatch.setattr(tick_store, "TICK_IDLE_TIMEOUT", "500ms")
    run_id = ductor.start("fan", input={"items": [1]}).run_id
    store = tick_store.SqlTickStore(
        get_engine(database_url), ductor.runtime.spec_for, ductor.settings.engine_config()
    )
    with pytest.raises(sa.exc.DBAPIError) as failed:  # noqa: PT012 - the stall is inside
        with store.transaction() as tx:
            assert tx.load(run_id, wait_for_lock=wait_for_lock) is not None
            # Another tick can take the lock once the server has ended the stalled one.
            other = sa.create_engine(database_url, poolclass=sa.pool.NullPool)
            try:
                deadline = time.monotonic() + 10
                while True:
                    try:
                        with other.begin() as conn:
                            conn.execute(
                                sa.text(
                                    "SELECT 1 FROM eec_workflow_run WHERE run_id = :r "
                                    "FOR UPDATE NOWAIT"
                                ),
                                {"r": run_id},
                            )
                        break
                    except sa.exc.OperationalError:
                        assert time.monotonic() < deadline, "the stalled tick kept the lock"
                        time.sleep(0.1)
            finally:
                other.dispose()
            tx.conn.execute(sa.text("SELECT 1"))  # the stalled tick wakes up: its session is gone
    assert failed.value.connection_invalidated
    assert _record_version(database_url, run_id) == 0
    assert run_tick(ductor.runtime, run_id) == "committed"


@pytest.mark.parametrize("wait_for_lock", [True, False], ids=["coordinator", "eager"])
def test_a_ticks_transaction_is_bounded_once_its_load_returns(
    ductor: Any, database_url: str, wait_for_lock: bool
) -> None:
    """The idle and lock timeouts are in force for the rest of the tick: set by a statement of
    their own before a read that waits for the run's lock, by the read itself in an eager
    tick (one round trip less); and only inside the tick's transaction."""
    run_id = ductor.start("fan", input={"items": [1]}).run_id
    store = tick_store.SqlTickStore(
        get_engine(database_url), ductor.runtime.spec_for, ductor.settings.engine_config()
    )
    settings = sa.text(
        "SELECT current_setting('idle_in_transaction_session_timeout'), "
        "current_setting('lock_timeout')"
    )
    with store.transaction() as tx:
        assert tx.load(run_id, wait_for_lock=wait_for_lock) is not None
        assert tuple(tx.conn.execute(settings).one()) == (
            tick_store.TICK_IDLE_TIMEOUT,
            tick_store.TICK_LOCK_TIMEOUT,
        )
        pid = tx.conn.connection.dbapi_connection.info.backend_pid
    with get_engine(database_url).connect() as conn:
        assert conn.connection.dbapi_connection.info.backend_pid == pid  # the same session
        assert tuple(conn.execute(settings).one()) == ("0", "0")


def test_eager_and_coordinator_ticks_racing_on_one_scatter_never_recompute(
    ductor: Any, database_url: str
) -> None:
    """Branches finishing at the same instant, each followed by an eager tick, while a
    coordinator ticks the same run: every result is folded once, with no version conflict."""
    items = list(range(40))
    run_id = ductor.start("fan", input={"items": items}).run_id
    engine = get_engine(database_url)
    assert run_tick(ductor.runtime, run_id) == "committed"
    with engine.connect() as conn:
        tokens = list(
            conn.execute(
                sa.text("SELECT token FROM eec_workflow_step_attempt WHERE run_id = :r"),
                {"r": run_id},
            ).scalars()
        )
    assert len(tokens) == len(items)
    before = tick_task.TICK_STATS.conflicts
    outcomes: list[str] = []
    barrier = threading.Barrier(len(tokens) + 1)

    def worker(token: str) -> None:
        claimed = attempts.claim(engine, token, f"w-{token}")
        assert claimed is not None
        barrier.wait()
        attempts.finish(engine, token, outcome="succeeded", output=claimed.branch)
        outcomes.append(run_tick(ductor.runtime, run_id, eager=True))

    def coord() -> None:
        barrier.wait()
        for _ in range(5):
            outcomes.append(run_tick(ductor.runtime, run_id))

    threads = [threading.Thread(target=worker, args=(t,)) for t in tokens]
    threads.append(threading.Thread(target=coord))
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # Whatever was busy or raced is picked up by one more coordinator tick (the wake-up those
    # workers would have sent); when that tick folds the last results, the gather is one more
    # (the wake-up the gathering scatter sends itself).
    for _ in range(3):
        run_tick(ductor.runtime, run_id)
        if ductor.get(run_id).nodes["each"].status == "succeeded":
            break
    assert tick_task.TICK_STATS.conflicts == before
    assert "conflict" not in outcomes
    view = ductor.get(run_id)
    assert view.nodes["each"].status == "succeeded"
    assert view.nodes["each"].output == items
    with engine.connect() as conn:
        unfolded = conn.execute(
            sa.text(
                "SELECT count(*) FROM eec_workflow_step_attempt WHERE run_id = :r "
                "AND finished_at IS NOT NULL AND NOT folded"
            ),
            {"r": run_id},
        ).scalar_one()
    assert unfolded == 0


# -- the worker's outcome carried by its eager tick, written by the tick's commit --------------
# (docs/one-statement-step.md)


def _first_attempt(engine: Any, run_id: str) -> str:
    with engine.connect() as conn:
        return str(
            conn.execute(
                sa.text("SELECT token FROM eec_workflow_step_attempt WHERE run_id = :r LIMIT 1"),
                {"r": run_id},
            ).scalar_one()
        )


def _attempt(engine: Any, token: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT outcome, output, folded, finished_at FROM eec_workflow_step_attempt "
                "WHERE token = :t"
            ),
            {"t": token},
        ).one()


def _carried(token: str, value: Any) -> AttemptResult:
    return AttemptResult(
        token=token, node="each", outcome=AttemptOutcome.SUCCEEDED, output=value, branch=0
    )


def _claimed_first_attempt(ductor: Any, database_url: str) -> tuple[str, str]:
    run_id = ductor.start("fan", input={"items": [7]}).run_id
    engine = get_engine(database_url)
    assert run_tick(ductor.runtime, run_id) == "committed"
    token = _first_attempt(engine, run_id)
    assert attempts.claim(engine, token, "w1") is not None
    return run_id, token


def test_the_carried_outcome_is_written_finished_and_folded_by_the_commit_that_applies_it(
    ductor: Any, database_url: str
) -> None:
    run_id, token = _claimed_first_attempt(ductor, database_url)
    assert run_tick(ductor.runtime, run_id, eager=True, carried=_carried(token, 7)) == "committed"
    row = _attempt(get_engine(database_url), token)
    assert (row.outcome, row.output, row.folded) == ("succeeded", 7, True)
    assert _record_version(database_url, run_id) == 2
    run_tick(ductor.runtime, run_id)  # the scatter gathers its branches' outputs
    assert ductor.get(run_id).nodes["each"].status == "succeeded"


def test_a_busy_run_writes_nothing_of_the_carried_outcome(ductor: Any, database_url: str) -> None:
    run_id, token = _claimed_first_attempt(ductor, database_url)
    release, held = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_run_lock, args=(database_url, run_id, release, held))
    holder.start()
    try:
        assert held.wait(5)
        outcome = run_tick(ductor.runtime, run_id, eager=True, carried=_carried(token, 7))
        assert outcome == "busy"
        row = _attempt(get_engine(database_url), token)
        assert (row.outcome, row.finished_at, row.folded) == (None, None, False)
    finally:
        release.set()
        holder.join()
    assert _record_version(database_url, run_id) == 1


def test_a_closed_attempt_refuses_the_carried_outcome_and_nothing_is_written(
    ductor: Any, database_url: str
) -> None:
    run_id, token = _claimed_first_attempt(ductor, database_url)
    ductor.terminate(run_id)  # applied by the call: the terminate closes the attempt
    version = _record_version(database_url, run_id)
    with pytest.raises(tick_task.OutcomeNotCarried):
        run_tick(ductor.runtime, run_id, eager=True, carried=_carried(token, 7))
    assert _attempt(get_engine(database_url), token).outcome == "cancelled"
    assert _record_version(database_url, run_id) == version


def test_an_outcome_carried_twice_is_applied_once(ductor: Any, database_url: str) -> None:
    """A commit whose acknowledgement was lost is retried from the load: the outcome is then
    in the run already, and the second commit refuses it whole (the worker's ``finish`` then
    answers "closed")."""
    run_id, token = _claimed_first_attempt(ductor, database_url)
    assert run_tick(ductor.runtime, run_id, eager=True, carried=_carried(token, 7)) == "committed"
    version = _record_version(database_url, run_id)
    with pytest.raises(tick_task.OutcomeNotCarried):
        run_tick(ductor.runtime, run_id, eager=True, carried=_carried(token, 8))
    assert _record_version(database_url, run_id) == version
    row = _attempt(get_engine(database_url), token)
    assert (row.outcome, row.output, row.folded) == ("succeeded", 7, True)
    written, _ = attempts.finish(
        get_engine(database_url), token, outcome=AttemptOutcome.SUCCEEDED, output=8
    )
    assert not written


def test_a_conflict_rolls_the_carried_outcome_back_with_the_tick_and_the_retry_writes_it(
    ductor: Any, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id, token = _claimed_first_attempt(ductor, database_url)
    real_commit = tick_store.commit_on
    calls: list[Any] = []

    def commit_once_conflicting(
        conn: Any, loaded: Any, payload: Any, claim: Any = None, carried: Any = None
    ) -> Any:
        calls.append(carried)
        outbox = real_commit(conn, loaded, payload, claim, carried)
        if len(calls) == 1:  # written, then rolled back with the tick
            raise tick_task.VersionConflict(run_id)
        return outbox

    monkeypatch.setattr(tick_store, "commit_on", commit_once_conflicting)
    assert run_tick(ductor.runtime, run_id, eager=True, carried=_carried(token, 7)) == "committed"
    assert [c.token for c in calls] == [token, token]
    row = _attempt(get_engine(database_url), token)
    assert (row.outcome, row.output, row.folded) == ("succeeded", 7, True)
    assert _record_version(database_url, run_id) == 2


def test_a_worker_whose_eager_tick_finds_the_run_busy_writes_its_outcome_and_wakes_it(
    ductor: Any, database_url: str
) -> None:
    run_id, token = _claimed_first_attempt(ductor, database_url)
    rt, engine = ductor.runtime, get_engine(database_url)
    woken: list[str] = []
    rt.dispatcher.wake = woken.append
    claimed = attempts.ClaimedAttempt(
        token=token,
        run_id=run_id,
        workflow_id=run_id,
        node="each",
        branch=0,
        generation=0,
        attempt=1,
        step="t.noop",
        args={},
        context={},
        spec_hash="",
        queued_s=0.0,
    )
    step = rt.step_named("t.noop")
    release, held = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_run_lock, args=(database_url, run_id, release, held))
    holder.start()
    try:
        assert held.wait(5)
        result = Outcome(AttemptOutcome.SUCCEEDED, output=7)
        assert steps._record_and_advance(rt, engine, step, claimed, result) == "succeeded"
        row = _attempt(engine, token)
        assert (row.outcome, row.output, row.folded) == ("succeeded", 7, False)
        assert woken == [run_id]
    finally:
        release.set()
        holder.join()
    assert run_tick(rt, run_id) == "committed"
    assert _attempt(engine, token).folded
