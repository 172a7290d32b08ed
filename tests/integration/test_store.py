"""The store's guarantees against a real PostgreSQL: versioned commits, claim by token, outcome
written once, outbox relay. Driven directly, without Celery."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa
from support import CONFIG, commit_tick, load_tick, tick_once

from ductor_celery.definition import Workflow
from ductor_celery.engine import AttemptResult, RunStatus, compute_tick
from ductor_celery.store import attempts, runs, sweep
from ductor_celery.store.db import get_engine
from ductor_celery.store.outbox import OutboxRow, delete_outbox
from ductor_celery.store.ticks import VersionConflict


def _spec() -> Any:
    wf = Workflow("two")
    wf.step("a", "s.a", args={"x": "$.input.x"})
    wf.step("b", "s.b", after=["a"], args={"y": "$.nodes.a.output"})
    wf.output("$.nodes.b.output")
    return wf.build()


@pytest.fixture
def engine(database_url: str) -> Any:
    return get_engine(database_url)


def _start(engine: Any, spec: Any, run_id: str = "r1") -> str:
    runs.save_definition(engine, spec)
    run_id, created = runs.insert_run(
        engine, run_id=run_id, workflow_id=run_id, spec=spec, input={"x": 2}
    )
    assert created
    return run_id


def _tick(engine: Any, spec: Any, run_id: str) -> list[OutboxRow]:
    return tick_once(engine, run_id, lambda _h: spec)


def test_a_commit_against_a_moved_version_writes_nothing(engine: Any) -> None:
    spec = _spec()
    run_id = _start(engine, spec)
    loaded, _, inputs = load_tick(engine, run_id, lambda _h: spec, CONFIG)  # type: ignore[misc]
    payload = compute_tick(spec, loaded.state, inputs, loaded.now)
    commit_tick(engine, loaded, payload)
    # A second coordinator computed from the same version: it must lose, and write nothing.
    with pytest.raises(VersionConflict):
        commit_tick(engine, loaded, payload)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM eec_workflow_step_attempt")).scalar() == 1
        assert conn.execute(sa.text("SELECT count(*) FROM eec_workflow_outbox")).scalar() == 1
        assert conn.execute(sa.text("SELECT record_version FROM eec_workflow_run")).scalar() == 1


def test_racing_coordinators_commit_each_version_once(engine: Any) -> None:
    spec = _spec()
    run_id = _start(engine, spec)
    outcomes: list[str] = []
    barrier = threading.Barrier(4)

    def race() -> None:
        loaded, _, inputs = load_tick(engine, run_id, lambda _h: spec, CONFIG)  # type: ignore[misc]
        payload = compute_tick(spec, loaded.state, inputs, loaded.now)
        barrier.wait()
        try:
            commit_tick(engine, loaded, payload)
            outcomes.append("won")
        except VersionConflict:
            outcomes.append("lost")

    threads = [threading.Thread(target=race) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["lost", "lost", "lost", "won"]
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM eec_workflow_step_attempt")).scalar() == 1
        seqs = conn.execute(sa.text("SELECT seq FROM eec_workflow_history ORDER BY seq")).scalars()
        assert list(seqs) == [0, 1]


def test_claim_is_exclusive_and_the_outcome_is_written_once(engine: Any) -> None:
    spec = _spec()
    run_id = _start(engine, spec)
    [row] = _tick(engine, spec, run_id)
    token = row.payload["token"]
    claimed = attempts.claim(engine, token, "w1")
    assert claimed is not None and claimed.args == {"x": 2}
    assert attempts.run_input(engine, run_id) == {"x": 2}  # read lazily, by ctx.input
    assert attempts.claim(engine, token, "w2") is None  # a duplicate message does nothing
    assert attempts.finish(engine, token, outcome="succeeded", output=3)[0]
    assert not attempts.finish(engine, token, outcome="succeeded", output=99)[0]
    assert runs.attempt_outputs(engine, [token]) == {token: 3}
    assert attempts.claim(engine, token, "w3") is None  # finished: never claimable again


def test_a_finished_attempt_is_folded_once_and_feeds_its_dependant(engine: Any) -> None:
    spec = _spec()
    run_id = _start(engine, spec)
    [row] = _tick(engine, spec, run_id)
    token = row.payload["token"]
    attempts.claim(engine, token, "w")
    attempts.finish(engine, token, outcome="succeeded", output=5)
    [next_row] = _tick(engine, spec, run_id)
    assert next_row.task == "s.b"
    second = attempts.claim(engine, next_row.payload["token"], "w")
    assert second is not None and second.args == {"y": 5}
    assert _tick(engine, spec, run_id) == []  # nothing new: a no-op tick writes nothing
    assert sweep.unfolded_runs(engine, older_than=0) == []


def test_a_worker_result_racing_a_timeout_close_is_not_lost(engine: Any) -> None:
    """The coordinator decides to close an attempt, the worker finishes first: recompute."""
    spec = _spec()
    run_id = _start(engine, spec)
    [row] = _tick(engine, spec, run_id)
    token = row.payload["token"]
    attempts.claim(engine, token, "w")
    loaded, _, inputs = load_tick(engine, run_id, lambda _h: spec, CONFIG)  # type: ignore[misc]
    import dataclasses
    from datetime import timedelta

    from ductor_celery.engine import AttemptCheck

    later = loaded.now + timedelta(seconds=CONFIG.default_step_timeout + 60)
    check = AttemptCheck(token=token, claimed_at=loaded.now, finished=False)
    payload = compute_tick(
        spec, loaded.state, dataclasses.replace(inputs, checks={token: check}), later
    )
    assert [c.token for c in payload.closed] == [token]
    attempts.finish(engine, token, outcome="succeeded", output=1)  # the worker wins the race
    with pytest.raises(VersionConflict):
        commit_tick(engine, loaded, payload)
    assert runs.attempt_outputs(engine, [token]) == {token: 1}
    _tick(engine, spec, run_id)  # the recomputed tick folds the real result
    row_after = runs.find_run(engine, run_id)
    assert row_after is not None and row_after.state.nodes["a"].status == "succeeded"


def test_stale_outbox_rows_are_relayed_once(engine: Any) -> None:
    spec = _spec()
    run_id = _start(engine, spec)
    rows = _tick(engine, spec, run_id)  # committed, never dispatched (as if we crashed)
    assert len(rows) == 1
    sent: list[OutboxRow] = []
    assert sweep.relay_stale_outbox(engine, sent.extend, older_than=0) == 1
    assert [r.payload["token"] for r in sent] == [rows[0].payload["token"]]
    assert sweep.relay_stale_outbox(engine, sent.extend, older_than=0) == 0

    def broken_send(_rows: list[OutboxRow]) -> None:
        raise ConnectionError("broker down")

    # A failed send keeps the rows for the next sweep.
    attempts.claim(engine, rows[0].payload["token"], "w")
    attempts.finish(engine, rows[0].payload["token"], outcome="succeeded", output=1)
    more = _tick(engine, spec, run_id)
    with pytest.raises(ConnectionError):
        sweep.relay_stale_outbox(engine, broken_send, older_than=0)
    assert sweep.relay_stale_outbox(engine, sent.extend, older_than=0) == len(more)
    delete_outbox(engine, [])


def test_pending_runs_and_unfolded_results_are_found_for_the_sweeper(engine: Any) -> None:
    spec = _spec()
    run_id = _start(engine, spec)
    assert sweep.pending_runs(engine, older_than=0) == [run_id]
    [row] = _tick(engine, spec, run_id)
    assert sweep.pending_runs(engine, older_than=0) == []
    token = row.payload["token"]
    attempts.claim(engine, token, "w")
    attempts.finish(engine, token, outcome="failed", error={"message": "x"})
    assert sweep.unfolded_runs(engine, older_than=0) == [run_id]


def test_terminal_run_folds_late_results_without_changing(engine: Any) -> None:
    spec = _spec()
    run_id = _start(engine, spec)
    [row] = _tick(engine, spec, run_id)
    token = row.payload["token"]
    attempts.claim(engine, token, "w")
    attempts.finish(engine, token, outcome="failed", error={"message": "no"}, retryable=False)
    _tick(engine, spec, run_id)
    found = runs.find_run(engine, run_id)
    assert found is not None and found.status == RunStatus.FAILED
    assert found.error is not None and found.error["node"] == "a"
    loaded, _, inputs = load_tick(engine, run_id, lambda _h: spec, CONFIG)  # type: ignore[misc]
    late = AttemptResult(token="r1:a:0", node="a", outcome="succeeded", output=1)
    payload = compute_tick(
        spec, loaded.state, inputs.__class__(run_id=run_id, results=(late,)), loaded.now
    )
    assert payload.state.status == RunStatus.FAILED


def test_the_timer_row_is_written_only_when_it_must_move_earlier_or_go(engine: Any) -> None:
    from datetime import timedelta

    from ductor_celery.store.load import load_on
    from ductor_celery.store.ticks import commit_on

    spec = _spec()
    run_id = _start(engine, spec)
    _tick(engine, spec, run_id)  # attempt a started: a check time, so a timer row

    def timer() -> Any:
        with engine.connect() as conn:
            return conn.execute(
                sa.text("SELECT fire_at FROM eec_workflow_timer WHERE run_id = :r"), {"r": run_id}
            ).scalar_one_or_none()

    first = timer()
    assert first is not None

    def commit_with(fire_at: Any) -> None:
        with engine.begin() as conn:
            found = load_on(conn, run_id, lambda _h, _c: spec, CONFIG)
            assert found is not None
            loaded, _, inputs = found
            assert loaded.timer_at == first or loaded.timer_at == timer()
            payload = compute_tick(spec, loaded.state, inputs, loaded.now)
            payload.changed = True
            payload.next_wake_at = fire_at
            commit_on(conn, loaded, payload)

    commit_with(first + timedelta(seconds=30))  # later: the earlier row stays, no write
    assert timer() == first
    commit_with(first - timedelta(seconds=1))  # earlier: moved
    assert timer() == first - timedelta(seconds=1)
    commit_with(None)  # nothing to wait for: deleted
    assert timer() is None
