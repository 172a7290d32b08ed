"""Phase 0: drain one operator control, and continue-as-new (explicit or automatic)."""

from __future__ import annotations

import hashlib
from typing import Any

from ..definition.spec import WorkflowSpec
from .cancel import request_cancel
from .compensation import compensating, end_or_compensate, held_for_saga, is_compensation
from .context import TickContext
from .deadline import hard_revokes
from .delay import resumed_status
from .exhausted import rerun_exhausted
from .inputs import HandledControl, SuccessorRun
from .kinds import (
    CONTROL_ALLOWED,
    CONTROL_APPLIED,
    REDRIVE_FROM_NODE_ALLOWED,
    ControlKind,
    control_rejected,
)
from .redrive import from_node_problem, redrive
from .schedule import close_in_flight, close_stopped_run
from .slots import slots
from .state import RunState, StepWork
from .status import NodeStatus, RunStatus
from .versions import carried_into

#: Why a control is rejected, by kind, when ``CONTROL_ALLOWED`` says the run's status does not
#: allow it (the run moved on between the client's check and this tick).
_REFUSED: dict[ControlKind, str] = {
    ControlKind.PAUSE: "run is {status}, only a running run can be paused",
    ControlKind.RESUME: "run is {status}, only a paused run can be resumed",
    ControlKind.CANCEL: "run is already {status}",
    ControlKind.TERMINATE: "run is already {status}",
    ControlKind.REDRIVE: (
        "run is {status}; only failed, cancelled, terminated or timed-out runs can be redriven"
        " (a succeeded run: with from_node)"
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
    problem = control_problem(status, control.kind, control.node)
    if problem is None and control.kind == ControlKind.REDRIVE:
        problem = from_node_problem(t, control.node)
    if problem is None and compensating(t.payload.state):
        problem = compensating_problem(control.kind)
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
        rerun_exhausted(t, reason, compensations_only=compensating(state))
        t.move_run(resumed_status(state, t.now, t.inputs.admitted), reason)
    elif kind == ControlKind.CANCEL and request_cancel(t, reason):
        pass  # cooperative: the run closes once its attempts stop (engine/cancel.py)
    elif kind in (ControlKind.CANCEL, ControlKind.TERMINATE):
        # A cancel that compensates leaves compensable attempts in flight open: the saga
        # drains them first (engine/compensation.py). Terminate closes everything.
        held = held_for_saga(t, RunStatus.CANCELLED) if kind == ControlKind.CANCEL else set()
        revoke_and_close(t, reason, keep=held)
        if kind == ControlKind.TERMINATE:
            hard_revokes(t)  # terminate kills steps still running; cancel lets them stop
        state.continue_pending = None
        error = {"type": kind.capitalize(), "message": reason}
        if kind == ControlKind.CANCEL:
            end_or_compensate(t, RunStatus.CANCELLED, reason, error, held)
        else:
            t.payload.error = error
            t.move_run(RunStatus.TERMINATED, reason)
    elif kind == ControlKind.REDRIVE:
        redrive(t, control, reason + (f" from {control.node!r}" if control.node else ""))
    elif kind == ControlKind.CONTINUE_AS_NEW:
        state.continue_pending = {"input": control.input, "has_input": control.has_input}
        if control.spec_hash:  # version=: the successor runs that definition
            state.continue_pending["spec_hash"] = control.spec_hash
        t.record(None, state.status, state.status, f"{reason}: draining attempts in flight")


#: Controls a compensating run refuses: its saga runs to the end (terminate stops it).
_NOT_WHILE_COMPENSATING = frozenset({ControlKind.CANCEL, ControlKind.CONTINUE_AS_NEW})


def compensating_problem(kind: ControlKind | str) -> str | None:
    """Why a run that is compensating refuses a control of ``kind`` (``None``: it accepts it:
    pause, resume and terminate)."""
    if ControlKind.parse(kind) in _NOT_WHILE_COMPENSATING:
        return (
            "run is compensating (its compensations run to the end before it ends); "
            "terminate it to stop them"
        )
    return None


def control_problem(
    status: RunStatus, kind: ControlKind | str, node: str | None = None
) -> str | None:
    """Why a run in ``status`` rejects a control of ``kind`` (a redrive: from ``node``);
    ``None`` if it accepts it."""
    known = ControlKind.parse(kind)
    if not isinstance(known, ControlKind):
        return f"unknown control {kind!r}"
    if known == ControlKind.REDRIVE and node is not None:
        if status in REDRIVE_FROM_NODE_ALLOWED:
            return None
        return f"run is {status.value}; only a finished run can be redriven from a node"
    if known in CONTROL_ALLOWED[status]:
        return None
    return _REFUSED[known].format(status=status.value)


def revoke_and_close(
    t: TickContext, reason: str, keep: set[str] | frozenset[str] = frozenset()
) -> None:
    """Close every open attempt and parked node (but ``keep``); ask workers to drop attempts
    in flight; close the run's open children, those past their checkpoint included."""
    close_stopped_run(t, reason, keep=keep)


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
    target = _successor_spec(t, pending)
    if target is None:
        return False
    successor_id = hashlib.sha256(f"{t.inputs.run_id}:continued".encode()).hexdigest()[:32]
    if pending.get("has_input"):
        new_state = RunState.initial(target.graph.order)
        new_input = pending.get("input")
    else:
        new_state = _carried(t, target)
        new_input = t.inputs.input
    # A successor is the same workflow id going on: it keeps the run's tags (docs/tags.md).
    new_state.tags = dict(state.tags)
    moved = target.spec_hash != t.spec.spec_hash
    t.payload.successor = SuccessorRun(
        run_id=successor_id,
        state=new_state,
        input=new_input,
        spec_hash=target.spec_hash if moved else None,
        version=target.version if moved else None,
    )
    # Child runs carried to the successor keep running: no parent-close for them. Starting
    # over with new input carries nothing, so its children are closed like any parent's.
    close_in_flight(t, "continued as new", children=bool(pending.get("has_input")))
    state.continue_pending = None
    t.move_run(RunStatus.CONTINUED, f"continued as {successor_id}")
    return True


def _successor_spec(t: TickContext, pending: dict[str, Any]) -> WorkflowSpec | None:
    """The definition the successor runs: the run's own, or the one ``version=`` named. None
    (and the continue-as-new dropped, saying why) if that one was not loaded: a definition
    row deleted by hand; the client stores it before it queues the control."""
    wanted = pending.get("spec_hash")
    if not wanted or wanted == t.spec.spec_hash:
        return t.spec
    found = t.inputs.successor_spec
    if found is not None and found.spec_hash == wanted:
        return found
    state = t.payload.state
    state.continue_pending = None
    t.record(None, state.status, state.status, f"continue-as-new dropped: no definition {wanted}")
    return None


def _carried(t: TickContext, target: WorkflowSpec) -> RunState:
    """The successor keeps the context and every finished node, so no finished step reruns
    (on another definition: those it has unchanged, engine/versions.py).

    Parked nodes stay parked: their deadline keeps counting and the events an event set already
    consumed stay received (those signals are applied and would never come again).
    """
    carried = RunState.initial(t.spec.graph.order)
    carried.context = dict(t.payload.state.context)
    for node_id, ns in t.nodes.items():
        if is_compensation(node_id):
            continue  # a saga of the predecessor is not carried
        done = ns.status in (NodeStatus.SUCCEEDED, NodeStatus.SKIPPED, NodeStatus.WAITING) or (
            ns.status == NodeStatus.FAILED and t.spec.graph.nodes[node_id].continue_on_failure
        )
        if done:
            kept = ns.copy()  # a copy: the predecessor's own node is closed below
            if isinstance(kept.work, StepWork):
                kept.work.token = None
                kept.work.check_at = None
                kept.work.resend_at = None
                kept.work.retry_at = None
            carried.nodes[node_id] = kept
    if target.spec_hash == t.spec.spec_hash:
        return carried
    return carried_into(t.spec, target, carried.nodes, carried.context)
