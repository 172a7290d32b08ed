"""Held branches (runtime/inline.py, docs/architecture.md "Held branches"): after a quick step,
the eager tick gives its worker several branches of the same scatter, which it runs one after
another, writing each outcome alone, and ticks once for all of them.

Each test starts a scatter, ticks it on the coordinator's side (its first branch messages are
recorded, as if waiting in the broker), and plays one of those messages by hand, as the Celery
task does. ``HOLD_IF_QUICKER_S`` is raised or lowered so that which step counts as quick does
not depend on how busy the machine is.
"""

from __future__ import annotations

import pytest
from inline_support import (
    attempt_rows,
    deliver,
    make_ductor,
    quick_scatter,
    run_row,
    start_scatter,
    url,
)

from ductor_celery import Ductor
from ductor_celery.runtime import inline

__all__ = ["url"]  # the fixture: PostgreSQL and SQLite


def _branch_of(ductor: Ductor, run_id: str) -> dict[str, int]:
    return {a.token: a.branch for a in attempt_rows(ductor, run_id)}


def test_one_message_runs_a_quick_scatter_several_branches_per_tick(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inline, "HOLD_IF_QUICKER_S", 10.0)
    ductor, recorder = make_ductor(url)
    quick_scatter(ductor, max_parallel=8)
    run_id, first = start_scatter(ductor, recorder, 40)
    assert len(first) == 8

    assert deliver(ductor, first[0]) == "succeeded"

    run = run_row(ductor, run_id)
    assert run.status == "succeeded"
    assert run.output == [i + 1 for i in range(40)]
    assert recorder.steps() == []  # every later branch was held: not one more step message
    rows = attempt_rows(ductor, run_id)
    assert sorted(r.branch for r in rows) == list(range(40))  # one attempt per branch
    assert all(r.outcome == "succeeded" and r.folded for r in rows)
    # Each ran in the first message's process, claimed in a commit, held or adopted: each
    # records that message as its carrier (a terminate kills it to stop any of them).
    assert {r.carrier for r in rows} == {first[0].payload["token"]}
    # The other first messages were still "in the broker": the chain adopted their branches,
    # so each now finds its attempt claimed and is dropped.
    assert [deliver(ductor, row) for row in first[1:]] == ["duplicate"] * 7
    # One tick per branch without holding (40 and more); a handful with it.
    assert run.record_version < 20


def test_the_branches_held_behind_a_slow_step_go_back_as_messages(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inline, "HOLD_IF_QUICKER_S", 0.1)
    ductor, recorder = make_ductor(database_url)
    # Four in flight: item 0's tick claims item 4 and adopts 1-3; their tick starts 5-8,
    # claiming 5 and holding 6-8 new, with no messages; item 6 is slow.
    quick_scatter(ductor, max_parallel=4, slow=frozenset({6}))
    run_id, first = start_scatter(ductor, recorder, 12)

    assert deliver(ductor, first[0]) == "succeeded"

    branch = _branch_of(ductor, run_id)
    sent = [branch[r.payload["token"]] for r in recorder.rows if r.kind == "step"]
    assert {7, 8} <= set(sent)  # handed back when item 6 turned out slow
    rows = {r.branch: r for r in attempt_rows(ductor, run_id)}
    assert rows[6].outcome == "succeeded"
    # Whatever the chain did not run is finished by the messages, each branch exactly once.
    for row in [*first[1:], *recorder.rows]:
        if row.kind == "step":
            deliver(ductor, row)
    run = run_row(ductor, run_id)
    assert run.status == "succeeded", run.error
    assert run.output == [i + 1 for i in range(12)]
    assert sorted(r.branch for r in attempt_rows(ductor, run_id)) == list(range(12))


def test_a_process_stopping_while_it_holds_branches_hands_them_back(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``KeyboardInterrupt`` from a held step: its outcome is written and ticked with the ones
    written alone before it, and the new branches held behind it are sent as messages, not
    left for the unclaimed re-send half a minute later."""
    monkeypatch.setattr(inline, "HOLD_IF_QUICKER_S", 10.0)
    ductor, recorder = make_ductor(database_url)
    quick_scatter(ductor, max_parallel=4, interrupt=frozenset({6}))
    run_id, first = start_scatter(ductor, recorder, 12)

    with pytest.raises(KeyboardInterrupt):
        deliver(ductor, first[0])

    branch = _branch_of(ductor, run_id)
    sent = {branch[r.payload["token"]] for r in recorder.rows if r.kind == "step"}
    assert {7, 8} <= sent
    rows = {r.branch: r for r in attempt_rows(ductor, run_id)}
    assert all(rows[b].finished_at is not None and rows[b].folded for b in range(7))
    assert rows[7].claimed_at is None and rows[8].claimed_at is None


def test_no_branch_is_held_after_a_slow_step(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inline, "HOLD_IF_QUICKER_S", 0.0)  # every step counts as slow
    ductor, recorder = make_ductor(database_url)
    quick_scatter(ductor, max_parallel=4)
    run_id, first = start_scatter(ductor, recorder, 12)

    deliver(ductor, first[0])

    # One branch per tick, as before holding: the chain claims the next, the other first
    # messages still run their own branches.
    rows = attempt_rows(ductor, run_id)
    assert sum(r.finished_at is not None for r in rows) == len(rows) - 3
    assert [deliver(ductor, row) for row in first[1:]] == ["succeeded"] * 3
