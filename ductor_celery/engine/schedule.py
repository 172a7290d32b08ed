"""Phase 2: settle the run. Fail it on a fatal node, start ready nodes, finish it when done."""

from __future__ import annotations

import copy
from datetime import datetime

from ..definition.paths import Scope, resolve
from ..definition.spec import (
    CheckpointNodeSpec,
    ChildScatterNodeSpec,
    ScatterNodeSpec,
    StepNodeSpec,
    SubworkflowNodeSpec,
)
from ..payloads import check_json, refusal, refusal_error
from ..values import truthy
from .children import close_checkpointed_children, close_child, start_subworkflow
from .compensation import end_or_compensate, held_for_saga, is_compensation, waits_for_output
from .context import TickContext
from .delay import waiting_to_start
from .external import park_node
from .scatter import close_branches, close_slot, start_scatter
from .slots import lease_key_for, rate_key_for, slots, start_attempt
from .state import ChildWork, LiteralOutput, StepWork
from .status import FINISHED_NODE_STATUSES, NodeStatus, RunStatus


def fail_run_on_fatal_node(t: TickContext) -> bool:
    """A failed node without continue_on_failure fails the run. Returns True if it did."""
    for node_id in t.spec.graph.order:
        ns = t.nodes[node_id]
        if isinstance(ns.work, StepWork) and ns.work.awaiting_resume:
            continue  # on_exhausted="pause": the run is paused on it (engine/exhausted.py)
        if ns.status == NodeStatus.FAILED and not t.spec.graph.nodes[node_id].continue_on_failure:
            error = dict(ns.error or {})
            error["node"] = node_id
            held = held_for_saga(t, RunStatus.FAILED)
            close_in_flight(t, f"run failed: node {node_id!r} failed", keep=held)
            # A continue-as-new that was draining dies with the run (as on cancel), or a later
            # redrive would close the run as continued instead of running it again.
            t.payload.state.continue_pending = None
            reason = f"node {node_id!r} failed: {error.get('message', '')}"
            end_or_compensate(t, RunStatus.FAILED, reason, error, held)
            return True
    return False


def close_in_flight(
    t: TickContext,
    reason: str,
    *,
    revoke: bool = False,
    children: bool = True,
    keep: set[str] | frozenset[str] = frozenset(),
) -> None:
    """Cancel every running or waiting node: close its open attempts (every branch of a
    scatter), drop pending retries, and with ``revoke`` ask workers to drop them too. Open
    child runs get their node's parent-close policy unless ``children`` is False. Nodes in
    ``keep`` stay open (a saga drains them: ``compensation.held_for_saga``)."""
    for node_id, ns in t.nodes.items():
        if ns.status not in (NodeStatus.RUNNING, NodeStatus.WAITING) or node_id in keep:
            continue
        for _, slot in slots(ns):  # a scatter's: a list of its own
            close_slot(t, node_id, slot, reason, revoke=revoke)
        if ns.scatter is not None and (children or ns.status == NodeStatus.RUNNING):
            close_branches(t, node_id, reason, revoke=revoke)
        work = ns.work
        if children and ns.status == NodeStatus.WAITING and isinstance(work, ChildWork):
            if work.child_run is not None:
                close_child(t, node_id, work.child_run, reason)
        ns.finished_at = t.now
        t.move_node(node_id, NodeStatus.CANCELLED, reason)


def close_stopped_run(
    t: TickContext, reason: str, keep: set[str] | frozenset[str] = frozenset()
) -> None:
    """What a run cancelled, terminated or timed out closes: everything in flight (attempts
    revoked) but ``keep``, and every open child run by its node's parent-close policy, a
    child past its ``until=`` checkpoint included."""
    close_in_flight(t, reason, revoke=True, keep=keep)
    close_checkpointed_children(t, reason)


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

    A walk leaves every node it did not move pending on a dependency that was not done (the
    order is topological, and starting a node changes that node only); only a node status
    moving makes one of them ready, and every move is a recorded transition (``move_node``).
    So a call with no transition recorded since the last walk ended walks nothing: the settle
    loop's last pass, in most ticks.
    """
    if t.ready_walked_at == len(t.payload.transitions):
        return False
    moved = False
    scope = Scope(
        input=t.inputs.input,
        context=t.payload.state.context,
        outputs=t.outputs,
        item=None,
        blobs=t.blobs,
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
            # truthy: a Decimal("0") in its encoded form is as false as in Python.
            when = spec.when if isinstance(spec.when, bool) else truthy(resolve(spec.when, scope))
            if not when:
                ns.finished_at = t.now
                t.move_node(node_id, NodeStatus.SKIPPED, f"when {spec.when!r} is falsy")
                continue
        if isinstance(spec, ScatterNodeSpec | ChildScatterNodeSpec):
            start_scatter(t, node_id, spec, scope)
            continue
        if isinstance(spec, SubworkflowNodeSpec):
            start_subworkflow(t, node_id, spec, scope)
            continue
        if isinstance(spec, CheckpointNodeSpec):
            _reach_checkpoint(t, node_id)
            continue
        if not isinstance(spec, StepNodeSpec):
            park_node(t, node_id)
            continue
        checked = check_json(
            resolve(spec.args, scope), "resolved arguments", t.inputs.config.max_payload_bytes
        )
        error = refusal_error(checked)
        if error is not None:
            ns.error = error
            ns.finished_at = t.now
            t.move_node(node_id, NodeStatus.FAILED, error["message"])
            continue
        start_attempt(
            t,
            node_id,
            checked.value,
            lease_key=lease_key_for(spec, scope),
            rate_key=rate_key_for(spec, scope),
            args_text=checked.text,
        )
        t.move_node(node_id, NodeStatus.RUNNING, f"attempt {ns.step.attempt} dispatched")
    t.ready_walked_at = len(t.payload.transitions)
    return moved


def _reach_checkpoint(t: TickContext, node_id: str) -> None:
    """A checkpoint succeeds when reached; its output is the context at this moment, and a
    parent waiting for it is woken by the commit."""
    ns = t.nodes[node_id]
    ns.started_at = ns.finished_at = t.now
    ns.output = LiteralOutput(copy.deepcopy(t.payload.state.context))
    t.outputs[node_id] = ns.output.value
    t.payload.checkpoint_reached = True
    t.move_node(node_id, NodeStatus.RUNNING, "checkpoint reached")
    t.move_node(node_id, NodeStatus.SUCCEEDED, "checkpoint passed")


def finish_if_done(t: TickContext) -> None:
    # Compensations (``"<node>~compensate"``) are not nodes of the graph: kept from an earlier
    # saga (a redriven run), they do not hold the run open.
    if all(
        ns.status in FINISHED_NODE_STATUSES
        for node_id, ns in t.nodes.items()
        if not is_compensation(node_id)
    ):
        scope = Scope(
            input=t.inputs.input,
            context=t.payload.state.context,
            outputs=t.outputs,
            item=None,
            blobs=t.blobs,
        )
        output, error = refusal(
            resolve(t.spec.output, scope), "run output", t.inputs.config.max_payload_bytes
        )
        if error is not None:
            # Every node succeeded, but the output they make cannot be stored (too large, or
            # nested deeper than the limit): the run fails, saying so, never half-written
            # (after undoing its nodes, if they have compensations).
            end_or_compensate(t, RunStatus.FAILED, error["message"], error)
            return
        t.payload.output = output
        t.move_run(RunStatus.SUCCEEDED, "every node finished")


def next_wake_at(t: TickContext) -> datetime | None:
    """The earliest check, retry or deadline. A paused run's timers fire only after resume,
    except the run's own deadline, which counts while paused too."""
    paused = t.payload.state.status == RunStatus.PAUSED
    due: list[datetime] = []
    if t.payload.state.deadline_at is not None:
        due.append(t.payload.state.deadline_at)
    if t.payload.state.cancel is not None:  # a cancel's grace (engine/cancel.py)
        due.append(datetime.fromisoformat(str(t.payload.state.cancel["grace_until"])))
    if waiting_to_start(t.payload.state, t.now):
        assert t.payload.state.start_at is not None
        due.append(t.payload.state.start_at)
    if t.page_due:
        due.append(t.now)  # the next page of a scatter whose page had refused branches
    for ns in t.nodes.values():
        for _, slot in slots(ns):
            due.extend(w for w in (slot.check_at, None if paused else slot.retry_at) if w)
        gathering = ns.scatter is not None and ns.scatter.gathering
        if gathering and ns.status in (NodeStatus.RUNNING, NodeStatus.WAITING) and not paused:
            due.append(t.now)  # backstop: the gather's own wake-up message could be lost
        if ns.status == NodeStatus.WAITING and ns.deadline is not None and not paused:
            due.append(ns.deadline)
    if waits_for_output(t.payload.state):
        due.append(t.now)  # backstop: the saga's own wake-up message could be lost
    return min(due) if due else None
