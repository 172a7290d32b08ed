"""Phase 2: settle the run. Fail it on a fatal node, start ready nodes, finish it when done."""

from __future__ import annotations

from datetime import datetime

from ..definition.paths import Scope, resolve
from ..definition.spec import StepNodeSpec
from .advance import lease_key_for, start_attempt
from .context import TickContext
from .external import park_node
from .inputs import ClosedAttempt
from .payloads import json_problem
from .status import FINISHED_NODE_STATUSES, NodeStatus, RunStatus


def fail_run_on_fatal_node(t: TickContext) -> bool:
    """A failed node without continue_on_failure fails the run. Returns True if it did."""
    for node_id in t.spec.graph.order:
        ns = t.nodes[node_id]
        if ns.status == NodeStatus.FAILED and not t.spec.graph.nodes[node_id].continue_on_failure:
            error = dict(ns.error or {})
            error["node"] = node_id
            close_in_flight(t, f"run failed: node {node_id!r} failed")
            # A continue-as-new that was draining dies with the run (as on cancel), or a later
            # redrive would close the run as continued instead of running it again.
            t.payload.state.continue_pending = None
            t.payload.error = error
            t.move_run(RunStatus.FAILED, f"node {node_id!r} failed: {error.get('message', '')}")
            return True
    return False


def close_in_flight(t: TickContext, reason: str) -> None:
    """Cancel every node with an attempt in flight or a retry pending; close open attempts."""
    p = t.payload
    created = {a.token for a in p.new_attempts}
    # An attempt whose result is loaded has finished already: its row cannot be closed (the
    # conditional close would conflict on every recompute); it is folded instead.
    finished = {r.token for r in t.inputs.results}
    for node_id, ns in t.nodes.items():
        if ns.status not in (NodeStatus.RUNNING, NodeStatus.WAITING):
            continue
        if ns.token is not None:
            # Never send an attempt that is closed (a resend queued earlier in this tick); keep
            # a revoke queued for it (cancel and terminate revoke before they close).
            p.dispatches = [d for d in p.dispatches if d.token != ns.token or d.kind != "step"]
        if ns.token in created:
            # Started in this very tick: there is no row to close yet (the store closes before
            # it inserts), so never insert the attempt instead.
            p.new_attempts = [a for a in p.new_attempts if a.token != ns.token]
        elif ns.token is not None and ns.token not in finished:
            p.closed.append(
                ClosedAttempt(ns.token, "cancelled", {"type": "Cancelled", "message": reason})
            )
        ns.token = None
        ns.check_at = None
        ns.resend_at = None
        ns.retry_at = None
        ns.finished_at = t.now
        t.move_node(node_id, NodeStatus.CANCELLED, reason)


def _dependency_done(t: TickContext, dep: str) -> bool:
    status = t.nodes[dep].status
    if status in (NodeStatus.SUCCEEDED, NodeStatus.SKIPPED):
        return True
    return status == NodeStatus.FAILED and t.spec.graph.nodes[dep].continue_on_failure


def start_ready_nodes(t: TickContext) -> bool:
    """Start, park or skip every pending node whose dependencies are all done, in topological
    order. Returns True if any node moved.

    One pass suffices for skips: a node skipped here is seen as done by its dependants later in
    the order. Parked nodes that finish at once (a signal already waiting) need another pass.
    """
    moved = False
    scope = Scope(
        input=t.inputs.input, context=t.payload.state.context, outputs=t.outputs, item=None
    )
    for node_id in t.spec.graph.order:
        ns = t.nodes[node_id]
        if ns.status != NodeStatus.PENDING:
            continue
        spec = t.spec.graph.nodes[node_id]
        if not all(_dependency_done(t, dep) for dep in spec.after):
            continue
        moved = True
        if spec.after and all(t.nodes[d].status == NodeStatus.SKIPPED for d in spec.after):
            ns.finished_at = t.now
            t.move_node(node_id, NodeStatus.SKIPPED, "every dependency was skipped")
            continue
        if spec.when is not None:
            truthy = spec.when if isinstance(spec.when, bool) else resolve(spec.when, scope)
            if not truthy:
                ns.finished_at = t.now
                t.move_node(node_id, NodeStatus.SKIPPED, f"when {spec.when!r} is falsy")
                continue
        if not isinstance(spec, StepNodeSpec):
            park_node(t, node_id)
            continue
        args = resolve(spec.args, scope)
        problem = json_problem(args, "resolved arguments", t.inputs.config.max_payload_bytes)[1]
        if problem is not None:
            ns.error = {"type": "PayloadTooLarge", "message": problem}
            ns.finished_at = t.now
            t.move_node(node_id, NodeStatus.FAILED, problem)
            continue
        start_attempt(t, node_id, args, lease_key=lease_key_for(spec, scope))
        t.move_node(node_id, NodeStatus.RUNNING, f"attempt {ns.attempt} dispatched")
    return moved


def finish_if_done(t: TickContext) -> None:
    if all(ns.status in FINISHED_NODE_STATUSES for ns in t.nodes.values()):
        scope = Scope(
            input=t.inputs.input, context=t.payload.state.context, outputs=t.outputs, item=None
        )
        t.payload.output = resolve(t.spec.output, scope)
        t.move_run(RunStatus.SUCCEEDED, "every node finished")


def next_wake_at(t: TickContext) -> datetime | None:
    """The earliest check, retry or deadline. A paused run's timers fire only after resume."""
    paused = t.payload.state.status == RunStatus.PAUSED
    due: list[datetime] = []
    for ns in t.nodes.values():
        if ns.status == NodeStatus.RUNNING:
            due.extend(w for w in (ns.check_at, None if paused else ns.retry_at) if w)
        elif ns.status == NodeStatus.WAITING and ns.deadline is not None and not paused:
            due.append(ns.deadline)
    return min(due) if due else None
