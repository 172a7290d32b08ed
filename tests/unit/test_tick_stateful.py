"""The tick loop driven by Hypothesis over random small DAGs, on the shipped in-memory store.

Every tick is the production loop (``coordinator.Coordinator``) over ``fakes.InMemoryStore``:
the store keeps the attempt rows, answers the loads (outputs, claim status of due checks,
unfolded results) and applies the commits. The machine plays the step workers and the clock:
it claims and finishes attempts, re-delivers results (a duplicate or a stale token, written
into the attempt table as a redelivery would leave them), claims attempts early or long ago
and moves time. After every tick it checks the invariants the coordinator relies on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from support import payload_of, token_of

from ductor_celery.coordinator import Coordinator
from ductor_celery.definition import RetryPolicy, Workflow, WorkflowSpec
from ductor_celery.definition.retry import backoff_delay
from ductor_celery.engine import (
    AttemptResult,
    EngineConfig,
    NodeStatus,
    RunState,
    RunStatus,
    TickInputs,
    TickPayload,
    compute_tick,
    needed_outputs,
)
from ductor_celery.engine.status import NODE_TRANSITIONS, TERMINAL_RUN_STATUSES
from ductor_celery.engine.tick import describe
from ductor_celery.fakes import AttemptRow, InMemoryStore, RecordingDispatcher
from ductor_celery.fakes.load import finish_order

RUN = "run-1"
START = datetime(2024, 1, 1, tzinfo=UTC)
CONFIG = EngineConfig(resend_unclaimed_after=30.0, default_step_timeout=300.0)
FLAGS = ("flag_0", "flag_1")
DONE = {NodeStatus.SUCCEEDED, NodeStatus.SKIPPED}
FINISHED = {NodeStatus.SUCCEEDED, NodeStatus.FAILED, NodeStatus.SKIPPED, NodeStatus.CANCELLED}


@dataclass(frozen=True)
class NodeDraw:
    id: str
    after: tuple[str, ...]
    continue_on_failure: bool
    when: str | None
    max_attempts: int
    timeout: float | None


@dataclass(frozen=True)
class Dag:
    nodes: tuple[NodeDraw, ...]
    flags: dict[str, bool] = field(default_factory=dict)

    def spec(self) -> WorkflowSpec:
        wf = Workflow("random_dag")
        for n in self.nodes:
            wf.step(
                n.id,
                f"step_{n.id}",
                after=list(n.after),
                # Every dependency's output, plus an input value: checked at each start.
                args={"deps": {d: f"$.nodes.{d}.output" for d in n.after}, "x": "$.input.x"},
                when=n.when,
                continue_on_failure=n.continue_on_failure,
                retry=RetryPolicy(
                    max_attempts=n.max_attempts, initial_interval=1.0, backoff=2.0, max_interval=8.0
                ),
                timeout=n.timeout,
            )
        wf.output({n.id: f"$.nodes.{n.id}.output" for n in self.nodes})
        return wf.build()


@st.composite
def dags(draw: st.DrawFn) -> Dag:
    size = draw(st.integers(min_value=2, max_value=7))
    nodes: list[NodeDraw] = []
    for i in range(size):
        earlier = [n.id for n in nodes]
        after = draw(st.lists(st.sampled_from(earlier), unique=True, max_size=3)) if earlier else []
        when = draw(
            st.one_of(
                st.none(),
                st.none(),
                st.sampled_from([f"$.input.{f}" for f in FLAGS] + [f"!$.input.{f}" for f in FLAGS]),
            )
        )
        nodes.append(
            NodeDraw(
                id=f"n{i}",
                after=tuple(after),
                continue_on_failure=draw(st.booleans()),
                when=when,
                max_attempts=draw(st.integers(min_value=1, max_value=3)),
                timeout=draw(st.sampled_from([None, 20.0])),
            )
        )
    flags = {f: draw(st.booleans()) for f in FLAGS}
    return Dag(tuple(nodes), flags)


class TickMachine(RuleBasedStateMachine):
    """One run in the in-memory store, the tick loop over it, and the workers' results."""

    def __init__(self) -> None:
        super().__init__()
        self.spec: WorkflowSpec
        self.input: dict[str, Any] = {}
        self.state = RunState()
        self.store = InMemoryStore(now=START, config=CONFIG)
        self.coordinator = Coordinator(self.store, RecordingDispatcher(self.store))
        self.ticks = 0
        # The workers' side: every token the ticks started, what succeeded ones returned, and
        # when each attempt was claimed.
        self.attempt_node: dict[str, str] = {}
        self.outputs: dict[str, Any] = {}
        self.claims: dict[str, datetime] = {}
        # What the workers delivered (for duplicates) and what the run accepted.
        self.delivered: list[AttemptResult] = []
        self.output_token: dict[str, str] = {}
        self.successes: dict[str, int] = {}

    @property
    def now(self) -> datetime:
        return self.store.now

    # --- helpers ----------------------------------------------------------------------------

    @property
    def graph(self) -> Any:
        return self.spec.graph

    def terminal(self) -> bool:
        return self.state.status in TERMINAL_RUN_STATUSES

    def awaited(self) -> list[tuple[str, str]]:
        """(node, token) for every attempt the run waits on."""
        return sorted(
            (node, ns.step.token)
            for node, ns in self.state.nodes.items()
            if ns.status == NodeStatus.RUNNING and ns.step.token is not None
        )

    def fatal(self, state: RunState) -> list[str]:
        return [
            node
            for node, ns in state.nodes.items()
            if ns.status == NodeStatus.FAILED and not self.graph.nodes[node].continue_on_failure
        ]

    def dep_done(self, state: RunState, dep: str) -> bool:
        ns = state.nodes[dep]
        return ns.status in DONE or (
            ns.status == NodeStatus.FAILED and self.graph.nodes[dep].continue_on_failure
        )

    def retry_due(self) -> bool:
        return any(
            ns.status == NodeStatus.RUNNING
            and ns.step.token is None
            and ns.step.retry_at is not None
            and ns.step.retry_at <= self.now
            for ns in self.state.nodes.values()
        )

    def unfolded(self) -> tuple[AttemptResult, ...]:
        """The results the next tick's load reads: finished rows not folded, in finish order."""
        rows = [a for a in self.store.tables.attempts.values() if a.finished_at and not a.folded]
        rows.sort(key=finish_order)
        return tuple(
            AttemptResult(a.token, a.node, a.outcome or "failed", a.output, a.error) for a in rows
        )

    def finish(self, result: AttemptResult) -> None:
        """A worker claims its attempt (if nobody did) and writes its outcome, once."""
        if self.store.claim(result.token):
            self.claims.setdefault(result.token, self.now)
        assert self.store.finish(
            result.token,
            output=result.output,
            error=result.error,
            retryable=result.retryable,
            patch=result.patch,
        )

    def redeliver(self, result: AttemptResult) -> None:
        """A result read again after it was folded (or for a token no longer awaited): the
        store refuses a second write, so it is put back as an unfolded finished row."""
        row = self.store.tables.attempts.get(result.token)
        if row is not None:
            assert not self.store.finish(result.token, output="again"), "a second write"
            row.folded = False
            return
        self.store.tables.attempts[result.token] = AttemptRow(
            token=result.token,
            run_id=RUN,
            node=result.node,
            branch=None,
            generation=int(result.token.rsplit(":", 1)[1]),
            attempt=1,
            step=f"step_{result.node}",
            queue=None,
            args={},
            timeout=300.0,
            created_at=self.now,
            finished_at=self.now,
            finished_seq=self.store.tables.next_id("finish"),
            outcome=result.outcome,
            output=result.output,
            error=result.error,
            retryable=result.retryable,
        )

    def tick(self) -> TickPayload:
        before = self.store.state(RUN)
        assert before == self.state, "the store holds the state the last tick committed"
        before_json = json.dumps(before.to_json(), sort_keys=True)
        for node, token in needed_outputs(self.spec, before).items():
            assert before.nodes[node].status == NodeStatus.SUCCEEDED
            assert token == self.output_token[node]
        results = self.unfolded()
        version = self.store.run(RUN).record_version
        timer = self.store.tables.timers.get(RUN)
        done = self.coordinator.tick(RUN)
        payload = payload_of(done, RUN, self.spec, before, CONFIG, self.store.now)
        assert done.outcome == ("committed" if payload.changed else "noop")
        # A commit is a new version; so is a no-op tick's move of a timer row that came due
        # early (store/ticks.py: refresh_stale_timer), and nothing else.
        moved = timer is not None and timer <= self.store.now and timer != payload.next_wake_at
        bumped = payload.changed or moved
        assert self.store.run(RUN).record_version == version + (1 if bumped else 0)
        if moved and not payload.changed:
            assert self.store.tables.timers.get(RUN) == payload.next_wake_at
        assert json.dumps(before.to_json(), sort_keys=True) == before_json, "input state mutated"
        self.check_payload(before, payload, results)
        self.state = self.store.state(RUN)
        assert self.state == payload.state, "the commit stored the state the tick computed"
        assert self.unfolded() == (), "every result read was folded"
        self.ticks += 1
        return payload

    def check_payload(
        self, before: RunState, p: TickPayload, results: tuple[AttemptResult, ...]
    ) -> None:
        after = p.state
        # Every result handed in is folded, in order, whatever else happens.
        assert p.folded == [r.token for r in results]
        if results or after != before or p.new_attempts or p.dispatches or p.closed:
            assert p.changed, "a tick that has something to write must say so"
        assert after.transitions == before.transitions + len(p.transitions)

        # Terminal is absorbing.
        if before.status in TERMINAL_RUN_STATUSES:
            assert after.status == before.status
            assert after.nodes == before.nodes and after.context == before.context
            assert p.transitions == [] and p.new_attempts == [] and p.dispatches == []
            assert p.closed == [] and p.next_wake_at is None
            return

        # Transitions follow the allowed maps; nothing was refused.
        for tr in p.transitions:
            assert "refused transition" not in tr.reason, tr
            if tr.node is not None and tr.from_status != tr.to_status:
                assert NodeStatus(tr.to_status) in NODE_TRANSITIONS[NodeStatus(tr.from_status)], tr
            if (
                tr.node is not None
                and tr.to_status == NodeStatus.SUCCEEDED
                and (tr.from_status != tr.to_status)
            ):
                self.successes[tr.node] = self.successes.get(tr.node, 0) + 1
                assert self.successes[tr.node] == 1, f"{tr.node} succeeded twice"
        for node, ns in before.nodes.items():
            if ns.status in FINISHED:
                assert after.nodes[node] == ns, f"finished node {node} changed"
            elif ns.status == NodeStatus.PENDING and after.nodes[node].status != ns.status:
                self.check_reached(node, after)

        # New attempts: fresh tokens, one dispatch each, only for nodes whose deps are done.
        new_tokens = [a.token for a in p.new_attempts]
        assert len(set(new_tokens)) == len(new_tokens)
        for a in p.new_attempts:
            assert a.token not in self.attempt_node, f"token {a.token} reused"
            assert a.token == f"{RUN}:{a.node}:{a.generation}"
            ns = after.nodes[a.node]
            assert ns.status == NodeStatus.RUNNING and ns.step.token == a.token
            assert (ns.step.resends, ns.step.claimed_at, ns.step.retry_at) == (0, None, None)
            timeout = self.graph.nodes[a.node].timeout or CONFIG.default_step_timeout
            assert ns.step.resend_at == self.now + timedelta(seconds=CONFIG.resend_unclaimed_after)
            # First look: at the re-send time or one step timeout, whichever comes first.
            assert ns.step.check_at == min(ns.step.resend_at, self.now + timedelta(seconds=timeout))
            assert ns.generation == a.generation == before.nodes[a.node].generation + 1
            assert all(self.dep_done(after, d) for d in self.graph.nodes[a.node].after)
            assert [d.token for d in p.dispatches].count(a.token) == 1
            prev = before.nodes[a.node]
            if prev.status == NodeStatus.PENDING:  # a first start: arguments resolved here
                assert a.args_from is None and a.attempt == 1
                expected_deps = {
                    d: self.outputs[token_of(after.nodes[d])]
                    if after.nodes[d].status == NodeStatus.SUCCEEDED
                    else None
                    for d in self.graph.nodes[a.node].after
                }
                assert a.args == {"deps": expected_deps, "x": self.input.get("x")}
            else:  # a retry: arguments copied from the previous attempt row
                assert prev.status == NodeStatus.RUNNING and prev.step.token is None
                assert prev.step.retry_at is not None and prev.step.retry_at <= self.now
                assert a.args_from == f"{RUN}:{a.node}:{prev.generation}"
                assert a.attempt == prev.step.attempt + 1
            self.attempt_node[a.token] = a.node
        # Other dispatches are resends of an attempt in flight, keeping its token.
        for d in p.dispatches:
            if d.token in new_tokens:
                continue
            assert d.token in self.attempt_node
            assert before.nodes[d.node].step.token == after.nodes[d.node].step.token == d.token
            assert after.nodes[d.node].step.resends == before.nodes[d.node].step.resends + 1
        # Closed attempts existed before this tick and are no longer awaited.
        for c in p.closed:
            assert c.token in self.attempt_node and c.token not in new_tokens
            assert all(ns.step.token != c.token for ns in after.nodes.values())

        # Accepted outputs: set once, from a token that node was waiting on, never changed.
        for node, ns in after.nodes.items():
            if token_of(ns) is not None:
                if node in self.output_token:
                    assert token_of(ns) == self.output_token[node]
                else:
                    assert ns.status == NodeStatus.SUCCEEDED
                    assert before.nodes[node].step.token == token_of(ns)
                    self.output_token[node] = token_of(ns)
        self.check_state(after, p)

    def when_holds(self, node: str) -> bool:
        when = self.graph.nodes[node].when
        if when is None:
            return True
        value = bool(self.input.get(when.removeprefix("!$.input.").removeprefix("$.input.")))
        return not value if when.startswith("!") else value

    def check_reached(self, node: str, after: RunState) -> None:
        """A node left pending: skipped exactly when its deps were all skipped or `when` fails."""
        deps = self.graph.nodes[node].after
        assert all(self.dep_done(after, d) for d in deps), f"{node} left pending too early"
        all_skipped = bool(deps) and all(after.nodes[d].status == NodeStatus.SKIPPED for d in deps)
        status = after.nodes[node].status
        if status == NodeStatus.SKIPPED:
            assert all_skipped or not self.when_holds(node), f"{node} skipped wrongly"
        elif status == NodeStatus.RUNNING:
            assert not all_skipped and self.when_holds(node), f"{node} should have been skipped"
        else:  # a start cancelled by a run that failed in the same tick
            assert status == NodeStatus.CANCELLED and after.status == RunStatus.FAILED, status

    def check_state(self, state: RunState, p: TickPayload) -> None:
        fatal = self.fatal(state)
        all_finished = all(ns.status in FINISHED for ns in state.nodes.values())
        assert state.status != RunStatus.PENDING
        # Terminal exactly when no node can progress.
        assert (state.status in TERMINAL_RUN_STATUSES) == (bool(fatal) or all_finished)
        if state.status == RunStatus.SUCCEEDED:
            assert not fatal
            assert p.error is None
            assert all(ns.status in (DONE | {NodeStatus.FAILED}) for ns in state.nodes.values())
            assert p.output == {
                node: self.outputs[token_of(ns)] if ns.status == NodeStatus.SUCCEEDED else None
                for node, ns in state.nodes.items()
            }
        elif state.status == RunStatus.FAILED:
            assert p.error is not None and p.error["node"] in fatal
            assert not any(ns.status == NodeStatus.RUNNING for ns in state.nodes.values()), (
                "a failed run keeps nothing in flight"
            )
        if state.status in TERMINAL_RUN_STATUSES:
            assert p.next_wake_at is None
            return
        assert state.status == RunStatus.RUNNING
        running = [ns for ns in state.nodes.values() if ns.status == NodeStatus.RUNNING]
        assert running, "an open run has something in flight"
        for node, ns in state.nodes.items():
            if ns.status == NodeStatus.RUNNING:
                # In flight (token and check time) or waiting for a retry timer, never both.
                assert (ns.step.token is None) == (ns.step.check_at is None)
                assert (ns.step.token is None) != (ns.step.retry_at is None)
            if ns.status == NodeStatus.PENDING:
                assert not all(self.dep_done(state, d) for d in self.graph.nodes[node].after), (
                    f"{node} is ready but was left pending"
                )
        due = [w for ns in running for w in (ns.step.check_at, ns.step.retry_at) if w is not None]
        assert p.next_wake_at == min(due)
        # Due retries fire in the tick; a due check may wait for its claim status.
        assert all(ns.step.retry_at is None or ns.step.retry_at > self.now for ns in running)

    # --- rules ------------------------------------------------------------------------------

    @initialize(dag=dags(), x=st.integers(0, 3))
    def start(self, dag: Dag, x: int) -> None:
        self.spec = dag.spec()
        self.input = {**dag.flags, "x": x}
        assert self.store.start(self.spec, self.input, run_id=RUN) == RUN
        self.state = RunState.initial([n.id for n in dag.nodes])
        p = self.tick()
        assert p.changed
        assert p.transitions[0].node is None and p.transitions[0].to_status == RunStatus.RUNNING

    @precondition(lambda self: bool(self.awaited()) and not self.terminal())
    @rule(
        data=st.data(),
        outcome=st.sampled_from(["ok", "ok", "retryable", "fatal"]),
        patch=st.booleans(),
        wait=st.sampled_from([0, 0, 1, 3, 8]),
    )
    def deliver(self, data: st.DataObject, outcome: str, patch: bool, wait: int) -> None:
        node, token = data.draw(st.sampled_from(self.awaited()), label="awaited")
        ns = self.state.nodes[node]
        # Results arrive a little later: retry timers may come due in the same tick.
        self.store.advance(wait)
        if outcome == "ok":
            output = {"node": node, "token": token}
            result = AttemptResult(
                token,
                node,
                "succeeded",
                output=output,
                patch={f"seen_{node}": token} if patch else None,
            )
            self.outputs[token] = output
        else:
            result = AttemptResult(
                token,
                node,
                "failed",
                error={"type": "Boom", "message": f"{token} failed"},
                retryable=outcome == "retryable",
            )
        self.delivered.append(result)
        self.finish(result)
        context_before = dict(self.state.context)
        p = self.tick()
        if any(other != node for other in self.fatal(p.state)):
            return  # another node timed out for good in this tick: the terminal checks ran
        after = p.state.nodes[node]
        if outcome == "ok":
            assert after.status == NodeStatus.SUCCEEDED and token_of(after) == token
            expected = {**context_before, **(result.patch or {})}
            assert p.state.context == expected
        elif outcome == "retryable" and ns.step.attempt < self.graph.nodes[node].retry.max_attempts:
            delay = backoff_delay(self.graph.nodes[node].retry, ns.step.attempt)
            assert after.status == NodeStatus.RUNNING and after.step.token is None
            assert after.step.retry_at == self.now + timedelta(seconds=delay)
            assert after.error == result.error
        else:
            assert after.status == NodeStatus.FAILED
            assert after.error == result.error
            if not self.graph.nodes[node].continue_on_failure:
                assert p.state.status == RunStatus.FAILED

    @precondition(lambda self: bool(self.delivered))
    @rule(data=st.data())
    def deliver_duplicate(self, data: st.DataObject) -> None:
        result = data.draw(st.sampled_from(self.delivered), label="duplicate")
        self.redeliver(result)
        before = self.state
        p = self.tick()
        assert p.state.nodes == before.nodes
        assert p.state.context == before.context and p.state.status == before.status
        assert p.new_attempts == [] and p.dispatches == [] and p.closed == []

    @rule(data=st.data(), ok=st.booleans())
    def deliver_stale(self, data: st.DataObject, ok: bool) -> None:
        node = data.draw(st.sampled_from(sorted(self.state.nodes)), label="node")
        generation = data.draw(
            st.integers(0, max(self.state.nodes[node].generation - 1, 0)), label="generation"
        )
        token = f"{RUN}:{node}:{generation}"
        assert token != self.state.nodes[node].step.token
        result = AttemptResult(
            token, node, "succeeded" if ok else "failed", output="stale", retryable=False
        )
        self.redeliver(result)
        before = self.state
        p = self.tick()
        assert p.state.nodes == before.nodes
        assert p.state.context == before.context and p.state.status == before.status
        assert p.new_attempts == [] and p.dispatches == [] and p.closed == []

    @rule(
        seconds=st.sampled_from([1, 2, 5, 15, 30, 61, 130, 301, 900]),
        claims=st.lists(
            st.sampled_from(["unclaimed", "recent", "long_ago", "finished"]), min_size=7, max_size=7
        ),
    )
    def advance_time(self, seconds: int, claims: list[str]) -> None:
        """Time passes; each attempt whose check comes due was claimed a moment ago, long
        ago, not at all, or has just finished: the store's load reports it so."""
        self.store.advance(seconds)
        if self.terminal():
            assert self.tick().changed is False
            return
        kinds: dict[str, str] = {}
        for i, (node, token) in enumerate(self.awaited()):
            ns = self.state.nodes[node]
            if ns.step.check_at is None or ns.step.check_at > self.now:
                continue
            kind = claims[i]
            if token in self.claims and kind == "unclaimed":
                kind = "recent"  # a claim never goes away
            if kind in ("recent", "long_ago") and token not in self.claims:
                at = self.now - timedelta(seconds=1 if kind == "recent" else 10_000)
                assert self.store.claim(token)
                self.store.attempt(token).claimed_at = self.claims[token] = at
            elif kind == "finished":
                self.outputs[token] = {"node": node, "token": token}
                self.finish(AttemptResult(token, node, "succeeded", output=self.outputs[token]))
            kinds[node] = kind
        before = self.state
        p = self.tick()
        if p.state.status == RunStatus.FAILED and before.status == RunStatus.RUNNING:
            return  # a timed-out node spent its budget: the terminal checks already ran
        for node, kind in kinds.items():
            old, new = before.nodes[node], p.state.nodes[node]
            token = old.step.token
            assert token is not None
            if kind == "unclaimed":
                resend_due = (old.step.resend_at or old.step.check_at) <= self.now
                sent = [d.token for d in p.dispatches if d.node == node]
                assert sent == ([token] if resend_due else [])
                assert new.step.token == token and new.generation == old.generation
                if resend_due:
                    assert new.step.resends == old.step.resends + 1
                    assert new.step.resend_at == self.now + timedelta(
                        seconds=CONFIG.resend_unclaimed_after * 2**new.step.resends
                    )
                else:
                    assert (
                        new.step.resends == old.step.resends
                        and new.step.resend_at == old.step.resend_at
                    )
                timeout = self.graph.nodes[node].timeout or CONFIG.default_step_timeout
                assert new.step.check_at == min(
                    new.step.resend_at, self.now + timedelta(seconds=timeout)
                )
            elif kind == "finished":
                assert new.status == NodeStatus.SUCCEEDED and token_of(new) == token
            else:
                timeout = self.graph.nodes[node].timeout or CONFIG.default_step_timeout
                deadline = self.claims[token] + timedelta(seconds=timeout)
                timed_out = [c for c in p.closed if c.token == token]
                if deadline <= self.now:
                    assert [c.outcome for c in timed_out] == ["timed_out"]
                    assert self.store.attempt(token).outcome == "timed_out"
                    assert new.step.token != token
                else:
                    assert timed_out == [] and new.step.token == token
                    assert (
                        new.step.check_at == deadline and new.step.claimed_at == self.claims[token]
                    )

    @rule()
    def wake_up(self) -> None:
        before = self.state
        p = self.tick()
        assert p.changed is False, describe(p)
        assert p.state == before
        assert p.new_attempts == [] and p.dispatches == [] and p.transitions == []

    @rule()
    def json_round_trip(self) -> None:
        data = json.loads(json.dumps(self.state.to_json()))
        restored = RunState.from_json(data)
        assert restored == self.state
        assert restored.to_json() == self.state.to_json()
        inputs = TickInputs(
            run_id=RUN,
            input=self.input,
            outputs={n: self.outputs[t] for n, t in needed_outputs(self.spec, restored).items()},
            config=CONFIG,
        )
        later = self.now + timedelta(seconds=45)
        one = compute_tick(self.spec, self.state, inputs, later)
        two = compute_tick(self.spec, restored, inputs, later)
        assert describe(one) == describe(two)
        assert one.state == two.state

    @invariant()
    def tokens_recorded(self) -> None:
        for node, ns in getattr(self, "state", RunState()).nodes.items():
            if ns.step.token is not None:
                assert self.attempt_node.get(ns.step.token) == node
                assert self.store.attempt(ns.step.token).node == node

    def teardown(self) -> None:
        if not hasattr(self, "spec"):
            return
        # Every worker now succeeds; time moves past any retry timer. The run must finish.
        bound = 4 * len(self.spec.nodes) * 3 + 4
        for _ in range(bound):
            if self.terminal():
                break
            awaited = self.awaited()
            if awaited:
                for node, token in awaited:
                    output = {"node": node, "token": token}
                    self.outputs[token] = output
                    self.finish(AttemptResult(token, node, "succeeded", output=output))
                self.tick()
            else:
                timers = [ns.step.retry_at for ns in self.state.nodes.values() if ns.step.retry_at]
                assert timers, "an open run with nothing awaited must have a retry timer"
                self.store.advance(max(0.0, (min(timers) - self.now).total_seconds()))
                p = self.tick()
                assert p.new_attempts, "a due retry starts an attempt"
        assert self.terminal(), f"run not finished after {bound} ticks: {self.state}"
        assert (self.state.status == RunStatus.FAILED) == bool(self.fatal(self.state))


TickMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestTickMachine = TickMachine.TestCase
