"""Phase 0: drain one operator control, and continue-as-new (explicit or automatic)."""

from __future__ import annotations

import hashlib

from .cancel import request_cancel
from .context import TickContext
from .deadline import hard_revokes
from .delay import resumed_status
from .inputs import HandledControl, SuccessorRun
from .kinds import CONTROL_ALLOWED, CONTROL_APPLIED, ControlKind, control_rejected
from .schedule import close_in_flight
from .slots import slots
from .state import NodeState, RunState
from .status import NodeStatus, RunStatus

#: Why a control is rejected, by kind, when ``CONTROL_ALLOWED`` says the run's status does not
#: allow it (the run moved on between the client's check and this tick).
_REFUSED: dict[ControlKind, str] = {
    ControlKind.PAUSE: "run is {status}, only a running run can be paused",
    ControlKind.RESUME: "run is {status}, only a paused run can be resumed",
    ControlKind.CANCEL: "run is already {status}",
    ControlKind.TERMINATE: "run is already {status}",
    ControlKind.REDRIVE: (
        "run is {status}; only failed, cancelled or terminated runs can be redriven"
    ),
    ControlKind.CONTINUE_AS_NEW: (
        "run is {status}, only a running or paused run can continue as new"
    ),
}


def apply_control(t: TickContext) -> None:
    control = t.inputs.control
    if control is None:
        return
    status = t.payload.state.status
    problem = control_problem(status, control.kind)
    if problem is not None:
        t.payload.handled_control = HandledControl(control.id, control_rejected(problem))
        t.record(None, status, status, f"{control.kind} rejected: {problem}")
        return
    kind = ControlKind(control.kind)  # a known kind: control_problem rejects the others
    t.payload.handled_control = HandledControl(control.id, CONTROL_APPLIED)
    reason = f"{kind}" + (f": {control.reason}" if control.reason else "")
    state = t.payload.state
    if kind == ControlKind.PAUSE:
        t.move_run(RunStatus.PAUSED, reason)
    elif kind == ControlKind.RESUME:
        t.move_run(resumed_status(state, t.now), reason)
    elif kind == ControlKind.CANCEL and request_cancel(t, reason):
        pass  # cooperative: the run closes once its attempts stop (engine/cancel.py)
    elif kind in (ControlKind.CANCEL, ControlKind.TERMINATE):
        revoke_and_close(t, reason)
        if kind == ControlKind.TERMINATE:
            hard_revokes(t)  # terminate kills steps still running; cancel lets them stop
        state.continue_pending = None
        t.payload.error = {"type": kind.capitalize(), "message": reason}
        t.move_run(
            RunStatus.CANCELLED if kind == ControlKind.CANCEL else RunStatus.TERMINATED, reason
        )
    elif kind == ControlKind.REDRIVE:
        _redrive(t, reason)
    elif kind == ControlKind.CONTINUE_AS_NEW:
        state.continue_pending = {"input": control.input, "has_input": control.has_input}
        t.record(None, state.status, state.status, f"{reason}: draining attempts in flight")


def control_problem(status: RunStatus, kind: ControlKind | str) -> str | None:
    """Why a run in ``status`` rejects a control of ``kind``; ``None`` if it accepts it."""
    known = ControlKind.parse(kind)
    if not isinstance(known, ControlKind):
        return f"unknown control {kind!r}"
    if known in CONTROL_ALLOWED[status]:
        return None
    return _REFUSED[known].format(status=status.value)


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
