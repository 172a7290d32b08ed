"""Bundled step messages (runtime/inline.py ``InlineChain.bundle``, runtime/dispatch.py
``HELD_HEADER``; docs/architecture.md "Bundled messages"): after a quick step, the step
messages an eager tick sends for more branches of the same scatter go out up to ``HOLD_MAX``
to a message, the first branch's message carrying the others' tokens; the worker taking it
runs them after its own as held branches.

As in test_held_branches.py, a scatter is started and ticked on the coordinator's side, and
its messages are played by hand (``deliver`` reads a bundle's header back as the task does).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from celery.app.task import Context
from inline_support import (
    QUEUE,
    RecordingDispatcher,
    attempt_rows,
    deliver,
    make_ductor,
    quick_scatter,
    run_row,
    start_scatter,
)

from ductor_celery import Ductor, RateLimit
from ductor_celery.definition import Workflow
from ductor_celery.engine.kinds import DispatchKind
from ductor_celery.runtime import inline
from ductor_celery.runtime.dispatch import (
    HELD_HEADER,
    MAX_CARRIED,
    QUICK_HEADER,
    CarriedBranches,
    Dispatcher,
    QuickBranches,
    carried_branches,
    quick_branches,
)
from ductor_celery.runtime.runtime import _carried
from ductor_celery.runtime.steps import first_tick
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store import attempts
from ductor_celery.store.outbox import OutboxRow


def _bundles(recorder: RecordingDispatcher) -> list[OutboxRow]:
    return [r for r in recorder.rows if r.kind == "step" and "held" in r.payload]


def _play_everything(ductor: Ductor, recorder: RecordingDispatcher, rows: list[OutboxRow]) -> int:
    """Deliver every step message there is, and those they lead to, until none is left; how
    many were delivered."""
    delivered = 0
    pending = list(rows)
    while pending or recorder.rows:
        pending += [r for r in recorder.rows if r.kind == "step"]
        recorder.rows.clear()
        if pending:
            deliver(ductor, pending.pop(0))
            delivered += 1
    return delivered


def _chain_out_of_steps(
    database_url: str, monkeypatch: pytest.MonkeyPatch, items: int = 60
) -> tuple[Ductor, RecordingDispatcher, str, list[OutboxRow]]:
    """A quick scatter whose first message's chain runs out of inline steps (3) after its
    first tick: that tick's new branches beyond what it holds go out bundled."""
    monkeypatch.setattr(inline, "HOLD_IF_QUICKER_S", 10.0)
    ductor, recorder = make_ductor(database_url, inline_steps=3)
    quick_scatter(ductor, max_parallel=40)
    run_id, first = start_scatter(ductor, recorder, items)
    assert deliver(ductor, first[0]) == "succeeded"
    return ductor, recorder, run_id, first


def _one_bundle(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[Ductor, RecordingDispatcher, str, OutboxRow]:
    """``_chain_out_of_steps``'s first bundle, not delivered yet, and nothing else recorded."""
    ductor, recorder, run_id, _ = _chain_out_of_steps(database_url, monkeypatch)
    [bundle, *_] = _bundles(recorder)
    recorder.rows.clear()
    return ductor, recorder, run_id, bundle


def test_a_chain_out_of_inline_steps_sends_its_branches_bundled(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ductor, recorder, run_id, first = _chain_out_of_steps(database_url, monkeypatch)

    steps = [r for r in recorder.rows if r.kind == "step"]
    bundles = _bundles(recorder)
    assert bundles, steps
    branch = {a.token: a.branch for a in attempt_rows(ductor, run_id)}
    carried = [t for b in bundles for t in b.payload["held"]]
    # Each carried branch is a new attempt of the same node, unclaimed, in no other message.
    assert all(len(b.payload["held"]) < inline.HOLD_MAX for b in bundles)
    assert {b.payload["node"] for b in bundles} == {"each"}
    assert len(set(carried)) == len(carried)
    assert not set(carried) & {r.payload["token"] for r in steps}
    rows = {a.token: a for a in attempt_rows(ductor, run_id)}
    assert all(rows[t].claimed_at is None for t in carried)
    # Every branch still has its outbox row until the bundle is sent and forgotten.
    assert sorted(branch[t] for t in carried) == sorted(set(branch[t] for t in carried))

    # Played out: every branch exactly once, in fewer messages than branches.
    delivered = _play_everything(ductor, recorder, first[1:])
    run = run_row(ductor, run_id)
    assert run.status == "succeeded", run.error
    assert run.output == [i + 1 for i in range(60)]
    attempts_ = attempt_rows(ductor, run_id)
    assert sorted(a.branch for a in attempts_) == list(range(60))
    assert all(a.outcome == "succeeded" and a.folded for a in attempts_)
    assert delivered + 1 < 60


def test_a_bundle_carrying_one_branch_runs_both(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its own attempt's outcome is written with the claim of the one it carries, which is
    then the last held branch: it runs, and its tick folds both."""
    ductor, recorder, run_id, bundle = _one_bundle(database_url, monkeypatch)
    carried = bundle.payload["held"][0]
    one = dataclasses.replace(bundle, payload={**bundle.payload, "held": [carried]})

    assert deliver(ductor, one) == "succeeded"

    rows = {a.token: a for a in attempt_rows(ductor, run_id)}
    for token in (bundle.payload["token"], carried):
        assert rows[token].outcome == "succeeded" and rows[token].folded, token
        assert rows[token].carrier == bundle.payload["token"]


def test_a_bundle_whose_own_branch_was_taken_still_runs_the_ones_it_carries(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ductor, recorder, run_id, bundle = _one_bundle(database_url, monkeypatch)
    engine = ductor.runtime.engine()
    # Another worker's chain adopted the bundle's own branch and claimed it.
    assert attempts.claim(engine, bundle.payload["token"], "another-worker:1:a") is not None

    assert deliver(ductor, bundle) == "duplicate"

    rows = {a.token: a for a in attempt_rows(ductor, run_id)}
    held = bundle.payload["held"]
    assert all(rows[t].outcome == "succeeded" and rows[t].folded for t in held)
    # Run in the bundle's message: each records it as its carrier.
    assert {rows[t].carrier for t in held} == {bundle.payload["token"]}
    assert rows[bundle.payload["token"]].finished_at is None  # the other worker's to finish


def test_a_bundle_whose_carried_branches_were_all_taken_still_ticks_its_own_outcome(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its own outcome is written with a claim that finds nothing left to claim: the tick
    after it must still come (not left to another worker's tick, or the sweeper's scan)."""
    ductor, recorder, run_id, bundle = _one_bundle(database_url, monkeypatch)
    engine = ductor.runtime.engine()
    for i, token in enumerate(bundle.payload["held"]):
        assert attempts.claim(engine, token, f"another-worker:1:{i}") is not None

    assert deliver(ductor, bundle) == "succeeded"

    own = {a.token: a for a in attempt_rows(ductor, run_id)}[bundle.payload["token"]]
    assert own.outcome == "succeeded" and own.folded


def test_a_process_stopping_in_a_bundles_own_step_hands_what_it_carries_back(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ductor, recorder, run_id, bundle = _one_bundle(database_url, monkeypatch)
    step = ductor.runtime.step_named("held.bump")
    assert step is not None

    def stopping(ctx: Any, item: int) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(step, "fn", stopping)
    with pytest.raises(KeyboardInterrupt):
        deliver(ductor, bundle)

    sent = [r.payload["token"] for r in recorder.rows if r.kind == "step"]
    assert sorted(sent) == sorted(bundle.payload["held"])  # at once, not 30 s later
    rows = {a.token: a for a in attempt_rows(ductor, run_id)}
    assert all(rows[t].claimed_at is None for t in bundle.payload["held"])


def test_a_slow_bundle_hands_what_it_carries_back_as_messages_of_their_own(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ductor, recorder, run_id, bundle = _one_bundle(database_url, monkeypatch)
    monkeypatch.setattr(inline, "HOLD_IF_QUICKER_S", 0.0)  # its own step now counts as slow

    assert deliver(ductor, bundle) == "succeeded"

    # Other workers may run them at once.
    _handed_back_one_by_one(ductor, recorder, run_id, bundle)


def test_a_worker_without_inline_steps_hands_a_bundle_back(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ductor, recorder, run_id, bundle = _one_bundle(database_url, monkeypatch)

    # No queue: the worker runs no inline chain (a message run by hand, or inline steps off).
    assert deliver(ductor, bundle, queue=None) == "succeeded"

    _handed_back_one_by_one(ductor, recorder, run_id, bundle)


def _handed_back_one_by_one(
    ductor: Ductor, recorder: RecordingDispatcher, run_id: str, bundle: OutboxRow
) -> None:
    """Each branch the bundle carried went back unclaimed, in a message of its own, beside
    the message of the branch its own step's tick started."""
    sent = [r.payload["token"] for r in recorder.rows if r.kind == "step"]
    assert all(sent.count(t) == 1 for t in bundle.payload["held"])
    assert len(sent) == len(bundle.payload["held"]) + 1
    assert not _bundles(recorder)
    assert all(r.run_id == run_id for r in recorder.rows if r.kind == "step")
    rows = {a.token: a for a in attempt_rows(ductor, run_id)}
    assert all(rows[t].claimed_at is None for t in bundle.payload["held"])


def _private_queues() -> tuple[str, str]:
    """A steps and a coordinator queue no other test of this process publishes to."""
    suffix = uuid.uuid4().hex[:8]
    return f"bundles-steps-{suffix}", f"bundles-coord-{suffix}"


def _row(token: str, node: str = "each", **kw: Any) -> OutboxRow:
    payload = {"token": token, "run_id": "run-1", "node": node, **kw.pop("payload", {})}
    return OutboxRow(
        id=kw.pop("id", 1),
        run_id=kw.pop("run_id", "run-1"),
        kind=kw.pop("kind", DispatchKind.STEP),
        task=kw.pop("task", "held.bump"),
        queue=kw.pop("queue", None),
        payload=payload,
    )


def _quick_chain(database_url: str) -> inline.InlineChain:
    ductor, _ = make_ductor(database_url)
    quick_scatter(ductor, max_parallel=4)
    chain = inline.InlineChain.start(ductor.runtime, "ductor-steps", lambda: "w:1:x", "c", "run-1")
    assert chain is not None
    chain.ran(0.001, "held.bump", "each")
    return chain


def test_bundles_take_only_the_node_just_run_quickly_and_keep_the_rows_order(
    database_url: str,
) -> None:
    chain = _quick_chain(database_url)
    rows = [
        _row("r", kind=DispatchKind.REVOKE),
        *[_row(f"t{i}") for i in range(20)],
        _row("o", node="other"),  # another node
        _row("q", queue="elsewhere"),  # another queue
        _row("u", run_id="run-2"),  # another run
        _row("p1", payload={"priority": 5}),
        _row("p2", payload={"priority": 5}),
    ]

    out = chain.bundle(rows)

    assert [r.payload["token"] for r in out] == ["r", "t0", "t16", "o", "q", "u", "p1"]
    assert out[1].payload["held"] == [f"t{i}" for i in range(1, 16)]
    assert out[2].payload["held"] == [f"t{i}" for i in range(17, 20)]
    assert out[6].payload["held"] == ["p2"]  # bundled with its own priority only
    assert all("held" not in r.payload for r in out if r.payload["token"] in "roqu")
    assert all("held" not in r.payload for r in rows)  # the rows themselves are not changed


def test_nothing_is_bundled_after_a_slow_step(database_url: str) -> None:
    chain = _quick_chain(database_url)
    chain.ran(1.0, "held.bump", "each")
    rows = [_row(f"t{i}") for i in range(5)]
    assert chain.bundle(rows) == rows


def test_a_carried_header_is_read_back_as_it_was_sent_through_a_celery_message() -> None:
    app = Celery("bundles", broker="memory://")
    # kombu's memory transport is one per process: queues of their own, not another test's.
    steps, coord = _private_queues()
    dispatcher = Dispatcher(app, steps, coord)
    row = _row("run-1:each:0", payload={"held": ["run-1:each:1", "run-1:each:2"], "priority": 3})
    dispatcher.send([row, _row("t3")])
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue(steps)
        bundled, plain = queue.get(timeout=1), queue.get(timeout=1)
        queue.close()
    # What the worker's task sees: a context made from the message's headers.
    request = Context(bundled.headers)
    assert _carried(request, "t0") == CarriedBranches(
        "run-1", "each", ("run-1:each:1", "run-1:each:2"), 3
    )
    assert HELD_HEADER not in plain.headers
    assert _carried(Context(plain.headers), "t3") is None


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("t1", "is a str, not an object"),
        ({"node": "n", "tokens": ["t"]}, "names no run id and node"),
        ({"run_id": "r", "node": "n", "tokens": []}, "holds no list of 1 to"),
        ({"run_id": "r", "node": "n", "tokens": ["t"] * (MAX_CARRIED + 1)}, "holds no list"),
        ({"run_id": "r", "node": "n", "tokens": [1]}, "holds a token that is not a string"),
        ({"run_id": "r", "node": "n", "tokens": ["t"], "priority": 10}, "has a priority outside"),
        ({"run_id": "r", "node": "n", "tokens": ["t"], "priority": True}, "has a priority outside"),
    ],
)
def test_a_malformed_carried_header_names_its_problem(value: Any, problem: str) -> None:
    found = carried_branches(value)
    assert isinstance(found, str) and found.startswith(problem), found


def test_a_forged_header_is_one_warning_and_the_message_still_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    forged = {HELD_HEADER: {"run_id": "r", "node": "n", "tokens": ["r:n:1", "a\x00b"]}}
    assert _carried(Context(forged), "t0") is None
    assert "holds an id that holds a NUL" in caplog.text
    assert _carried(Context({HELD_HEADER: ["x"]}), "t0") is None
    assert "is a list, not an object" in caplog.text
    other = {HELD_HEADER: {"run_id": "r1", "node": "n", "tokens": ["r1:n:2", "r2:n:3"]}}
    assert _carried(Context(other), "t0") is None
    assert "holds a token of another run" in caplog.text


def _quick_branches_woken_busy(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[Ductor, RecordingDispatcher, str]:
    """Four quick branches run while another tick holds the run: each eager tick finds it
    busy, so each outcome is written alone and the coordinator is woken (once: coalesced)."""
    monkeypatch.setattr(inline, "HOLD_IF_QUICKER_S", 10.0)
    ductor, recorder = make_ductor(database_url)
    quick_scatter(ductor, max_parallel=4)
    run_id, first = start_scatter(ductor, recorder, 12)
    with ductor.runtime.engine().connect() as conn:
        conn.execute(
            sa.text("SELECT 1 FROM eec_workflow_run WHERE run_id = :r FOR UPDATE"), {"r": run_id}
        )
        assert [deliver(ductor, row) for row in first] == ["succeeded"] * 4
        conn.rollback()
    return ductor, recorder, run_id


def test_a_busy_tick_after_a_quick_branch_wakes_the_coordinator_with_its_node(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ductor, recorder, run_id = _quick_branches_woken_busy(database_url, monkeypatch)
    assert recorder.wakes == [run_id]
    assert recorder.quick_wakes == [(run_id, QuickBranches("held.bump", "each", "ductor-steps"))]
    assert recorder.rows == []

    # The coordinator's tick, woken with that hint: its four new branches in one message.
    assert run_tick(ductor.runtime, run_id, quick=recorder.quick_wakes[0][1]) == "committed"
    [bundle] = [r for r in recorder.rows if r.kind == "step"]
    assert len(bundle.payload["held"]) == 3
    assert _play_everything(ductor, recorder, []) <= 3
    run = run_row(ductor, run_id)
    assert run.status == "succeeded", run.error
    assert sorted(a.branch for a in attempt_rows(ductor, run_id)) == list(range(12))


def test_a_wake_up_without_a_usable_hint_sends_every_branch_its_own_message(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ductor, recorder, run_id = _quick_branches_woken_busy(database_url, monkeypatch)
    # A step this process does not know: nothing is bundled (nor without a hint at all).
    unknown = QuickBranches("no.such.step", "each", "ductor-steps")
    assert run_tick(ductor.runtime, run_id, quick=unknown) == "committed"
    assert len([r for r in recorder.rows if r.kind == "step"]) == 4
    assert not _bundles(recorder)


def test_the_quick_hint_travels_in_the_wake_ups_header_to_the_tick_task(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ductor, recorder, run_id = _quick_branches_woken_busy(database_url, monkeypatch)
    app = Celery("bundles", broker="memory://")
    steps, coord = _private_queues()
    Dispatcher(app, steps, coord).wake(run_id, recorder.quick_wakes[0][1])
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue(coord)
        message = queue.get(timeout=1)
        queue.close()
    assert quick_branches(message.headers.get(QUICK_HEADER)) == recorder.quick_wakes[0][1]

    # The tick task as a worker runs it: its request made from the message's headers.
    tick = ductor.app.tasks["ductor.tick"]
    tick.push_request(**message.headers)
    try:
        assert tick.run(run_id) == "committed"
    finally:
        tick.pop_request()
    [bundle] = [r for r in recorder.rows if r.kind == "step"]
    assert len(bundle.payload["held"]) == 3


@pytest.mark.parametrize(
    "value",
    [None, "x", {"step": "s", "node": "n"}, {"step": "s", "node": "n", "queue": 1}],
)
def test_a_malformed_quick_hint_is_no_hint(value: Any) -> None:
    assert quick_branches(value) is None


@pytest.mark.parametrize("last_ran_s", [0.001, 1.0, None])
def test_a_first_tick_bundles_a_scatters_first_branches_when_their_step_ran_quickly_here(
    database_url: str, monkeypatch: pytest.MonkeyPatch, last_ran_s: float | None
) -> None:
    """The run's first tick on a step worker (``steps.first_tick``): a chain that has run
    nothing bundles the first fill only if the step ran quickly the last time in this
    process; otherwise (slow, or never run here) one message per branch, all at once."""
    monkeypatch.setattr(inline, "HOLD_IF_QUICKER_S", 0.01)
    monkeypatch.setattr(inline, "_last_ran_by_step", {})
    if last_ran_s is not None:
        inline._last_ran_by_step["held.bump"] = last_ran_s
    ductor, recorder = make_ductor(database_url)
    quick_scatter(ductor, max_parallel=20)
    run_id = ductor.start("quick", input={"items": list(range(40))}).run_id

    assert first_tick(ductor.runtime, run_id, "w1@host", QUEUE) == "committed"

    sent = [r for r in recorder.sends[0] if r.kind == "step"]  # the first tick's
    if last_ran_s == 0.001:
        # 20 started: one claimed in the commit and run here, 19 in two bundles (16 + 3).
        assert sorted(1 + len(r.payload.get("held", [])) for r in sent) == [3, 16]
    else:
        assert len(sent) == 19 and not any("held" in r.payload for r in sent)
    played = _play_everything(ductor, recorder, [])
    run = run_row(ductor, run_id)
    assert run.status == "succeeded", (run.error, played)
    assert sorted(a.branch for a in attempt_rows(ductor, run_id)) == list(range(40))


def test_held_branches_of_a_node_with_a_rate_limit_take_the_ordinary_claim(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node's own rate limit (the step registers none): its held branches are claimed
    one by one by the claim that takes a token from the bucket, not dropped by the held
    claim (they have no message of their own: dropped, they would wait for the unclaimed
    re-send)."""
    monkeypatch.setattr(inline, "HOLD_IF_QUICKER_S", 10.0)
    ductor, recorder = make_ductor(database_url)
    wf = Workflow("limited")
    wf.scatter(
        "each",
        ductor.step(name="limited.bump")(lambda ctx, item: item + 1),
        over="$.input.items",
        max_parallel=8,
        rate_limit=RateLimit("1000/s"),
    )
    wf.output("$.nodes.each.output")
    ductor.register(wf)
    handle = ductor.start("limited", input={"items": list(range(30))})
    assert run_tick(ductor.runtime, handle.run_id) == "committed"
    first = [r for r in recorder.rows if r.kind == "step"]
    recorder.rows.clear()

    assert deliver(ductor, first[0]) == "succeeded"
    held_ran = sum(a.finished_at is not None for a in attempt_rows(ductor, handle.run_id))
    _play_everything(ductor, recorder, first[1:])

    run = run_row(ductor, handle.run_id)
    assert run.status == "succeeded", run.error
    assert run.output == [i + 1 for i in range(30)]
    assert held_ran > 8  # the first message's chain ran held branches, not only its own
    rows = attempt_rows(ductor, handle.run_id)
    assert sorted(a.branch for a in rows) == list(range(30))
    assert all(a.rate_key is not None for a in rows)
