"""Issue 15, item 6: step workers under ``-P threads``, ``-P solo`` and ``-P gevent`` behave as
under prefork: workflows finish, heartbeats and start-to-close timeouts are enforced, and a
SIGKILL mid-step is recovered, with real ``celery worker`` processes.

Nothing in ductor depends on the pool: timeouts are rows the tick checks (never signals or
Celery time limits), engines are per process and thread-safe, the per-thread state (the
inline-step event dispatcher) is keyed by process and thread. A solo worker runs one step at
a time, so a hung attempt's retry waits for the hang to end; it still lands, and the late
result of the hung one is refused. Under gevent, psycopg 3 (3.1.14 on) waits on the database
cooperatively by itself, and the steps' ``time.sleep`` is patched.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from ductor_celery import RunStatus

pytestmark = pytest.mark.e2e


@pytest.fixture(params=["threads", "solo", "gevent"])
def pool(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _concurrency(pool: str) -> int:
    # A green pool's consumer (Celery's synloop) fetches the next messages on a 2 s poll,
    # one per free slot: more greenlets, as gevent users run them, keep the tests short.
    return {"solo": 1, "threads": 2, "gevent": 8}[pool]


def test_workflows_finish_under_the_pool(cluster_factory: Any, client_for: Any, pool: str) -> None:
    cluster = cluster_factory()
    cluster.start_coordinator()
    steps = cluster.start_steps(concurrency=_concurrency(pool), pool=pool)
    banner = {"threads": "(thread)", "solo": "(solo)", "gevent": "(gevent)"}[pool]
    assert banner in steps.log_path.read_text(), steps.log_tail()  # the pool really in use
    ductor = client_for(cluster)
    diamond = ductor.start("diamond", input={"x": 4, "extra": True})
    scatter = ductor.start("scatter", input={"items": list(range(20)), "refuse": []})
    view = ductor.wait(diamond.run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED, cluster.logs()
    assert view.output == {"join": {"left": 10, "right": 15}, "start": 5}
    view = ductor.wait(scatter.run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED, cluster.logs()
    assert view.output == {
        "squares": [i * i for i in range(20)],
        "total": sum(i * i for i in range(20)),
    }
    assert cluster.executions(scatter.run_id) == 21


def test_a_step_past_its_timeout_is_retried_under_the_pool(
    cluster_factory: Any, client_for: Any, pool: str
) -> None:
    cluster = cluster_factory(E2E_SLOW_TIMEOUT="2")
    cluster.start_coordinator()
    cluster.start_steps(concurrency=_concurrency(pool), pool=pool)
    ductor = client_for(cluster)
    handle = ductor.start("slow", input={"seconds": 5})
    view = ductor.wait(handle.run_id, timeout=40)
    assert view.status == RunStatus.SUCCEEDED, cluster.logs()
    assert view.output == "slept on attempt 2"
    assert [a.outcome for a in cluster.attempts(handle.run_id)] == ["timed_out", "succeeded"]


def test_heartbeats_are_enforced_under_the_pool(
    cluster_factory: Any, client_for: Any, pool: str
) -> None:
    cluster = cluster_factory()
    cluster.start_coordinator()
    cluster.start_steps(concurrency=_concurrency(pool), pool=pool)
    ductor = client_for(cluster)
    handle = ductor.start("heartbeats", input={"hang": 4})
    view = ductor.wait(handle.run_id, timeout=40)
    assert view.status == RunStatus.SUCCEEDED, cluster.logs()
    assert view.output == "done on attempt 2"
    first, second = cluster.attempts(handle.run_id)
    assert first.outcome == "timed_out" and second.outcome == "succeeded"
    time.sleep(4.5)  # the hung attempt wakes up and reports: refused as late
    assert ductor.get(handle.run_id).output == "done on attempt 2"


def test_a_sigkill_mid_step_is_recovered_under_the_pool(
    cluster_factory: Any, client_for: Any, tmp_path: Path, pool: str
) -> None:
    marker = tmp_path / "slow-started"
    cluster = cluster_factory(E2E_SLOW_MARKER=str(marker), E2E_SLOW_TIMEOUT="3")
    cluster.start_coordinator()
    steps = cluster.start_steps(concurrency=_concurrency(pool), pool=pool)
    ductor = client_for(cluster)
    handle = ductor.start("slow", input={"seconds": 60})
    deadline = time.monotonic() + 30
    while not (marker.exists() and marker.read_text()):
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.05)
    steps.kill()  # SIGKILL the worker process (with -P threads/solo the step runs inside it)
    cluster.start_steps(concurrency=_concurrency(pool), name="steps-again", pool=pool)
    view = ductor.wait(handle.run_id, timeout=25)
    assert view.status == RunStatus.SUCCEEDED, cluster.logs()
    assert view.output == "slept on attempt 2"
    assert [a.outcome for a in cluster.attempts(handle.run_id)] == ["timed_out", "succeeded"]
    assert cluster.executions(handle.run_id) == 2


def _lines(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _until(check: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {timeout}s"
        time.sleep(0.05)


def _outcome(cluster: Any, run_id: str, node: str) -> tuple[str, str]:
    [row] = [a for a in cluster.attempts(run_id) if a.node == node]
    return row.outcome, row.token


def test_terminate_is_cooperative_under_the_pool(
    cluster_factory: Any, client_for: Any, tmp_path: Path, pool: str
) -> None:
    """Issue 23: only prefork kills a running step at once (threads and solo have nothing to
    kill it with; gevent kills the greenlet at its next switch). A terminate closes the run's
    attempts at once, and a step run inline after another step's message (a delayed run's
    second step) stops at its next heartbeat (``StepCancelled``); its outcome is refused."""
    cluster = cluster_factory()
    cluster.start_coordinator()
    cluster.start_steps(concurrency=_concurrency(pool), pool=pool)
    ductor = client_for(cluster)
    beating = tmp_path / "beating.txt"
    handle = ductor.start(
        "scribble_after", input={"path": str(beating), "seconds": 60, "beat": True}, delay=0.5
    )
    _until(lambda: len(_lines(beating).splitlines()) >= 3, "scribbling")
    ductor.terminate(handle.run_id, reason="stop now")
    returned = time.monotonic()
    assert ductor.get(handle.run_id).status == RunStatus.TERMINATED
    time.sleep(max(0.0, returned + 2 - time.monotonic()))
    at_2 = _lines(beating)
    time.sleep(max(0.0, returned + 4 - time.monotonic()))
    assert _lines(beating) == at_2, "the step did not stop at its next heartbeat"
    assert not Path(f"{beating}.done").exists()
    assert _outcome(cluster, handle.run_id, "work")[0] == "cancelled"  # closed by the terminate

    # A step that never heartbeats: under threads and solo it runs to its end (here 3 s);
    # under gevent the revoke of its message kills the greenlet at its next switch (a sleep).
    deaf = tmp_path / "deaf.txt"
    handle = ductor.start(
        "scribble_after", input={"path": str(deaf), "seconds": 3, "beat": False}, delay=0.5
    )
    _until(lambda: len(_lines(deaf).splitlines()) >= 3, "scribbling")
    ductor.terminate(handle.run_id, reason="stop now")
    returned = time.monotonic()
    if pool == "gevent":
        time.sleep(max(0.0, returned + 2 - time.monotonic()))
        at_2 = _lines(deaf)
        time.sleep(max(0.0, returned + 4 - time.monotonic()))
        assert _lines(deaf) == at_2 and not Path(f"{deaf}.done").exists()
    else:
        _until(lambda: Path(f"{deaf}.done").exists(), "end of the step", timeout=10)
        assert len(_lines(deaf).splitlines()) >= 25  # every line of its 3 s
    time.sleep(0.5)  # its outcome, refused: the attempt stays as the terminate closed it
    assert ductor.get(handle.run_id).status == RunStatus.TERMINATED
    assert _outcome(cluster, handle.run_id, "work")[0] == "cancelled"
