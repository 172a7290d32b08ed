"""A chain of inline steps keeps one autocommit connection for its claims, reads and commits
(``db.keeping_autocommit``), instead of checking one out of the pool and in again per step;
it is given back when a statement on it fails, when its thread begins a tick's transaction,
and at the chain's end (PostgreSQL)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from inline_support import attempt_rows, deliver, make_ductor, run_row, start_run
from sqlalchemy import event

from ductor_celery import StepContext
from ductor_celery.definition import Workflow
from ductor_celery.runtime.steps import first_tick
from ductor_celery.store import db
from ductor_celery.store.db import autocommit, keeping_autocommit, release_kept

QUEUE = "ductor-steps"


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.engine.Engine]:
    engine = sa.create_engine(database_url)
    yield engine
    engine.dispose()


def _backend_pid(engine: sa.engine.Engine) -> int:
    with autocommit(engine) as conn:
        return int(conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())


def test_inside_one_connection_is_kept_between_uses_and_checked_in_at_the_end(
    engine: sa.engine.Engine,
) -> None:
    # Outside: each use checks a connection out and in again.
    assert _backend_pid(engine) and engine.pool.checkedout() == 0
    with keeping_autocommit(engine):
        first = _backend_pid(engine)
        assert engine.pool.checkedout() == 1  # kept, idle, between uses
        assert _backend_pid(engine) == first == _backend_pid(engine)
        with keeping_autocommit(engine):  # nested: keeps nothing more, releases nothing
            assert _backend_pid(engine) == first
        assert engine.pool.checkedout() == 1
        # Two at once (a use inside another): the inner one is the pool's, not the kept one.
        with autocommit(engine) as outer, autocommit(engine) as inner:
            assert outer is not inner
        assert engine.pool.checkedout() == 1
    assert engine.pool.checkedout() == 0


def test_a_connection_whose_statement_failed_goes_back_to_the_pool(
    engine: sa.engine.Engine,
) -> None:
    with keeping_autocommit(engine):
        first = _backend_pid(engine)
        with pytest.raises(sa.exc.DataError), autocommit(engine) as conn:
            conn.execute(sa.text("SELECT 1 / 0"))
        # Not kept: the next use is checked out anew (and works).
        assert engine.pool.checkedout() == 0
        assert _backend_pid(engine) in {first} | {_backend_pid(engine)}
        assert engine.pool.checkedout() == 1
    assert engine.pool.checkedout() == 0


def test_a_kept_connection_lost_meanwhile_fails_once_then_a_new_one_serves(
    engine: sa.engine.Engine, database_url: str
) -> None:
    with keeping_autocommit(engine):
        lost = _backend_pid(engine)
        with psycopg.connect(database_url.replace("+psycopg", ""), autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (lost,))
        with pytest.raises(sa.exc.OperationalError), autocommit(engine) as conn:
            conn.execute(sa.text("SELECT 1"))
        assert _backend_pid(engine) != lost
    assert engine.pool.checkedout() == 0


def test_release_kept_checks_it_in_and_the_kept_one_is_this_threads_own(
    engine: sa.engine.Engine,
) -> None:
    with keeping_autocommit(engine):
        mine = _backend_pid(engine)
        seen: list[int] = []
        other = threading.Thread(target=lambda: seen.append(_backend_pid(engine)))
        other.start()
        other.join()
        assert seen and seen[0] != mine  # another thread keeps nothing here
        release_kept()
        assert engine.pool.checkedout() == 0
        _backend_pid(engine)
        assert engine.pool.checkedout() == 1
    assert db._kept.engine is None and db._kept.conn is None


def _none_left_out(engine: sa.engine.Engine) -> bool:
    """No connection of the runtime's engine out, once its background look for lost outcomes
    (another thread, every few seconds) has given back the one it may be using."""
    deadline = time.monotonic() + 5
    while engine.pool.checkedout() and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.pool.checkedout() == 0


def _checkouts_at_once(engine: sa.engine.Engine) -> Any:
    """The most connections this thread had out at once (the pool-wide count would take in
    the runtime's background look for lost outcomes), while the returned list is watched."""
    me, out, most = threading.get_ident(), [0], [0]

    def on_checkout(*_args: Any) -> None:
        if threading.get_ident() == me:
            out[0] += 1
            most[0] = max(most[0], out[0])

    def on_checkin(*_args: Any) -> None:
        if threading.get_ident() == me:
            out[0] -= 1

    event.listen(engine.pool, "checkout", on_checkout)
    event.listen(engine.pool, "checkin", on_checkin)
    return most


def _mine(connects: list[int]) -> Any:
    """A pool listener counting this thread's check-outs into ``connects``."""
    me = threading.get_ident()
    return lambda *_: connects.append(1) if threading.get_ident() == me else None


def test_a_chain_with_transactions_of_its_own_runs_on_the_kept_connection(
    database_url: str,
) -> None:
    """A chain whose middle step's output is large (stored in a transaction of its own, and
    its tick offloads: another) runs every step, at most two connections out at once (the
    kept one idle beside a transaction), none after it; the other ticks commit on the kept
    one."""
    ductor, recorder = make_ductor(database_url, offload_bytes=1_000)

    @ductor.step(name="kept.add")
    def add(ctx: StepContext, value: int = 0) -> Any:
        return "x" * 5_000 if value == 2 else value + 1

    @ductor.step(name="kept.length")
    def length(ctx: StepContext, value: Any) -> int:
        return len(value) if isinstance(value, str) else value

    wf = Workflow("kept")
    wf.step("s0", add, args={"value": 0})
    for i in range(1, 8):
        step = length if i == 3 else add
        wf.step(f"s{i}", step, after=[f"s{i - 1}"], args={"value": f"$.nodes.s{i - 1}.output"})
    wf.output("$.nodes.s7.output")
    ductor.register(wf)
    engine = ductor.runtime.engine()
    run_id, first = start_run(ductor, "kept", recorder)
    most = _checkouts_at_once(engine)
    connects: list[int] = []
    event.listen(engine.pool, "checkout", _mine(connects))
    assert deliver(ductor, first) == "succeeded"
    assert most[0] == 2 and _none_left_out(engine)
    # Eight steps: the message's claim and tick, then the kept one, and the large value's
    # transactions (its write, the arguments read, the offloading tick), not one per step.
    assert len(connects) <= 6, len(connects)
    assert run_row(ductor, run_id).output == 5_004
    assert len(attempt_rows(ductor, run_id)) == 8 and recorder.rows == []


def test_nothing_is_kept_once_the_pools_size_is_out(database_url: str) -> None:
    """With as many connections out as the pool's size (many threads at once), each use
    checks its connection in again, as without keeping: a kept one never makes a thread wait
    for the pool."""
    engine = sa.create_engine(database_url, pool_size=2, max_overflow=5)
    try:
        with engine.connect() as busy:
            busy.execute(sa.text("SELECT 1"))
            with keeping_autocommit(engine):
                _backend_pid(engine)
                assert engine.pool.checkedout() == 2  # busy, and the kept one: room for it
            with keeping_autocommit(engine), engine.connect() as other:
                other.execute(sa.text("SELECT 1"))
                _backend_pid(engine)
                assert engine.pool.checkedout() == 2  # busy, other: the pool's size is out
    finally:
        engine.dispose()


def test_a_runs_first_tick_and_its_chain_share_the_kept_connection(database_url: str) -> None:
    ductor, _recorder = make_ductor(database_url)

    @ductor.step(name="kept.first")
    def add(ctx: StepContext, value: int = 0) -> int:
        return value + 1

    wf = Workflow("kept_first")
    wf.step("s0", add, args={"value": 0})
    for i in range(1, 6):
        wf.step(f"s{i}", add, after=[f"s{i - 1}"], args={"value": f"$.nodes.s{i - 1}.output"})
    wf.output("$.nodes.s5.output")
    ductor.register(wf)
    engine = ductor.runtime.engine()
    run_id = ductor.start("kept_first").run_id
    connects: list[int] = []
    event.listen(engine.pool, "checkout", _mine(connects))
    assert first_tick(ductor.runtime, run_id, "w1@host", QUEUE) == "committed"
    assert connects == [1]  # six ticks and steps, one check-out
    assert _none_left_out(engine)
    assert run_row(ductor, run_id).output == 6


def test_a_connection_kept_idle_too_long_is_checked_out_anew(
    engine: sa.engine.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a slow step (idle past ``KEPT_IDLE_AT_MOST_S``) the kept connection goes back
    and the next use checks one out, which is where the pool recycles old connections,
    replaces those of a pool a failover invalidated, and has plans refreshed."""
    checkouts: list[int] = []
    event.listen(engine.pool, "checkout", lambda *_: checkouts.append(1))
    with keeping_autocommit(engine):
        for _ in range(3):
            _backend_pid(engine)
    assert len(checkouts) == 1
    monkeypatch.setattr(db, "KEPT_IDLE_AT_MOST_S", 0.0)
    with keeping_autocommit(engine):
        for _ in range(3):
            _backend_pid(engine)
    assert len(checkouts) == 4
    assert engine.pool.checkedout() == 0


def test_a_child_forked_mid_chain_keeps_nothing_of_its_parents(engine: sa.engine.Engine) -> None:
    with keeping_autocommit(engine):
        mine = _backend_pid(engine)
        pid = os.fork()
        if pid == 0:  # the child: a step that forks
            os._exit(0 if db._kept.conn is None and db._kept.engine is None else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert _backend_pid(engine) == mine  # the parent's is still its own
