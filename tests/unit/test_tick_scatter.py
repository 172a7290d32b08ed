"""Scatter/gather in the pure tick: in-flight bound, item order, failure policies, cost.

``_Sim`` plays the store and the workers: it keeps every attempt the ticks create, finishes
them as told, and answers the gather the way the loader does (each branch's last attempt).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import FakeStep, token_of

from ductor_celery.definition import RetryPolicy, Workflow
from ductor_celery.definition.spec import BATCH_ARG
from ductor_celery.engine import AttemptResult, RunState, RunStatus, TickInputs, compute_tick
from ductor_celery.engine.inputs import ControlIn, EngineConfig, NewAttempt
from ductor_celery.engine.scatter import assemble, assemble_batched
from ductor_celery.errors import DefinitionError
from ductor_celery.payloads import refusal
from ductor_celery.runtime.batch import ItemOutcome, run_batch

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _step(name: str, attempts: int = 1) -> FakeStep:
    return FakeStep(name, RetryPolicy(max_attempts=attempts, initial_interval=1.0), timeout=300.0)


def _spec(max_parallel: int = 3, attempts: int = 1, then: bool = True, **policy: Any) -> Any:
    wf = Workflow("fan")
    wf.step("prep", _step("s.prep"), args={"n": "$.input.n"})
    wf.scatter(
        "each",
        _step("s.each", attempts),
        over="$.nodes.prep.output",
        args={"scale": "$.input.scale"},
        max_parallel=max_parallel,
        after=["prep"],
        **policy,
    )
    if then:
        wf.step("total", _step("s.total"), args={"parts": "$.nodes.each.output"}, after=["each"])
    wf.output({"parts": "$.nodes.each.output"})
    return wf.build()


Outcome = Callable[[int, int], bool]  # (item index, attempt) -> succeeds?


class _Sim:
    def __init__(
        self, spec: Any, items: list[Any], outcome: Outcome, config: EngineConfig | None = None
    ) -> None:
        self.spec = spec
        self.config = config or EngineConfig()
        self.items = items
        self.outcome = outcome
        self.state = RunState()
        self.now = T0
        self.attempts: dict[str, NewAttempt] = {}
        self.finished: dict[str, tuple[str, Any]] = {}
        self.open: list[str] = []
        self.max_in_flight = 0
        self.ticks = 0
        self.executions: list[tuple[int | None, int]] = []
        #: The output column of each finished attempt (a failed batch records its progress).
        self.outputs: dict[str, Any] = {}
        #: Items whose failures are not retryable (batch runs only).
        self.final: set[int] = set()

    def _gathered(self, finished: bool = False) -> dict[str, list[Any]]:
        """Gathers being read (or, with ``finished``, outputs of finished scatters)."""
        out: dict[str, list[Any]] = {}
        for node, ns in self.state.nodes.items():
            sc = ns.scatter
            if sc is None or not (ns.status == "succeeded" if finished else sc.gathering):
                continue
            last: dict[int, NewAttempt] = {}
            for a in self.attempts.values():
                if a.node == node and a.branch is not None and a.generation > sc.base:
                    if a.branch not in last or a.generation > last[a.branch].generation:
                        last[a.branch] = a
            if sc.batch > 1:
                out[node] = assemble_batched(sc, self._batch_attempts(node, sc.base))
                continue
            finals = {}
            for b, a in last.items():
                outcome, value = self.finished[a.token]
                finals[b] = (outcome == "succeeded", value)
            out[node] = assemble(sc, finals)
        return out

    def _batch_attempts(
        self, node: str, base: int, branch: int | None = None
    ) -> dict[int, list[Any]]:
        """Finished attempts per batch, oldest first, as the store's gather reads them."""
        found: dict[int, list[Any]] = {}
        for a in sorted(self.attempts.values(), key=lambda a: a.generation):
            if a.node != node or a.branch is None or a.generation <= base:
                continue
            if a.token not in self.finished or branch not in (None, a.branch):
                continue
            outcome, value = self.finished[a.token]
            output = self.outputs.get(a.token) if outcome in ("succeeded", "failed") else None
            found.setdefault(a.branch, []).append((outcome == "succeeded", output, value))
        return found

    def tick(
        self, results: tuple[AttemptResult, ...] = (), control: ControlIn | None = None
    ) -> Any:
        outputs = {}
        prep = self.state.nodes.get("prep")
        if prep is not None and token_of(prep):
            outputs["prep"] = self.items
        outputs.update(self._gathered(finished=True))
        inputs = TickInputs(
            run_id="r",
            input={"n": len(self.items), "scale": 10},
            results=results,
            outputs=outputs,
            gathered=self._gathered(),
            control=control,
            config=self.config,
        )
        p = compute_tick(self.spec, self.state, inputs, self.now)
        self.ticks += 1
        for c in p.closed:
            assert c.token in self.open, f"closed {c.token}, which is not open"
            self.open.remove(c.token)
            self.finished[c.token] = (c.outcome, c.error)
        for a in p.new_attempts:
            assert a.token not in self.attempts, "a token was reused"
            if a.args_from:
                a = dataclasses.replace(a, args=self.attempts[a.args_from].args)  # noqa: PLW2901
            self.attempts[a.token] = a
            self.open.append(a.token)
        self.state = p.state
        in_flight = sum(1 for t in self.open if self.attempts[t].node == "each")
        self.max_in_flight = max(self.max_in_flight, in_flight)
        return p

    def run_workers(self) -> tuple[AttemptResult, ...]:
        """Finish every open attempt, as told by ``outcome``."""
        results = []
        for token in list(self.open):
            a = self.attempts[token]
            self.open.remove(token)
            if BATCH_ARG in a.args:
                results.append(self._run_batch(token, a))  # executions counted per item
                continue
            self.executions.append((a.branch, a.attempt))
            if a.node == "prep":
                value: Any = self.items
                ok = True
            elif a.node == "total":
                value, ok = len(a.args["parts"]), True
            else:
                ok = self.outcome(a.args["item"], a.attempt)
                value = {"item": a.args["item"], "x": a.args["scale"]} if ok else None
            error = None if ok else {"type": "Boom", "message": f"item {a.args.get('item')}"}
            self.finished[token] = ("succeeded" if ok else "failed", value if ok else error)
            self.outputs[token] = value
            results.append(
                AttemptResult(
                    token=token,
                    node=a.node,
                    outcome="succeeded" if ok else "failed",
                    output=value,
                    error=error,
                    branch=a.branch,
                )
            )
        return tuple(results)

    def _run_batch(self, token: str, a: NewAttempt) -> AttemptResult:
        """The worker's batch loop (runtime/batch.py) over this sim's outcomes; the earlier
        attempts' recorded outputs come from this sim's rows, as the store hands them over."""
        spec = a.args[BATCH_ARG]
        earlier = [
            out
            for _, out, _ in self._batch_attempts(a.node, spec["base"], a.branch).get(a.branch, [])
            if out is not None
        ]

        def call(index: int, args: dict[str, Any]) -> tuple[ItemOutcome, None]:
            self.executions.append((index, a.attempt))
            if self.outcome(args["item"], a.attempt):
                return ItemOutcome(True, {"item": args["item"], "x": args["scale"]}), None
            fail = {"type": "Boom", "message": f"item {args['item']}"}
            return ItemOutcome(False, error=fail, retryable=args["item"] not in self.final), None

        done, _ = run_batch(spec, earlier, call, lambda _progress: None)
        outcome = "succeeded" if done.succeeded else "failed"
        self.finished[token] = (outcome, done.output if done.succeeded else done.error)
        self.outputs[token] = done.output
        return AttemptResult(
            token=token,
            node=a.node,
            outcome=outcome,
            output=done.output,
            error=done.error,
            retryable=done.retryable,
            patch=done.patch,
            branch=a.branch,
        )

    def until_done(self, limit: int = 10_000) -> Any:
        p = self.tick()
        for _ in range(limit):
            if p.state.status in (RunStatus.SUCCEEDED, RunStatus.FAILED):
                return p
            results = self.run_workers()
            self.now += timedelta(seconds=5)  # past any retry backoff
            p = self.tick(results)
        raise AssertionError("the run never finished")


def _ok(_item: int, _attempt: int) -> bool:
    return True


def test_gathers_in_item_order_with_at_most_max_parallel_in_flight() -> None:
    items = list(range(20))
    sim = _Sim(_spec(max_parallel=3), items, _ok)
    p = sim.until_done()
    assert p.state.status == RunStatus.SUCCEEDED
    assert p.output == {"parts": [{"item": i, "x": 10} for i in items]}
    assert sim.max_in_flight == 3
    assert sorted(b for b, _ in sim.executions if b is not None) == items


def test_the_run_row_holds_counters_not_one_entry_per_branch() -> None:
    sim = _Sim(_spec(max_parallel=4, then=False), list(range(2000)), _ok)
    sizes = []
    p = sim.tick()
    while p.state.status == RunStatus.RUNNING:
        sizes.append(len(json.dumps(p.state.to_json())))
        p = sim.tick(sim.run_workers())
    assert p.state.status == RunStatus.SUCCEEDED
    assert max(sizes) < 3000, max(sizes)


def test_an_empty_list_gives_an_empty_output_at_once() -> None:
    sim = _Sim(_spec(), [], _ok)
    p = sim.until_done()
    assert p.state.status == RunStatus.SUCCEEDED
    assert p.output == {"parts": []}
    assert sim.attempts and all(a.node != "each" for a in sim.attempts.values())


def test_over_that_is_not_a_list_fails_the_node_with_a_clear_error() -> None:
    sim = _Sim(_spec(), [], _ok)
    sim.items = {"not": "a list"}  # type: ignore[assignment]
    p = sim.until_done()
    assert p.state.status == RunStatus.FAILED
    assert "resolved to dict, not a list" in p.state.nodes["each"].error["message"]


def test_fail_fast_stops_dispatching_and_closes_branches_in_flight() -> None:
    sim = _Sim(_spec(max_parallel=4), list(range(40)), lambda item, _a: item != 5)
    p = sim.until_done()
    assert p.state.status == RunStatus.FAILED
    each = p.state.nodes["each"]
    assert each.status == "failed"
    assert each.error["type"] == "BranchFailed" and each.error["branch"] == 5
    started = {a.branch for a in sim.attempts.values() if a.node == "each"}
    assert max(started) < 10, "nothing is started once the scatter failed"
    assert sim.open == [], "every branch in flight was closed"
    assert p.state.nodes["total"].status == "pending"


def test_a_failing_branch_in_flight_with_others_revokes_and_closes_them() -> None:
    sim = _Sim(_spec(max_parallel=4), list(range(8)), _ok)
    sim.tick()
    sim.tick(sim.run_workers())  # prep done: branches 0-3 in flight
    tokens = {a.branch: t for t, a in sim.attempts.items() if a.node == "each"}
    first = tokens[0]
    sim.open.remove(first)
    sim.finished[first] = ("failed", {"type": "Boom", "message": "no"})
    failed = AttemptResult(
        token=first, node="each", outcome="failed", error={"message": "no"}, branch=0
    )
    p = sim.tick((failed,))
    assert sorted(c.token for c in p.closed) == sorted(tokens[b] for b in (1, 2, 3))
    assert {d.token for d in p.dispatches if d.kind == "revoke"} == {tokens[b] for b in (1, 2, 3)}
    assert p.state.status == RunStatus.FAILED


@pytest.mark.parametrize(
    ("policy", "bad", "ok"),
    [
        ({"tolerated_failures": 2}, {3, 7}, True),
        ({"tolerated_failures": 2}, {1, 3, 7}, False),
        ({"tolerated_failure_ratio": 0.25}, {0, 1, 2, 3, 4}, True),  # 5 of 20 allowed
        ({"tolerated_failure_ratio": 0.25}, set(range(6)), False),
    ],
)
def test_tolerated_failures_put_errors_in_their_places(
    policy: dict[str, Any], bad: set[int], ok: bool
) -> None:
    sim = _Sim(_spec(max_parallel=5, **policy), list(range(20)), lambda i, _a: i not in bad)
    p = sim.until_done()
    assert (p.state.status == RunStatus.SUCCEEDED) is ok
    if ok:
        parts = p.output["parts"]
        for i, part in enumerate(parts):
            if i in bad:
                assert part == {"error": {"type": "Boom", "message": f"item {i}"}}
            else:
                assert part == {"item": i, "x": 10}


def test_a_branch_retries_under_a_new_token_and_keeps_its_place() -> None:
    sim = _Sim(_spec(max_parallel=2, attempts=3), list(range(6)), lambda i, a: i != 2 or a == 3)
    p = sim.until_done()
    assert p.state.status == RunStatus.SUCCEEDED
    assert p.output["parts"][2] == {"item": 2, "x": 10}
    assert (2, 3) in sim.executions and (2, 4) not in sim.executions


def test_a_late_result_for_a_closed_branch_is_stale() -> None:
    sim = _Sim(_spec(max_parallel=2), list(range(4)), _ok)
    sim.tick()
    sim.tick(sim.run_workers())
    tokens = [t for t, a in sim.attempts.items() if a.node == "each"]
    p = sim.tick(control=ControlIn(id=1, kind="terminate"))  # closes at once
    assert p.state.status == RunStatus.TERMINATED
    assert sorted(c.token for c in p.closed) == sorted(tokens)
    late = AttemptResult(token=tokens[0], node="each", outcome="succeeded", output=1, branch=0)
    p2 = compute_tick(sim.spec, p.state, TickInputs(run_id="r", results=(late,)), sim.now)
    assert p2.folded == [tokens[0]] and p2.state.status == RunStatus.TERMINATED


def test_a_burst_of_results_is_folded_in_one_tick() -> None:
    sim = _Sim(_spec(max_parallel=50, then=False), list(range(50)), _ok)
    sim.tick()
    sim.tick(sim.run_workers())
    p = sim.tick(sim.run_workers())  # all 50 branch results at once
    assert len(p.folded) == 50
    assert p.state.nodes["each"].scatter.gathering
    assert any(d.kind == "wakeup" for d in p.dispatches)


def test_scatter_definitions_are_checked() -> None:
    wf = Workflow("bad")
    wf.scatter("x", _step("s.x"), over="$.context.items")
    with pytest.raises(DefinitionError, match="must be a path to a list under"):
        wf.build()
    wf = Workflow("bad")
    wf.scatter(
        "x", _step("s.x"), over="$.input.items", tolerated_failures=1, tolerated_failure_ratio=0.5
    )
    with pytest.raises(DefinitionError, match="not both"):
        wf.build()
    wf = Workflow("bad")
    wf.scatter("x", _step("s.x"), over="$.input.items", max_parallel=0)
    with pytest.raises(DefinitionError, match="max_parallel"):
        wf.build()
    wf = Workflow("bad")
    wf.step("y", _step("s.y"), args={"i": "$.item"})
    with pytest.raises(DefinitionError, match="only valid inside a scatter"):
        wf.build()
    wf = Workflow("bad")
    wf.scatter("x", _step("s.x"), over="$.input.items", args={"item": 1})
    with pytest.raises(DefinitionError, match="also given in args"):
        wf.build()


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(min_value=0, max_value=30),
    max_parallel=st.integers(min_value=1, max_value=8),
    attempts=st.integers(min_value=1, max_value=3),
    tolerated=st.one_of(st.none(), st.integers(min_value=0, max_value=5)),
    bad=st.sets(st.integers(min_value=0, max_value=29), max_size=8),
    flaky=st.sets(st.integers(min_value=0, max_value=29), max_size=8),
)
def test_scatter_invariants_hold_for_any_mix_of_outcomes(
    n: int, max_parallel: int, attempts: int, tolerated: int | None, bad: set[int], flaky: set[int]
) -> None:
    policy = {} if tolerated is None else {"tolerated_failures": tolerated}
    items = list(range(n))

    def outcome(item: int, attempt: int) -> bool:
        return item not in bad and (item not in flaky or attempt > 1)

    sim = _Sim(_spec(max_parallel=max_parallel, attempts=attempts, **policy), items, outcome)
    p = sim.until_done()
    assert sim.max_in_flight <= max_parallel
    assert sim.open == []
    failing = {i for i in items if i in bad or (i in flaky and attempts == 1)}
    allowed = tolerated or 0
    if len(failing) <= allowed:
        assert p.state.status == RunStatus.SUCCEEDED
        parts = p.output["parts"]
        assert len(parts) == n
        for i in items:
            assert ("error" in parts[i]) is (i in failing)
        # every branch ran to its final attempt exactly once per attempt number
        for i in items:
            runs = [a for b, a in sim.executions if b == i]
            assert runs == sorted(set(runs))
    else:
        assert p.state.status == RunStatus.FAILED
        assert p.state.nodes["each"].error["type"] == "BranchFailed"


def test_automatic_continue_as_new_waits_for_a_running_scatter() -> None:
    from ductor_celery.engine import EngineConfig

    spec = _spec(max_parallel=2, attempts=3, then=False)
    sim = _Sim(spec, list(range(10)), lambda _i, a: a > 1)  # every branch fails once
    low = EngineConfig(max_transitions=8)
    original = sim.tick

    def tick(results: tuple[AttemptResult, ...] = (), control: ControlIn | None = None) -> Any:
        outputs = (
            {"prep": sim.items}
            if sim.state.nodes.get("prep") and token_of(sim.state.nodes["prep"])
            else {}
        )
        outputs.update(sim._gathered(finished=True))
        inputs = TickInputs(
            run_id="r",
            input={"n": 10, "scale": 10},
            results=results,
            outputs=outputs,
            gathered=sim._gathered(),
            config=low,
        )
        p = compute_tick(sim.spec, sim.state, inputs, sim.now)
        for c in p.closed:
            sim.open.remove(c.token)
            sim.finished[c.token] = (c.outcome, c.error)
        for a in p.new_attempts:
            if a.args_from:
                a = dataclasses.replace(a, args=sim.attempts[a.args_from].args)  # noqa: PLW2901
            sim.attempts[a.token] = a
            sim.open.append(a.token)
        sim.state = p.state
        return p

    sim.tick = tick  # type: ignore[method-assign]
    del original
    p = sim.tick()
    for _ in range(200):
        assert p.successor is None or p.state.nodes["each"].status == "succeeded"
        if p.state.status in (RunStatus.SUCCEEDED, RunStatus.CONTINUED):
            break
        results = sim.run_workers()
        sim.now += timedelta(seconds=5)
        p = sim.tick(results)
    assert p.state.status in (RunStatus.SUCCEEDED, RunStatus.CONTINUED)
    assert p.state.nodes["each"].status == "succeeded", "the scatter finished before continuing"


# -- batched scatter (batch_size > 1): one attempt per batch, the step once per item ----------


def _items_run(sim: _Sim) -> dict[int, list[int]]:
    """Item index -> the attempt numbers of the batch attempts that called the step for it."""
    runs: dict[int, list[int]] = {}
    for item, attempt in sim.executions:
        if item is not None:
            runs.setdefault(item, []).append(attempt)
    return runs


def test_a_batched_scatter_gathers_every_item_in_order_with_batches_in_flight_bounded() -> None:
    items = list(range(23))  # 5 batches of 5, the last one of 3
    sim = _Sim(_spec(max_parallel=2, batch_size=5), items, _ok)
    p = sim.until_done()
    assert p.state.status == RunStatus.SUCCEEDED
    assert p.output == {"parts": [{"item": i, "x": 10} for i in items]}
    batches = [a for a in sim.attempts.values() if a.node == "each"]
    assert len(batches) == 5
    sizes = [len(a.args[BATCH_ARG]["items"]) for a in sorted(batches, key=lambda a: a.branch)]
    assert sizes == [5, 5, 5, 5, 3]
    assert sim.max_in_flight == 2
    assert _items_run(sim) == {i: [1] for i in items}


def test_a_failing_item_is_retried_without_rerunning_its_neighbours() -> None:
    sim = _Sim(
        _spec(max_parallel=4, attempts=3, batch_size=4),
        list(range(8)),
        lambda i, a: i != 5 or a == 3,
    )
    p = sim.until_done()
    assert p.state.status == RunStatus.SUCCEEDED
    assert p.output["parts"][5] == {"item": 5, "x": 10}
    runs = _items_run(sim)
    assert runs[5] == [1, 2, 3]
    assert all(runs[i] == [1] for i in range(8) if i != 5)
    each = [a for a in sim.attempts.values() if a.node == "each"]
    assert len(each) == 2 + 2  # 2 batches, 2 retries


@pytest.mark.parametrize(("bad", "ok"), [({1, 3}, True), ({1, 3, 6}, False)])
def test_batched_tolerances_count_items_not_batches(bad: set[int], ok: bool) -> None:
    sim = _Sim(
        _spec(max_parallel=3, batch_size=5, tolerated_failures=2),
        list(range(10)),
        lambda i, _a: i not in bad,
    )
    p = sim.until_done()
    assert (p.state.status == RunStatus.SUCCEEDED) is ok
    if ok:
        parts = p.output["parts"]
        for i, part in enumerate(parts):
            if i in bad:
                assert part["error"]["type"] == "Boom" and part["error"]["message"] == f"item {i}"
            else:
                assert part == {"item": i, "x": 10}
        sc = p.state.nodes["each"].scatter
        assert sc is None or (sc.succeeded, sc.failed) == (8, 2)
    else:
        assert p.state.nodes["each"].error["type"] == "BranchFailed"
        assert "items failed" in p.state.nodes["each"].error["message"]


def test_an_item_that_fails_for_good_is_not_retried_with_its_flaky_neighbour() -> None:
    sim = _Sim(
        _spec(max_parallel=1, attempts=3, batch_size=4, tolerated_failures=1),
        list(range(4)),
        lambda i, a: i != 0 and (i != 2 or a > 1),
    )
    sim.final = {0}
    p = sim.until_done()
    assert p.state.status == RunStatus.SUCCEEDED
    runs = _items_run(sim)
    assert runs == {0: [1], 1: [1], 2: [1, 2], 3: [1]}
    assert p.output["parts"][0]["error"]["message"] == "item 0"
    assert [part for part in p.output["parts"][1:]] == [{"item": i, "x": 10} for i in (1, 2, 3)]


def _alone(item: Any, limit: int) -> tuple[Any, dict[str, Any] | None]:
    """An unbatched branch of ``item``: its arguments as checked, or its refusal."""
    return refusal({"scale": 10, "item": item}, "branch arguments", limit)


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


_BATCH_ITEMS = st.one_of(
    st.integers(min_value=0, max_value=150).map(lambda n: "x" * n),
    st.just("a\x00b"),  # NUL: refused
    st.just({1, 2}),  # not JSON
    st.integers(min_value=97, max_value=101).map(_nested),  # around the depth limit
    st.just(Decimal("1e999999")),  # a decimal past its bounds
    st.just(Decimal("12.5")),  # one within them (stored as an envelope)
)


@settings(max_examples=80, deadline=None)
@given(
    items=st.lists(_BATCH_ITEMS, min_size=1, max_size=12),
    limit=st.integers(min_value=20, max_value=700),
)
def test_a_batch_refuses_exactly_the_items_a_branch_would_refuse(
    items: list[Any], limit: int
) -> None:
    """Each item's arguments are held to the checks alone, whatever the batch's whole size:
    an item refused (too large, NUL, not JSON, too deep, a decimal out of bounds) fails alone
    with the error its own branch would get, every other item of its batch is sent as its
    branch's arguments would be (with the batch checked as one value when it passes, item by
    item when it does not)."""
    wf = Workflow("fan")
    wf.scatter(
        "each",
        _step("s.each"),
        over="$.input.items",
        args={"scale": "$.input.scale"},
        max_parallel=3,  # every batch starts in the first tick
        batch_size=4,
        tolerated_failures=len(items),
    )
    inputs = TickInputs(
        run_id="r",
        input={"items": items, "scale": 10},
        config=EngineConfig(max_payload_bytes=limit),
    )
    p = compute_tick(wf.build(), RunState(), inputs, T0)
    alone = [_alone(item, limit) for item in items]
    sent = {
        a.args[BATCH_ARG]["first"] + k: args
        for a in p.new_attempts
        if a.node == "each"
        for k, args in enumerate(a.args[BATCH_ARG]["items"])
    }
    sc = p.state.nodes["each"].scatter
    errors = sc.errors if sc is not None else {}
    for i, (args, refused) in enumerate(alone):
        if refused is not None:
            assert sent.get(i) is None, "a refused item is not sent"
            assert errors[i]["type"] == refused["type"]
            assert f"item {i} arguments" in errors[i]["message"]
        else:
            assert sent[i] == args
            assert i not in errors


def test_a_batch_result_of_the_wrong_shape_fails_the_batch_without_retry() -> None:
    spec = _spec(max_parallel=1, attempts=3, batch_size=3, then=False)
    sim = _Sim(spec, list(range(3)), _ok)
    sim.tick()
    sim.tick(sim.run_workers())  # prep done: the one batch is in flight
    (token,) = sim.open
    bad = AttemptResult(token=token, node="each", outcome="succeeded", output=[1, 2], branch=0)
    p = sim.tick((bad,))
    assert p.state.status == RunStatus.FAILED
    assert (
        "must be a list of 3 item outputs, got a list of 2"
        in p.state.nodes["each"].error["message"]
    )
    assert p.new_attempts == []


def test_a_batched_run_row_stays_small() -> None:
    sim = _Sim(_spec(max_parallel=8, batch_size=50, then=False), list(range(5000)), _ok)
    sizes = []
    p = sim.tick()
    while p.state.status == RunStatus.RUNNING:
        sizes.append(len(json.dumps(p.state.to_json())))
        p = sim.tick(sim.run_workers())
    assert p.state.status == RunStatus.SUCCEEDED
    assert len(p.output["parts"]) == 5000
    assert max(sizes) < 4000, max(sizes)


def test_batched_scatter_definitions_are_checked() -> None:
    from ductor_celery import ConcurrencyLimit

    wf = Workflow("bad")
    wf.scatter("x", _step("s.x"), over="$.input.items", batch_size=0)
    with pytest.raises(DefinitionError, match="batch_size"):
        wf.build()
    with pytest.raises(DefinitionError, match="batch_size"):
        Workflow("bad").scatter(
            "x", workflow="child", over="$.input.items", as_child_runs=True, batch_size=5
        )
    step = _step("s.x")
    step.concurrency = ConcurrencyLimit(key="$.item.customer", limit=2)
    wf = Workflow("bad")
    wf.scatter("x", step, over="$.input.items", batch_size=10)
    with pytest.raises(DefinitionError, match="cannot read"):
        wf.build()
    wf = Workflow("bad")
    wf.scatter("x", _step("s.x"), over="$.input.items", args={BATCH_ARG: 1}, batch_size=2)
    with pytest.raises(DefinitionError, match="reserved"):
        wf.build()


def test_an_unbatched_scatter_spec_is_stored_as_before() -> None:
    """batch_size=1 is left out of the stored form: existing definitions keep their hashes."""
    stored = _spec().model_dump(mode="json")
    assert "batch_size" not in json.dumps(stored)
    assert "batch_size" in json.dumps(_spec(batch_size=2).model_dump(mode="json"))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(min_value=0, max_value=30),
    batch=st.integers(min_value=2, max_value=7),
    max_parallel=st.integers(min_value=1, max_value=4),
    attempts=st.integers(min_value=1, max_value=3),
    tolerated=st.one_of(st.none(), st.integers(min_value=0, max_value=5)),
    bad=st.sets(st.integers(min_value=0, max_value=29), max_size=6),
    flaky=st.sets(st.integers(min_value=0, max_value=29), max_size=8),
)
def test_batched_scatter_invariants_hold_for_any_mix_of_outcomes(
    n: int,
    batch: int,
    max_parallel: int,
    attempts: int,
    tolerated: int | None,
    bad: set[int],
    flaky: set[int],
) -> None:
    policy: dict[str, Any] = {"batch_size": batch}
    if tolerated is not None:
        policy["tolerated_failures"] = tolerated
    items = list(range(n))

    def outcome(item: int, attempt: int) -> bool:
        return item not in bad and (item not in flaky or attempt > 1)

    sim = _Sim(_spec(max_parallel=max_parallel, attempts=attempts, **policy), items, outcome)
    p = sim.until_done()
    assert sim.max_in_flight <= max_parallel
    assert sim.open == []
    runs = _items_run(sim)
    # An item with a recorded output is never called again: only its failures repeat.
    for item, attempt_numbers in runs.items():
        assert attempt_numbers == sorted(set(attempt_numbers)), (item, attempt_numbers)
        assert attempt_numbers.count(attempt_numbers[-1]) == 1
    failing = {i for i in items if i in bad or (i in flaky and attempts == 1)}
    if p.state.status == RunStatus.SUCCEEDED:
        assert len(failing) <= (tolerated or 0)
        parts = p.output["parts"]
        assert len(parts) == n
        for i in items:
            assert ("error" in parts[i]) is (i in failing), (i, parts[i])
            if i not in failing:
                assert parts[i] == {"item": i, "x": 10}
    else:
        assert p.state.status == RunStatus.FAILED
        assert len(failing) > (tolerated or 0)
        assert p.state.nodes["each"].error["type"] == "BranchFailed"
