"""Phase 0: drain one operator control, and continue-as-new (explicit or automatic)."""

from __future__ import annotations

import hashlib

from .advance import slots
from .context import TickContext
from .inputs import ControlIn, HandledControl, SuccessorRun
from .schedule import close_in_flight
from .state import NodeState, RunState
from .status import NodeStatus, RunStatus

OPEN = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.PAUSED)
REDRIVABLE = (RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.TERMINATED)


def apply_control(t: TickContext) -> None:
    control = t.inputs.control
    if control is None:
        return
    problem = _problem(t.payload.state.status, control)
    if problem is not None:
        t.payload.handled_control = HandledControl(control.id, f"rejected: {problem}")
        t.record(
            None,
            t.payload.state.status,
            t.payload.state.status,
            f"{control.kind} rejected: {problem}",
        )
        return
    t.payload.handled_control = HandledControl(control.id, "applied")
    reason = f"{control.kind}" + (f": {control.reason}" if control.reason else "")
    state = t.payload.state
    if control.kind == "pause":
        t.move_run(RunStatus.PAUSED, reason)
    elif control.kind == "resume":
        t.move_run(RunStatus.RUNNING, reason)
    elif control.kind in ("cancel", "terminate"):
        revoke_and_close(t, reason)
        state.continue_pending = None
        t.payload.error = {"type": control.kind.capitalize(), "message": reason}
        t.move_run(
            RunStatus.CANCELLED if control.kind == "cancel" else RunStatus.TERMINATED, reason
        )
    elif control.kind == "redrive":
        _redrive(t, reason)
    elif control.kind == "continue_as_new":
        state.continue_pending = {"input": control.input, "has_input": control.has_input}
        t.record(None, state.status, state.status, f"{reason}: draining attempts in flight")


def _problem(status: RunStatus, control: ControlIn) -> str | None:
    kind = control.kind
    if kind == "pause" and status not in (RunStatus.PENDING, RunStatus.RUNNING):
        return f"run is {status.value}, only a running run can be paused"
    if kind == "resume" and status != RunStatus.PAUSED:
        return f"run is {status.value}, only a paused run can be resumed"
    if kind in ("cancel", "terminate") and status not in OPEN:
        return f"run is already {status.value}"
    if kind == "redrive" and status not in REDRIVABLE:
        return f"run is {status.value}; only failed, cancelled or terminated runs can be redriven"
    if kind == "continue_as_new" and status not in OPEN:
        return f"run is {status.value}, only a running or paused run can continue as new"
    if kind not in ("pause", "resume", "cancel", "terminate", "redrive", "continue_as_new"):
        return f"unknown control {kind!r}"
    return None


def revoke_and_close(t: TickContext, reason: str) -> None:
    """Close every open attempt and parked node; ask workers to drop attempts in flight."""
    close_in_flight(t, reason, revoke=True)


def _redrive(t: TickContext, reason: str) -> None:
    """Failed, cancelled and pending nodes run again, each with a fresh retry budget."""
    for node_id, ns in t.nodes.items():
        if ns.status in (NodeStatus.FAILED, NodeStatus.CANCELLED):
            t.nodes[node_id] = NodeState(generation=ns.generation)
            t.record(node_id, ns.status, NodeStatus.PENDING, reason)
    t.payload.reopened = True
    t.payload.error = None
    t.move_run(RunStatus.RUNNING, reason)


def request_auto_continue(t: TickContext) -> None:
    """Past ductor_max_transitions a run continues as new, carrying everything finished."""
    state = t.payload.state
    limit = t.inputs.config.max_transitions
    if state.status == RunStatus.PAUSED:
        return  # the successor would start running: wait for resume
    if any(ns.status == NodeStatus.RUNNING and ns.scatter for ns in t.nodes.values()):
        # A running scatter is not carried (it would start over in the successor, and a big
        # one could exhaust the budget again): continue once it has gathered.
        return
    if state.continue_pending is None and state.transitions + len(t.payload.transitions) >= limit:
        state.continue_pending = {"input": None, "has_input": False}
        t.record(None, state.status, state.status, f"{limit} transitions: continuing as new")


def maybe_continue_as_new(t: TickContext) -> bool:
    """Close the run as continued once nothing is in flight. Returns True if it did."""
    state = t.payload.state
    pending = state.continue_pending
    if pending is None:
        return False
    if any(slot.token is not None for ns in t.nodes.values() for _, slot in slots(ns)):
        return False  # drain: let attempts in flight finish and be folded first
    successor_id = hashlib.sha256(f"{t.inputs.run_id}:continued".encode()).hexdigest()[:32]
    if pending.get("has_input"):
        new_state = RunState.initial(t.spec.graph.order)
        new_input = pending.get("input")
    else:
        new_state = _carried(t)
        new_input = t.inputs.input
    t.payload.successor = SuccessorRun(run_id=successor_id, state=new_state, input=new_input)
    # Child runs carried to the successor keep running: no parent-close for them. Starting
    # over with new input carries nothing, so its children are closed like any parent's.
    close_in_flight(t, "continued as new", children=bool(pending.get("has_input")))
    state.continue_pending = None
    t.move_run(RunStatus.CONTINUED, f"continued as {successor_id}")
    return True


def _carried(t: TickContext) -> RunState:
    """The successor keeps the context and every finished node, so no finished step reruns.

    Parked nodes stay parked: their deadline keeps counting and the events an event set already
    consumed stay received (those signals are applied and would never come again).
    """
    carried = RunState.initial(t.spec.graph.order)
    carried.context = dict(t.payload.state.context)
    for node_id, ns in t.nodes.items():
        done = ns.status in (NodeStatus.SUCCEEDED, NodeStatus.SKIPPED, NodeStatus.WAITING) or (
            ns.status == NodeStatus.FAILED and t.spec.graph.nodes[node_id].continue_on_failure
        )
        if done:
            kept = ns.copy()  # a copy: the predecessor's own node is closed below
            kept.token = None
            kept.check_at = None
            kept.resend_at = None
            kept.retry_at = None
            carried.nodes[node_id] = kept
    return carried
