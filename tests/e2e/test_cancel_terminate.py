"""Issue 14 items 2 and 5 with real workers (prefork pool, Redis): a cancel reaches a long
step through its heartbeat and it stops on its own, well inside the grace; terminate kills a
step that never looks (revoke with terminate=True); a run deadline does the same."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from ductor_celery import NodeStatus, RunStatus

pytestmark = pytest.mark.e2e


@pytest.fixture
def ductor(shared_cluster: Any, client_for: Any) -> Any:
    return client_for(shared_cluster)


def _until(check: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout}s")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _attempt(cluster: Any, token: str) -> Any:
    with cluster.engine.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT outcome, error, claimed_at, cancel_requested_at "
                "FROM eec_workflow_step_attempt WHERE token = :t"
            ),
            {"t": token},
        ).one_or_none()


def test_cancel_asks_a_long_step_to_stop_and_it_stops_through_its_heartbeat(
    ductor: Any, shared_cluster: Any
) -> None:
    handle = ductor.start("cancellable", input={"seconds": 60})
    token = f"{handle.run_id}:work:1"
    _until(lambda: (row := _attempt(shared_cluster, token)) and row.claimed_at, what="claim")
    asked = time.monotonic()
    ductor.cancel(handle.run_id, reason="not needed any more")
    view = ductor.wait(handle.run_id, timeout=30)
    # It stopped on its own (ductor_cancel_grace is 30 s): the heartbeat raised StepCancelled.
    assert time.monotonic() - asked < 20
    assert view.status == RunStatus.CANCELLED
    assert view.nodes["work"].status == NodeStatus.CANCELLED
    assert view.nodes["work"].attempts == 1
    assert view.nodes["after"].status == NodeStatus.PENDING
    row = _attempt(shared_cluster, token)
    assert row.cancel_requested_at is not None
    assert row.outcome == "cancelled" and row.error["type"] == "StepCancelled"
    assert shared_cluster.executions(handle.run_id) == 1  # never retried


def test_terminate_kills_a_long_step_that_never_looks(
    ductor: Any, shared_cluster: Any, tmp_path: Path
) -> None:
    marker = tmp_path / "stubborn.pid"
    handle = ductor.start("killable", input={"seconds": 60, "marker": str(marker)})
    pid = int(_until(lambda: marker.exists() and marker.read_text(), what="step start"))
    assert _alive(pid)
    ductor.terminate(handle.run_id, reason="stop now")
    view = ductor.wait(handle.run_id, timeout=30)
    assert view.status == RunStatus.TERMINATED
    assert view.nodes["work"].status == NodeStatus.CANCELLED
    # revoke(terminate=True): the pool process running it is killed (and replaced).
    _until(lambda: not _alive(pid), timeout=20, what="kill of the step's process")
    assert not Path(f"{marker}.done").exists()
    row = _attempt(shared_cluster, f"{handle.run_id}:work:1")
    assert row.outcome == "cancelled" and row.error["type"] == "Cancelled"


def test_a_run_deadline_times_the_run_out_and_kills_its_step(
    ductor: Any, shared_cluster: Any, tmp_path: Path
) -> None:
    marker = tmp_path / "deadline.pid"
    handle = ductor.start("killable", input={"seconds": 60, "marker": str(marker)}, deadline=3)
    pid = int(_until(lambda: marker.exists() and marker.read_text(), what="step start"))
    view = ductor.wait(handle.run_id, timeout=30)
    assert view.status == RunStatus.TIMED_OUT
    assert view.deadline_at is not None and view.finished_at is not None
    assert view.finished_at >= view.deadline_at
    assert view.error["type"] == "RunTimeout"
    _until(lambda: not _alive(pid), timeout=20, what="kill of the step's process")
    assert not Path(f"{marker}.done").exists()


# --- terminate reaches every running step, whatever path started it (issue 23) -------------
# A scribbling step appends a line to a file every 100 ms. After terminate() returns (or the
# run times out) the file may still grow by what was in flight; within 5 s it must go quiet
# (1.5 s without a line, fifteen missed beats) and the step must never have ended.

QUIET_S = 1.5


def _lines(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _scribbling(path: Path, lines: int = 3) -> None:
    _until(lambda: len(_lines(path).splitlines()) >= lines, what=f"{path.name} scribbling")


def _stopped_by(path: Path, since: float) -> None:
    """The file stops growing within 5 s of ``since`` and stays quiet; nor did the step end."""
    seen, quiet_from = _lines(path), time.monotonic()
    while time.monotonic() - quiet_from < QUIET_S:
        time.sleep(0.1)
        now = _lines(path)
        if now != seen:
            seen, quiet_from = now, time.monotonic()
        assert quiet_from <= since + 5, (
            f"still scribbling 5 s after the run was closed: {len(seen.splitlines())} lines"
        )
    assert not Path(f"{path}.done").exists()


def _rows(cluster: Any, run_id: str) -> dict[tuple[str, int | None], Any]:
    with cluster.engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT token, node, branch, carrier, created_at, claimed_at, outcome "
                "FROM eec_workflow_step_attempt WHERE run_id = :r"
            ),
            {"r": run_id},
        )
        return {(r.node, r.branch): r for r in rows}


def _scribble_input(path: Path, **more: Any) -> dict[str, Any]:
    return {"path": str(path), "seconds": 60, "beat": False, **more}


def test_terminate_kills_the_first_ticks_step(
    ductor: Any, shared_cluster: Any, tmp_path: Path
) -> None:
    """Path (c): the run's first tick claims its first step, which runs inside the start
    message (``<run id>:first_tick``)."""
    path = tmp_path / "first_tick.txt"
    handle = ductor.start("scribble_one", input=_scribble_input(path))
    _scribbling(path)
    ductor.terminate(handle.run_id, reason="stop now")
    returned = time.monotonic()
    assert ductor.get(handle.run_id).status == RunStatus.TERMINATED
    _stopped_by(path, returned)
    work = _rows(shared_cluster, handle.run_id)[("work", None)]
    assert work.carrier == f"{handle.run_id}:first_tick"
    assert work.outcome == "cancelled"


def test_terminate_kills_a_step_run_inline_after_another_steps_message(
    ductor: Any, shared_cluster: Any, tmp_path: Path
) -> None:
    """Path (a): a delayed run's first tick is the coordinator's, so "first" goes as a message;
    the worker that runs it claims "work" in its eager tick's commit and runs it inline, with
    no message of its own: only killing "first"'s message stops it."""
    path = tmp_path / "inline.txt"
    handle = ductor.start("scribble_after", input=_scribble_input(path), delay=0.5)
    _scribbling(path)
    ductor.terminate(handle.run_id, reason="stop now")
    returned = time.monotonic()
    assert ductor.get(handle.run_id).status == RunStatus.TERMINATED
    _stopped_by(path, returned)
    rows = _rows(shared_cluster, handle.run_id)
    first, work = rows[("first", None)], rows[("work", None)]
    assert first.carrier == first.token  # its own message
    assert work.carrier == first.token  # inline, in first's message
    assert work.claimed_at == work.created_at  # claimed in the commit that created it
    assert work.outcome == "cancelled"


def test_terminate_kills_a_held_scatter_branch(
    cluster_factory: Any, client_for: Any, tmp_path: Path
) -> None:
    """Path (b): after "first" (a message, quick), its tick claims branch 0 and holds 1-3 for
    the same worker, which claims each when it gets to it; branch 1 scribbles."""
    cluster = cluster_factory(E2E_HOLD_QUICKER="1.0")  # every step counts as quick
    cluster.start_coordinator()
    cluster.start_steps(concurrency=2)
    ductor = client_for(cluster)
    path = tmp_path / "held.txt"
    handle = ductor.start(
        "scribble_scatter",
        input=_scribble_input(path, items=[0, 1, 2, 3], slow=1),
        delay=0.5,
    )
    _scribbling(path)
    ductor.terminate(handle.run_id, reason="stop now")
    returned = time.monotonic()
    assert ductor.get(handle.run_id).status == RunStatus.TERMINATED
    _stopped_by(path, returned)
    rows = _rows(cluster, handle.run_id)
    first, held = rows[("first", None)], rows[("each", 1)]
    assert held.carrier == first.token  # run in first's message, after branch 0
    assert held.claimed_at > held.created_at  # held: claimed when the worker got to it
    assert held.outcome == "cancelled"
    assert rows[("each", 0)].carrier == first.token


def test_a_run_deadline_kills_a_step_run_inline_after_another_steps_message(
    ductor: Any, shared_cluster: Any, tmp_path: Path
) -> None:
    path = tmp_path / "deadline_inline.txt"
    handle = ductor.start("scribble_after", input=_scribble_input(path), delay=0.5, deadline=3)
    _scribbling(path)
    view = ductor.wait(handle.run_id, timeout=30)
    closed = time.monotonic()
    assert view.status == RunStatus.TIMED_OUT
    _stopped_by(path, closed)
    rows = _rows(shared_cluster, handle.run_id)
    assert rows[("work", None)].carrier == rows[("first", None)].token


def test_on_real_workers_a_carrier_only_ever_runs_attempts_of_one_run(
    ductor: Any, shared_cluster: Any
) -> None:
    """What makes killing a carrier on a terminate safe: every message's process runs
    attempts of one run only (runtime/inline.py, ``InlineChain.choose``), with runs started
    at once, some delayed (first step as a message), some scattering."""
    handles = [ductor.start("chain10", input={"value": i}) for i in range(6)]
    handles += [ductor.start("chain10", input={"value": i}, delay=0.2) for i in range(4)]
    handles += [ductor.start("quick_scatter", input={"items": list(range(30))}) for _ in range(2)]
    for handle in handles:
        assert ductor.wait(handle.run_id, timeout=60).status == RunStatus.SUCCEEDED
    with shared_cluster.engine.connect() as conn:
        rows = list(
            conn.execute(
                sa.text(
                    "SELECT carrier, count(DISTINCT run_id) AS runs, count(*) AS attempts "
                    "FROM eec_workflow_step_attempt WHERE run_id = ANY(:ids) GROUP BY carrier"
                ),
                {"ids": [h.run_id for h in handles]},
            )
        )
    assert sum(r.attempts for r in rows) == 6 * 10 + 4 * 10 + 2 * 30
    assert all(r.carrier is not None for r in rows), "every claim records its carrier"
    assert all(r.runs == 1 for r in rows), [r for r in rows if r.runs != 1]
    assert any(r.attempts > 1 for r in rows), "some message carried an inline chain"
