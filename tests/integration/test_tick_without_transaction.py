"""A tick that carries an outcome reads and commits in autocommit when its commit is the one
statement alone, and takes the run's lock inside that statement, at the version it read
(PostgreSQL; docs/tick-without-transaction.md): no ``BEGIN`` or ``COMMIT`` round trip, and
another tick at the run between the read and the commit makes it write nothing at all (busy),
the carried outcome included."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from celery import Celery

from ductor_celery import Ductor, Workflow
from ductor_celery.coordinator import OutcomeNotCarried, RunBusy
from ductor_celery.coordinator.loop import TickOutcome
from ductor_celery.engine import AttemptResult
from ductor_celery.engine.status import AttemptOutcome
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store import attempts
from ductor_celery.store.schema import step_attempt, workflow_run


@pytest.fixture
def ductor(database_url: str, tmp_path: Path) -> Any:
    app = Celery(f"twt{tmp_path.name}", set_as_current=False)
    app.conf.broker_url = "memory://"
    d = Ductor(app, database_url=database_url)
    d.runtime.dispatcher.send = lambda rows: None  # type: ignore[method-assign,assignment]
    d.runtime.dispatcher.wake = lambda run_id: None  # type: ignore[method-assign]
    d.runtime.dispatcher.first_tick = lambda run_id: None  # type: ignore[method-assign]
    d.step(name="twt.noop")(lambda ctx: None)
    d.step(name="twt.tag")(lambda ctx: ctx.tag("seen", "yes"))
    wf = Workflow("twt")
    wf.step("a", "twt.noop")
    wf.step("b", "twt.noop", after=["a"])
    d.register(wf)
    return d


@pytest.fixture
def sent_commands(monkeypatch: Any) -> list[bytes]:
    """The commands psycopg sends by themselves (``BEGIN ...``, ``COMMIT``, ``ROLLBACK``) from
    this thread (not the outbox janitor's, which deletes sent rows in the background)."""
    sent: list[bytes] = []
    real = psycopg.Connection._exec_command
    me = threading.get_ident()

    def recording(self: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == me:
            sent.append(bytes(command) if isinstance(command, bytes | bytearray) else b"?")
        return real(self, command, *args, **kwargs)

    monkeypatch.setattr(psycopg.Connection, "_exec_command", recording)
    return sent


def _open_attempt(d: Ductor) -> tuple[str, str]:
    """A run whose first step's attempt is claimed by worker "w": (run id, token)."""
    run_id = d.start("twt").run_id
    run_tick(d.runtime, run_id)
    with d.runtime.engine().connect() as conn:
        token = conn.execute(
            sa.select(step_attempt.c.token).where(step_attempt.c.run_id == run_id)
        ).scalar_one()
    assert attempts.claim(d.runtime.engine(), token, "w") is not None
    return run_id, str(token)


def _warm_pool(d: Ductor) -> None:
    """Connections opened before the tick: a new one's first use (SQLAlchemy reading the
    server's version) sends a BEGIN of its own."""
    engine = d.runtime.engine()
    with engine.connect(), engine.connect(), engine.connect():
        pass


def _another_commit_before_the_commit(d: Ductor, run_id: str) -> None:
    """Between the tick's read and its commit (its ``before_commit`` point), another writer
    commits the run: its version moves on, as another tick's commit moves it."""
    engine = d.runtime.engine()

    def another_tick(point: str) -> None:
        if point == "before_commit":
            with engine.begin() as conn:
                _new_version(conn, run_id)

    d.runtime.failpoint = another_tick


def _new_version(conn: Any, run_id: str) -> None:
    """The run's version moved on in ``conn``'s transaction, as another tick's commit moves it."""
    conn.execute(
        sa.update(workflow_run)
        .where(workflow_run.c.run_id == run_id)
        .values(record_version=workflow_run.c.record_version + 1)
    )


def _lock_run(conn: Any, run_id: str) -> None:
    """The run row locked in ``conn``'s transaction, as a tick's load locks it."""
    conn.execute(
        sa.select(workflow_run.c.run_id).where(workflow_run.c.run_id == run_id).with_for_update()
    ).one()


def _timer_rows(d: Ductor, run_id: str) -> int:
    with d.runtime.engine().connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT count(*) FROM eec_workflow_timer WHERE run_id = :r"),
                {"r": run_id},
            ).scalar_one()
        )


def _succeeded(token: str) -> AttemptResult:
    return AttemptResult(token=token, node="a", outcome=AttemptOutcome.SUCCEEDED, output=None)


def _attempt(d: Ductor, token: str) -> tuple[Any, ...]:
    with d.runtime.engine().connect() as conn:
        return tuple(
            conn.execute(
                sa.select(step_attempt.c.finished_at, step_attempt.c.folded).where(
                    step_attempt.c.token == token
                )
            ).one()
        )


def _timer_at(d: Ductor, run_id: str) -> Any:
    with d.runtime.engine().connect() as conn:
        return conn.execute(
            sa.text("SELECT fire_at FROM eec_workflow_timer WHERE run_id = :r"), {"r": run_id}
        ).scalar_one()


def _version(d: Ductor, run_id: str) -> int:
    with d.runtime.engine().connect() as conn:
        return int(
            conn.execute(
                sa.select(workflow_run.c.record_version).where(workflow_run.c.run_id == run_id)
            ).scalar_one()
        )


def test_a_carried_tick_whose_commit_is_one_statement_sends_no_begin_or_commit(
    ductor: Ductor, sent_commands: list[bytes]
) -> None:
    run_id, token = _open_attempt(ductor)
    version = _version(ductor, run_id)
    _warm_pool(ductor)
    sent_commands.clear()
    outcome = run_tick(ductor.runtime, run_id, eager=True, carried=_succeeded(token))
    assert outcome == TickOutcome.COMMITTED
    assert not [c for c in sent_commands if c.startswith((b"BEGIN", b"COMMIT"))], sent_commands
    finished_at, folded = _attempt(ductor, token)
    assert finished_at is not None and folded
    assert _version(ductor, run_id) == version + 1
    assert ductor.get(run_id).nodes["a"].status == "succeeded"


def test_a_tick_without_an_outcome_keeps_its_transaction(
    ductor: Ductor, sent_commands: list[bytes]
) -> None:
    run_id, token = _open_attempt(ductor)
    attempts.finish(ductor.runtime.engine(), token, outcome=AttemptOutcome.SUCCEEDED)
    _warm_pool(ductor)
    sent_commands.clear()
    assert run_tick(ductor.runtime, run_id, eager=True) == TickOutcome.COMMITTED
    assert any(c.startswith(b"BEGIN") for c in sent_commands), sent_commands
    assert b"COMMIT" in sent_commands


def test_another_commit_between_the_read_and_the_commit_makes_it_busy_writing_nothing(
    ductor: Ductor,
) -> None:
    """The read locks nothing past itself: a tick that commits the run in between (here, a
    version bump) leaves the carried tick's statement with no run to lock at its version."""
    run_id, token = _open_attempt(ductor)
    _another_commit_before_the_commit(ductor, run_id)
    version = _version(ductor, run_id)
    outcome = run_tick(ductor.runtime, run_id, eager=True, carried=_succeeded(token))
    assert outcome == TickOutcome.BUSY
    assert _attempt(ductor, token) == (None, False), "the carried outcome was not written"
    assert _version(ductor, run_id) == version + 1, "only the other commit's bump"
    assert ductor.get(run_id).nodes["a"].status == "running"


def _held_during_the_commit(
    d: Ductor, run_id: str, then: Any, waited: list[bool]
) -> threading.Thread:
    """Another transaction locks the run as the tick reaches its commit (its
    ``before_commit`` point), holds it until the tick's commit waits for its lock (``waited``
    says whether it was seen waiting), then runs ``then(conn)`` and commits."""
    engine = d.runtime.engine()
    locked = threading.Event()

    def hold_the_run() -> None:
        with engine.begin() as conn:
            _lock_run(conn, run_id)
            locked.set()
            waited.append(_a_commit_waits_for_a_lock(engine))
            then(conn)

    holder = threading.Thread(target=hold_the_run)

    def lock_before_commit(point: str) -> None:
        if point == "before_commit":
            holder.start()
            assert locked.wait(10)

    d.runtime.failpoint = lock_before_commit
    return holder


def _a_commit_waits_for_a_lock(engine: Any) -> bool:
    """Whether, within 10 s, a backend runs the tick's commit (its ``run_update``) waiting for
    a lock."""
    deadline = time.monotonic() + 10
    with engine.connect() as conn:
        while time.monotonic() < deadline:
            found = conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND query LIKE '%run_update AS%'"
                )
            ).scalar_one()
            conn.rollback()
            if found:
                return True
            time.sleep(0.01)
    return False


def test_a_run_another_tick_holds_and_commits_is_waited_for_then_busy_writing_nothing(
    ductor: Ductor,
) -> None:
    """The commit's run update takes the run's lock itself (no lock record of its own): it
    waits for the tick that holds the run, and finds the version that tick committed, not
    the one it read: it writes nothing, the carried outcome included (busy)."""
    run_id, token = _open_attempt(ductor)
    version = _version(ductor, run_id)

    waited: list[bool] = []
    holder = _held_during_the_commit(
        ductor, run_id, lambda conn: _new_version(conn, run_id), waited
    )
    try:
        outcome = run_tick(ductor.runtime, run_id, eager=True, carried=_succeeded(token))
    finally:
        holder.join(10)
    assert waited == [True], "the commit waited for the holder"
    assert outcome == TickOutcome.BUSY
    assert _attempt(ductor, token) == (None, False)
    assert _version(ductor, run_id) == version + 1, "only the holder's commit"


def test_a_run_another_tick_holds_and_leaves_unchanged_is_waited_for_then_committed(
    ductor: Ductor,
) -> None:
    """A holder that writes nothing (a no-op tick) leaves the run at the version read: the
    waiting commit then lands whole."""
    run_id, token = _open_attempt(ductor)
    version = _version(ductor, run_id)
    waited: list[bool] = []
    holder = _held_during_the_commit(ductor, run_id, lambda conn: None, waited)
    try:
        outcome = run_tick(ductor.runtime, run_id, eager=True, carried=_succeeded(token))
    finally:
        holder.join(10)
    assert waited == [True], "the commit waited for the holder"
    assert outcome == TickOutcome.COMMITTED
    assert _attempt(ductor, token)[1] is True
    assert _version(ductor, run_id) == version + 1
    assert ductor.get(run_id).nodes["a"].status == "succeeded"


def test_a_run_held_past_the_lock_timeout_is_busy_writing_nothing(
    ductor: Ductor, monkeypatch: Any
) -> None:
    """A holder that keeps the run (a process stopped mid-tick) is waited for at most the
    tick's lock timeout, set by the statement itself before its run update waits: then the
    statement fails as a whole and the tick is busy."""
    from ductor_celery.store import tick_store

    monkeypatch.setattr(tick_store, "TICK_LOCK_TIMEOUT", "200ms")
    run_id, token = _open_attempt(ductor)
    version = _version(ductor, run_id)
    engine = ductor.runtime.engine()
    reached: list[str] = []
    ductor.runtime.failpoint = reached.append
    with engine.begin() as holder:
        _lock_run(holder, run_id)
        outcome = run_tick(ductor.runtime, run_id, eager=True, carried=_succeeded(token))
    assert outcome == TickOutcome.BUSY
    assert "before_commit" in reached, "the tick read and computed: its read took no lock"
    assert _attempt(ductor, token) == (None, False)
    assert _version(ductor, run_id) == version


def test_a_run_updated_whose_outcome_cannot_be_written_is_rolled_back_whole(
    ductor: Ductor,
) -> None:
    """The run update comes first; the carried outcome after it, on its attempt row. An
    attempt finished meanwhile by someone else (here, directly) leaves the run updated and
    the outcome unwritten: ``eec_refuse`` rolls the statement back, and the tick says the
    outcome was not carried."""
    run_id, token = _open_attempt(ductor)
    version = _version(ductor, run_id)
    engine = ductor.runtime.engine()

    def finished_meanwhile(point: str) -> None:
        if point == "before_commit":
            with engine.begin() as conn:
                conn.execute(
                    sa.update(step_attempt)
                    .where(step_attempt.c.token == token)
                    .values(finished_at=sa.func.now(), outcome="failed")
                )

    ductor.runtime.failpoint = finished_meanwhile
    with pytest.raises(OutcomeNotCarried):
        run_tick(ductor.runtime, run_id, eager=True, carried=_succeeded(token))
    assert _version(ductor, run_id) == version, "the run update was rolled back"
    assert _attempt(ductor, token)[1] is False
    assert ductor.get(run_id).nodes["a"].status == "running"
    with engine.connect() as conn:
        attempts_of_run = conn.execute(
            sa.select(sa.func.count()).where(step_attempt.c.run_id == run_id)
        ).scalar_one()
    assert attempts_of_run == 1, "no next attempt inserted"


def test_a_commit_that_is_more_than_one_statement_locks_the_run_at_the_version_read(
    ductor: Ductor, sent_commands: list[bytes], monkeypatch: Any
) -> None:
    """A write besides the one statement (a timer row, a tag, a finished run's NOTIFY, ...;
    here every commit is taken for one) takes a transaction after the read, which locks the
    run at the version read: the same race as above is busy too, and nothing of it is
    written."""
    from ductor_celery.store import tick_store

    monkeypatch.setattr(tick_store, "commits_alone", lambda *args: False)
    run_id, token = _open_attempt(ductor)
    _warm_pool(ductor)
    sent_commands.clear()
    assert (
        run_tick(ductor.runtime, run_id, eager=True, carried=_succeeded(token))
        == TickOutcome.COMMITTED
    )
    assert sum(c.startswith(b"BEGIN") for c in sent_commands) == 1, sent_commands
    assert _attempt(ductor, token)[1] is True

    run_id, token = _open_attempt(ductor)
    _another_commit_before_the_commit(ductor, run_id)
    assert (
        run_tick(ductor.runtime, run_id, eager=True, carried=_succeeded(token)) == TickOutcome.BUSY
    )
    assert _attempt(ductor, token) == (None, False)


def test_lock_at_version_is_busy_for_a_run_at_another_version(ductor: Ductor) -> None:
    from ductor_celery.store.load import load_on
    from ductor_celery.store.ticks import lock_at_version

    run_id, _token = _open_attempt(ductor)
    engine = ductor.runtime.engine()
    rt = ductor.runtime
    with engine.connect() as conn:
        found = load_on(conn, run_id, rt.spec_for, rt.settings.engine_config())
        conn.rollback()
    assert found is not None
    loaded = found[0]
    with engine.begin() as conn:
        lock_at_version(conn, loaded, "20s", "5s")  # the version read: locked, until the end
        with engine.begin() as other:
            skipped = other.execute(
                sa.select(workflow_run.c.run_id)
                .where(workflow_run.c.run_id == run_id)
                .with_for_update(skip_locked=True)
            ).first()
        assert skipped is None, "another tick finds the run locked"
    loaded.record_version += 1
    with engine.begin() as conn, pytest.raises(RunBusy):
        lock_at_version(conn, loaded, "20s", "5s")


def test_the_tick_that_finishes_the_run_commits_alone_and_notifies_its_waiters(
    ductor: Ductor, database_url: str, sent_commands: list[bytes]
) -> None:
    """Step b's tick finishes the run: its NOTIFY is part of the one statement, so it too
    commits alone, and a waiter listening on the channel hears the run once it lands."""
    from ductor_celery.store.db import psycopg_connect_args
    from ductor_celery.store.finishes import RUN_FINISHED_CHANNEL

    run_id, token = _open_attempt(ductor)
    assert (
        run_tick(ductor.runtime, run_id, eager=True, carried=_succeeded(token))
        == TickOutcome.COMMITTED
    )
    with ductor.runtime.engine().connect() as conn:
        second = conn.execute(
            sa.select(step_attempt.c.token).where(
                step_attempt.c.run_id == run_id, step_attempt.c.node == "b"
            )
        ).scalar_one()
    assert attempts.claim(ductor.runtime.engine(), second, "w") is not None
    last = AttemptResult(token=second, node="b", outcome=AttemptOutcome.SUCCEEDED, output=None)
    assert _timer_rows(ductor, run_id) == 1, "a timer row for the last tick to delete"
    with psycopg.connect(**psycopg_connect_args(database_url), autocommit=True) as listener:
        listener.execute(f"LISTEN {RUN_FINISHED_CHANNEL}")
        _warm_pool(ductor)
        sent_commands.clear()
        assert run_tick(ductor.runtime, run_id, eager=True, carried=last) == TickOutcome.COMMITTED
        assert not [c for c in sent_commands if c.startswith((b"BEGIN", b"COMMIT"))]
        heard = [n.payload for n in listener.notifies(timeout=5, stop_after=1)]
    assert heard == [run_id]
    assert ductor.get(run_id).status == "succeeded"
    assert _timer_rows(ductor, run_id) == 0, "the finished run's timer row deleted by it"
    assert _attempt(ductor, second)[1] is True


@pytest.mark.parametrize("alone", [True, False], ids=["commit alone", "in a transaction"])
def test_a_timer_row_moved_since_the_read_makes_it_busy_writing_nothing(
    ductor: Ductor, monkeypatch: Any, alone: bool
) -> None:
    """A tick with nothing to commit moves a timer row that came due (``refresh_stale_timer``).
    A tick that read the row before it came due, and locks the run only at its commit, would
    keep it (a row in the future, no later than its own next wake-up, is left as it is) while
    the row had moved later, and the run would wake late: moving the row gives the run a new
    version, so that tick is busy and writes nothing."""
    from ductor_celery.store import tick_store

    if not alone:
        monkeypatch.setattr(tick_store, "commits_alone", lambda *args: False)
    run_id, token = _open_attempt(ductor)
    assert _timer_rows(ductor, run_id) == 1
    engine = ductor.runtime.engine()
    with engine.begin() as conn:
        # An early row, due just after the tick's read: the next tick with nothing to do
        # moves it.
        conn.execute(
            sa.text(
                "UPDATE eec_workflow_timer SET fire_at = now() + interval '300 milliseconds' "
                "WHERE run_id = :r"
            ),
            {"r": run_id},
        )
    stale = _timer_at(ductor, run_id)
    refreshed: list[TickOutcome] = []

    def coordinator_ticks_meanwhile(point: str) -> None:
        if point == "before_commit" and not refreshed:
            time.sleep(0.4)  # the row comes due
            refreshed.append(run_tick(ductor.runtime, run_id))

    ductor.runtime.failpoint = coordinator_ticks_meanwhile
    version = _version(ductor, run_id)
    outcome = run_tick(ductor.runtime, run_id, eager=True, carried=_succeeded(token))
    assert refreshed == [TickOutcome.NOOP]
    assert _timer_at(ductor, run_id) > stale, "the no-op tick moved the stale row"
    assert outcome == TickOutcome.BUSY
    assert _attempt(ductor, token) == (None, False)
    assert _version(ductor, run_id) == version + 1, "the timer's move is a new version"
