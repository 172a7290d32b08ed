"""Eager ticks and several coordinators with real worker processes (issue 10).

The invariant each time: every run finishes, every step ran exactly once (the ledger), every
result was folded once.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from ductor_celery import RunStatus

pytestmark = pytest.mark.e2e
#: Run again over RabbitMQ by scripts/test (conftest.py, "broker_core").
broker_core = pytest.mark.broker_core


def _wait_for_file(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.parametrize(
    "inline",
    [pytest.param(False, marks=pytest.mark.broker_core), True],
    ids=["inline-off", "inline-on"],
)
def test_a_step_worker_killed_after_its_eager_commit_and_before_dispatch_loses_nothing(
    cluster_factory: Any, client_for: Any, tmp_path: Path, inline: bool
) -> None:
    fired = tmp_path / "eager-failpoint-fired"
    cluster = cluster_factory(
        E2E_EAGER="1", E2E_INLINE="50" if inline else "0", E2E_ECHO_TIMEOUT="3"
    )
    cluster.start_coordinator()
    cluster.start_steps(
        concurrency=1,
        DUCTOR_FAILPOINT="eager_after_commit_before_dispatch",
        DUCTOR_FAILPOINT_MARKER=str(fired),
    )
    ductor = client_for(cluster)
    handle = ductor.start("chain10", input={"value": 5})
    _wait_for_file(fired)
    view = ductor.wait(handle.run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED, cluster.logs()
    assert view.output == 5
    assert cluster.executions(handle.run_id) == 10  # no step ran twice
    attempts = cluster.attempts(handle.run_id)
    assert all(a.folded for a in attempts)
    if not inline:
        # The pool child died between its eager tick's commit and sending the next step: the
        # outbox row is what is left, and the sweeper relays it.
        assert [a.outcome for a in attempts] == ["succeeded"] * 10
        return
    # Inline: that commit claimed the next step for the dying child itself (no outbox row, no
    # message). Claimed and never run, it is retried after its 3 s timeout, as after any
    # worker lost mid-step; the attempt that never ran is the only extra row.
    assert sorted(a.outcome for a in attempts) == ["succeeded"] * 10 + ["timed_out"]
    [lost] = [a for a in attempts if a.outcome == "timed_out"]
    assert lost.claimed_at is not None


def test_eager_ticks_advance_a_chain_with_the_coordinator_gone(
    cluster_factory: Any, client_for: Any
) -> None:
    """With eager ticks the step workers tick the runs they advance, the first tick included:
    a 10-step chain finishes even with the coordinator SIGKILLed once its first attempt is
    claimed (test_with_eager_ticks_a_chain_needs_no_coordinator_process: none at all)."""
    cluster = cluster_factory(E2E_EAGER="1")
    coordinator = cluster.start_coordinator()
    ductor = client_for(cluster)
    cluster.start_steps(concurrency=1)
    handle = ductor.start("chain10", input={"value": 1})
    deadline = time.monotonic() + 30
    # The first attempt claimed: the start's tick committed it (claimed inline, or sent as a
    # message) before the coordinator goes.
    while not any(a.claimed_at for a in cluster.attempts(handle.run_id)):
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.05)
    coordinator.kill()
    view = ductor.wait(handle.run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED, cluster.logs()
    assert view.output == 1
    assert cluster.executions(handle.run_id) == 10


@pytest.mark.parametrize("inline", [False, True], ids=["inline-off", "inline-on"])
def test_with_eager_ticks_a_chain_needs_no_coordinator_process(
    cluster_factory: Any, client_for: Any, inline: bool
) -> None:
    """A run's first tick runs on the step worker its start message reaches
    (``ductor.first_tick`` on the steps queue), and every later tick on the worker that wrote
    an outcome: a chain of steps finishes with no coordinator process started at all."""
    cluster = cluster_factory(E2E_EAGER="1", E2E_INLINE="50" if inline else "0")
    cluster.start_steps(concurrency=1)
    ductor = client_for(cluster)
    handles = [ductor.start("chain10", input={"value": i}) for i in range(3)]
    for i, handle in enumerate(handles):
        view = ductor.wait(handle.run_id, timeout=60)
        assert view.status == RunStatus.SUCCEEDED, cluster.logs()
        assert view.output == i
        assert cluster.executions(handle.run_id) == 10
        assert all(a.folded for a in cluster.attempts(handle.run_id))


def test_two_coordinators_under_load_finish_every_run_exactly_once(
    cluster_factory: Any, client_for: Any
) -> None:
    """Every tick on the coordinator queue (eager off), two coordinator processes sharing it:
    the run lock keeps them off each other's runs, and nothing is applied twice."""
    cluster = cluster_factory(E2E_EAGER="0")
    cluster.start_coordinator(name="coord-a")
    cluster.start_coordinator(name="coord-b")
    cluster.start_steps(concurrency=2)
    ductor = client_for(cluster)
    handles = [ductor.start("chain10", input={"value": i}) for i in range(20)]
    for i, handle in enumerate(handles):
        view = ductor.wait(handle.run_id, timeout=120)
        assert view.status == RunStatus.SUCCEEDED, cluster.logs()
        assert view.output == i
        assert cluster.executions(handle.run_id) == 10
        attempts = cluster.attempts(handle.run_id)
        assert len(attempts) == 10 and all(a.folded for a in attempts)


def test_a_quick_scatter_runs_several_branches_per_tick_on_real_workers(
    cluster_factory: Any, client_for: Any
) -> None:
    """Held branches (runtime/inline.py): two step processes, 120 quick items, every branch
    exactly once, and far fewer ticks than branches."""
    cluster = cluster_factory(E2E_HOLD_QUICKER="1.0")
    handle = _each_branch_once(cluster, client_for(cluster), items=120, timeout=60)
    # Without holding every branch is folded by a tick of its own (120 and more commits).
    assert cluster.record_version(handle.run_id) < 90


@broker_core
def test_bundled_messages_carry_a_quick_scatter_past_each_chains_inline_steps(
    cluster_factory: Any, client_for: Any
) -> None:
    """Bundled messages (runtime/inline.py, ``InlineChain.bundle``): with
    ``ductor_inline_steps`` at 3 each chain soon runs out of steps, and its last tick sends
    the branches it starts bundled, one message carrying the others in its header. The
    unclaimed re-send is an hour away, so a carried branch no worker read from a header
    would hold the run: every branch runs exactly once, on real workers and brokers."""
    cluster = cluster_factory(E2E_HOLD_QUICKER="1.0", E2E_INLINE="3", E2E_RESEND_AFTER="3600")
    _each_branch_once(cluster, client_for(cluster), items=150, timeout=90)


def _each_branch_once(cluster: Any, ductor: Any, items: int, timeout: float) -> Any:
    """A coordinator and a step worker of two processes run ``quick_scatter`` over ``items``:
    every branch exactly once, each attempt folded; the run's handle."""
    cluster.start_coordinator()
    cluster.start_steps(concurrency=2)
    handle = ductor.start("quick_scatter", input={"items": list(range(items))})
    view = ductor.wait(handle.run_id, timeout=timeout)
    assert view.status == RunStatus.SUCCEEDED, cluster.logs()
    assert view.output == [i + 1 for i in range(items)]
    assert cluster.executions(handle.run_id) == items
    attempts = cluster.attempts(handle.run_id)
    assert len(attempts) == items
    assert all(a.folded and a.outcome == "succeeded" for a in attempts)
    return handle


@broker_core
def test_a_step_worker_killed_while_holding_branches_loses_none_and_runs_none_twice(
    cluster_factory: Any, client_for: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool child dies between two held branches, right after the statement that wrote
    one's outcome alone (not ticked) and claimed the next (store/held_claims.py), before
    running it: the outcomes wait unfolded (the sweeper wakes the run), the branch claimed
    and never run times out and is retried (``E2E_BUMP_TIMEOUT``), the new branches it held
    have no message and are re-sent once unclaimed for ``ductor_resend_unclaimed_after``,
    adopted ones still have theirs."""
    fired = tmp_path / "held-failpoint-fired"
    # The step's timeout is in the definition the client stores: its process reads it too.
    monkeypatch.setenv("E2E_BUMP_TIMEOUT", "3")
    cluster = cluster_factory(E2E_HOLD_QUICKER="1.0", E2E_RESEND_AFTER="2", E2E_BUMP_TIMEOUT="3")
    cluster.start_coordinator()
    cluster.start_steps(
        concurrency=1,
        DUCTOR_FAILPOINT="between_held_branches",
        DUCTOR_FAILPOINT_MARKER=str(fired),
    )
    ductor = client_for(cluster)
    handle = ductor.start("quick_scatter", input={"items": list(range(60))})
    _wait_for_file(fired)
    view = ductor.wait(handle.run_id, timeout=90)
    assert view.status == RunStatus.SUCCEEDED, cluster.logs()
    assert view.output == [i + 1 for i in range(60)]
    assert cluster.executions(handle.run_id) == 60  # none lost, none twice
    attempts = cluster.attempts(handle.run_id)
    assert all(a.folded for a in attempts)
    # It died between steps, never inside one: each branch succeeded once, and at most the
    # one claimed and never run timed out.
    outcomes = sorted(a.outcome for a in attempts)
    assert outcomes.count("succeeded") == 60
    assert outcomes[60:] in ([], ["timed_out"])
