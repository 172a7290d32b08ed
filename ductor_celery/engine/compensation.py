"""Compensation (saga): a run that would end failed (or cancelled, with
``Workflow(compensate_on_cancel=True)``) first undoes its succeeded step nodes that have
``compensate=``, one at a time, in reverse order of completion. See docs/compensation.md.

Each compensation is an ordinary attempt slot under the node id ``"<node>~compensate"`` in
``RunState.nodes`` (so folding, re-sending, timeouts and retries are the same code as a step
node's), with the compensation step's own retry policy (``TickContext.attempt_spec``). The
saga itself is ``RunState.compensation``; while it is ``active`` the run keeps its status
(``running``, or ``paused``) and nothing but compensations moves. When the last one succeeds
the run ends as it would have; when one fails for good it ends ``failed`` with both errors.
"""

from __future__ import annotations

from typing import Any

from ..definition.paths import Scope
from ..definition.spec import StepNodeSpec, compensated_node, compensation_id
from ..payloads import refusal
from .context import TickContext
from .inputs import Dispatch
from .kinds import DispatchKind
from .slots import lease_key_for, rate_key_for, start_attempt
from .state import NodeState, RunState, StepWork
from .status import NodeStatus, RunStatus

#: Run endings that compensate (a cancel only with ``compensate_on_cancel``). Terminate and a
#: run deadline stop at once and never compensate.
_COMPENSATING_ENDINGS = frozenset({RunStatus.FAILED, RunStatus.CANCELLED})


def compensating(state: RunState) -> bool:
    """True while the run is undoing its succeeded nodes."""
    return state.compensation is not None and bool(state.compensation.get("active"))


def to_compensate(t: TickContext) -> list[str]:
    """Succeeded step nodes with ``compensate=``, the last to complete first. Nodes that
    completed in the same tick (one ``finished_at``) go later-in-the-graph first."""
    position = {node_id: i for i, node_id in enumerate(t.spec.graph.order)}
    done = [
        node_id
        for node_id in t.spec.graph.order
        if t.nodes[node_id].status == NodeStatus.SUCCEEDED
        and isinstance(spec := t.spec.graph.nodes[node_id], StepNodeSpec)
        and spec.compensate is not None
    ]
    return sorted(
        done,
        key=lambda n: (t.nodes[n].finished_at or t.now, position[n]),
        reverse=True,
    )


def _wanted(t: TickContext, ending: RunStatus) -> bool:
    """Whether a run ending ``ending`` compensates at all (before looking at its nodes)."""
    if ending not in _COMPENSATING_ENDINGS or not t.spec.graph.compensations:
        return False
    return ending == RunStatus.FAILED or t.spec.compensate_on_cancel


def held_for_saga(t: TickContext, ending: RunStatus) -> set[str]:
    """Compensated step nodes with an attempt in flight when the run is about to end
    ``ending`` with a saga. The caller leaves them open (it closes everything else): their
    step may already have charged the card, so the saga waits for their outcome (bounded by
    their timeouts) and undoes them too if they succeed."""
    if not _wanted(t, ending):
        return set()
    held = set()
    for node_id in t.spec.graph.order:
        spec = t.spec.graph.nodes[node_id]
        ns = t.nodes[node_id]
        if not isinstance(spec, StepNodeSpec) or spec.compensate is None:
            continue
        if ns.status == NodeStatus.RUNNING and ns.step.token is not None:
            held.add(node_id)
    return held


def end_or_compensate(
    t: TickContext,
    ending: RunStatus,
    reason: str,
    error: dict[str, Any],
    held: set[str] | frozenset[str] = frozenset(),
) -> None:
    """The run ends ``ending`` now, unless it has compensations to run: then it starts them
    and ends when they are done (``drive_compensation``). Attempts in flight are closed by
    the caller, as for any ending, except ``held`` ones (``held_for_saga``): the saga first
    drains them, asking them to stop cooperatively, and fixes its order once they finished."""
    state = t.payload.state
    if not _wanted(t, ending) or not (held or to_compensate(t)):
        t.payload.error = error
        t.move_run(ending, reason)
        return
    state.compensation = {
        "order": [],
        "ending": ending.value,
        "reason": reason,
        "error": error,
        "active": True,
    }
    # Until the order is fixed (``_fix_order``) the saga lists the attempts it waits for.
    state.compensation["draining"] = sorted(held)
    if held:
        tokens = [t.nodes[n].step.token for n in sorted(held)]
        # As a graceful cancel does: the steps read it (ctx.cancelled, StepCancelled).
        t.payload.cancel_requested = [token for token in tokens if token is not None]
        t.record(
            None,
            state.status,
            state.status,
            f"{reason}: waiting for {len(held)} compensable attempt(s) in flight before "
            f"compensating: " + ", ".join(sorted(held)),
        )
    _leave_pause(t, reason)
    drive_compensation(t)


def _leave_pause(t: TickContext, reason: str) -> None:
    """A saga runs: a paused run moves on (an operator's cancel, or a node failing while
    paused, asks for the compensations now). A pending run (a continue-as-new successor,
    say) starts only once admitted: until then its saga waits with it, holding no slot."""
    state = t.payload.state
    if state.status == RunStatus.PAUSED or (
        state.status == RunStatus.PENDING and t.inputs.admitted
    ):
        t.move_run(RunStatus.RUNNING, f"{reason}: compensating")


def _fix_order(t: TickContext) -> bool:
    """Nothing compensable is in flight any more: fix the saga's order (or end the run as it
    would have, when nothing succeeded after all). Returns True if the saga goes on."""
    state = t.payload.state
    saga = state.compensation
    assert saga is not None
    for node_id in saga.pop("draining", []):
        ns = t.nodes[node_id]
        if ns.status == NodeStatus.RUNNING:
            # Its attempt failed and a retry waits: no effect to undo; the retry never runs.
            ns.step.retry_at = None
            ns.finished_at = t.now
            t.move_node(node_id, NodeStatus.CANCELLED, str(saga["reason"]))
    order = to_compensate(t)
    if not order:
        state.compensation = None
        t.payload.error = saga["error"]
        t.move_run(RunStatus(saga["ending"]), str(saga["reason"]))
        return False
    for node_id in order:
        cid = compensation_id(node_id)
        # Fresh for this saga; the generation is kept so a new attempt never reuses a token
        # of an earlier saga of the same run (before a redrive).
        old = t.nodes.pop(cid, None)
        t.nodes[cid] = NodeState(generation=old.generation if old is not None else 0)
    saga["order"] = order
    t.record(
        None,
        state.status,
        state.status,
        f"{saga['reason']}: compensating {len(order)} node(s) before ending "
        f"{saga['ending']}: " + ", ".join(order),
    )
    return True


def draining(state: RunState) -> bool:
    """True while the saga waits for compensable attempts in flight (nothing else runs)."""
    return compensating(state) and "draining" in (state.compensation or {})


def _in_flight(ns: NodeState) -> bool:
    return ns.status == NodeStatus.RUNNING and ns.step.token is not None


def drive_compensation(t: TickContext) -> None:
    """Move the saga on: wait for compensable attempts in flight, then for the compensation
    in flight, start the next one, or end the run. Nothing starts while the run is paused or
    pending (results are still folded)."""
    state = t.payload.state
    saga = state.compensation
    assert saga is not None
    if "draining" in saga:
        if any(_in_flight(t.nodes[n]) for n in saga["draining"]):
            return
        if not _fix_order(t):
            return
    if state.status in (RunStatus.PAUSED, RunStatus.PENDING):
        return
    for node_id in saga["order"]:
        cid = compensation_id(node_id)
        ns = t.nodes[cid]
        if ns.status == NodeStatus.SUCCEEDED:
            continue
        if ns.status in (NodeStatus.RUNNING, NodeStatus.WAITING):
            return
        if ns.status != NodeStatus.PENDING:
            _end(t, failed=node_id)
            return
        _start(t, node_id)
        return
    _end(t, failed=None)


def waits_for_output(state: RunState) -> bool:
    """The saga's next compensation could not start: its node's output was not loaded, so
    the run woke itself. ``next_wake_at`` keeps a timer due at once as the backstop of that
    wake-up message (the sweeper re-wakes the run if the message is lost)."""
    if not compensating(state) or state.status != RunStatus.RUNNING or draining(state):
        return False
    assert state.compensation is not None
    for node_id in state.compensation["order"]:
        found = state.nodes.get(compensation_id(node_id))
        if found is None:
            return False
        if found.status != NodeStatus.SUCCEEDED:
            return found.status == NodeStatus.PENDING
    return False


def _start(t: TickContext, node_id: str) -> None:
    cid = compensation_id(node_id)
    if node_id not in t.outputs:
        # The node's output is read by the next load (``compensation_reads``): wake now.
        t.payload.dispatches.append(
            Dispatch(DispatchKind.WAKEUP, t.inputs.run_id, cid, "", "", None)
        )
        t.payload.changed = True
        return
    args = {"output": t.outputs[node_id], "input": t.inputs.input}
    ns = t.nodes[cid]
    error = refusal(args, "compensation arguments", t.inputs.config.max_payload_bytes)[1]
    if error is not None:
        ns.error = error
        ns.started_at = ns.finished_at = t.now
        t.move_node(cid, NodeStatus.FAILED, error["message"])
        _end(t, failed=node_id)
        return
    spec = t.attempt_spec(cid)
    # Leases and rate limits of the compensation step apply as to any step: keys read the
    # run's input and context.
    scope = Scope(input=t.inputs.input, context=t.payload.state.context, outputs={}, item=None)
    start_attempt(
        t,
        cid,
        args,
        lease_key=lease_key_for(spec, scope),
        rate_key=rate_key_for(spec, scope),
    )
    t.move_node(cid, NodeStatus.RUNNING, f"compensating {node_id!r}: attempt 1 dispatched")


def _end(t: TickContext, failed: str | None) -> None:
    """End the run as the saga began it, or ``failed`` with both errors when the compensation
    of ``failed`` gave up (the compensations after it are not run: an operator decides)."""
    state = t.payload.state
    saga = state.compensation
    assert saga is not None
    saga["active"] = False
    ending = RunStatus(saga["ending"])
    error = dict(saga["error"] or {})
    reason = str(saga["reason"])
    if failed is None:
        t.payload.error = error
        t.move_run(ending, f"{reason} (compensated {len(saga['order'])} node(s))")
        return
    undo = t.nodes[compensation_id(failed)].error or {}
    message = (
        f"{error.get('message', '')}; then the compensation of node {failed!r} failed: "
        f"{undo.get('message', '')}"
    )
    t.payload.error = {
        "type": "CompensationFailed",
        "message": message,
        "node": error.get("node"),
        "error": error,
        "compensation": {"node": failed, "error": undo},
    }
    t.move_run(RunStatus.FAILED, message)


def stop_compensating(state: RunState) -> None:
    """The run ended otherwise (terminate, deadline) while compensating: the saga stops as it
    is; compensations not started stay ``pending`` in the view."""
    if state.compensation is not None:
        state.compensation["active"] = False


def compensation_reads(state: RunState) -> set[str]:
    """The node whose output the next compensation to start is called with: the first one
    not started yet, read while the one before it is still running, so the tick that folds
    that one's success starts it at once (in the same worker, as an inline step)."""
    if not compensating(state):
        return set()
    assert state.compensation is not None
    for node_id in state.compensation["order"]:
        found = state.nodes.get(compensation_id(node_id))
        if found is None:
            return set()
        if found.status == NodeStatus.PENDING:
            return {node_id}
        awaiting = isinstance(found.work, StepWork) and found.work.awaiting_resume
        if found.status == NodeStatus.FAILED and awaiting:
            return {node_id}  # on_exhausted="pause": the resume runs it again at once
        if found.status not in (NodeStatus.SUCCEEDED, NodeStatus.RUNNING):
            return set()  # the saga stops at a failed compensation
    return set()


def undone_nodes(state: RunState) -> list[str]:
    """Nodes whose compensation succeeded in the run's last saga: their effect was undone."""
    saga = state.compensation
    if saga is None:
        return []
    return [
        node_id
        for node_id in saga["order"]
        if (ns := state.nodes.get(compensation_id(node_id))) is not None
        and ns.status == NodeStatus.SUCCEEDED
    ]


def is_compensation(node_id: str) -> bool:
    return compensated_node(node_id) is not None
