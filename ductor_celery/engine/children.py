"""Child runs: sub-workflow nodes, child-run scatters, and the parent-close policy.

A child run is an ordinary run with ``parent_run_id``. The parent's tick decides to start it
(``ChildStart``, inserted in the parent's commit under a deterministic id, so a recomputed or
retried tick never starts two), reads its snapshot at load (``TickInputs.children``), and never
writes its row. The child's commit wakes the parent when the child finishes or reaches a
checkpoint. See docs/fan-out.md.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Any

from ..definition.paths import Scope, resolve
from ..definition.spec import ChildScatterNodeSpec, SubworkflowNodeSpec, WorkflowSpec
from ..limits import MAX_ID_LENGTH, later
from ..payloads import refusal
from .context import TickContext
from .inputs import ChildControl, ChildSnapshot, ChildStart, ControlIn
from .kinds import ControlKind
from .state import ChildWork, RunState, ScatterState
from .status import CHILD_MISSING, FAILED_CHILD_STATUSES, OPEN_RUN_STATUSES, NodeStatus, RunStatus


def child_run_id(run_id: str, node: str, branch: int | None, generation: int) -> str:
    """Deterministic: the same (parent, node, branch, generation) always names the same child."""
    key = f"{run_id}:{node}:{'' if branch is None else branch}:{generation}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


#: Hex digits of sha256 that end a child workflow id too long to keep whole.
_ID_DIGEST = 16


def child_workflow_id(parent_workflow_id: str, suffix: str) -> str:
    """``<parent workflow id>/<node>[i]~g``, deterministic and at most MAX_ID_LENGTH
    characters (the column's width): kept whole when it fits, otherwise a prefix of it ended
    by a digest of the whole, so two long ids differing only in their tails stay apart."""
    full = parent_workflow_id + suffix
    if len(full) <= MAX_ID_LENGTH:
        return full
    digest = hashlib.sha256(full.encode("utf-8", "surrogatepass")).hexdigest()[:_ID_DIGEST]
    return f"{full[: MAX_ID_LENGTH - _ID_DIGEST - 1]}#{digest}"


def _suffix(node: str, branch: int | None, generation: int) -> str:
    text = f"/{node}" + ("" if branch is None else f"[{branch}]")
    return text + (f"~{generation}" if generation > 1 else "")


def start_child(
    t: TickContext,
    node_id: str,
    spec: SubworkflowNodeSpec | ChildScatterNodeSpec,
    input_value: Any,
    branch: int | None,
    generation: int,
    owner: str | None = None,
) -> tuple[str | None, dict[str, Any] | None]:
    """Queue a child run for the commit: (its id, None), or (None, error) if its input is
    refused. ``owner`` is the run the ids derive from (a scatter carried over a
    continue-as-new keeps naming its children after the run it started in)."""
    value, error = refusal(input_value, "child run input", t.inputs.config.max_payload_bytes)
    if error is not None:
        return None, error
    run_id = child_run_id(owner or t.inputs.run_id, node_id, branch, generation)
    t.payload.child_starts.append(
        ChildStart(
            run_id=run_id,
            workflow=spec.workflow,
            spec_hash=spec.workflow_hash,
            input=value,
            node=node_id,
            workflow_id_suffix=_suffix(node_id, branch, generation),
        )
    )
    t.payload.changed = True
    return run_id, None


def poll_later(t: TickContext, node_id: str) -> None:
    """Look at the node's child runs again after ``child_poll_after`` at the latest."""
    _polled(t, node_id).deadline = later(t.now, t.inputs.config.child_poll_after)
    t.payload.changed = True


def _polled(t: TickContext, node_id: str) -> ChildWork | ScatterState:
    """Where a node waiting on child runs keeps its next poll: a child-run scatter's
    ``ScatterState``, a sub-workflow's ``ChildWork``."""
    ns = t.nodes[node_id]
    sc = ns.scatter
    return sc if sc is not None else ns.child


def poll_due(t: TickContext, node_id: str) -> None:
    """Still waiting when the poll came due: schedule the next one."""
    deadline = t.nodes[node_id].deadline
    if deadline is None or deadline <= t.now:
        poll_later(t, node_id)


def start_subworkflow(
    t: TickContext, node_id: str, spec: SubworkflowNodeSpec, scope: Scope
) -> None:
    ns = t.nodes[node_id]
    ns.started_at = t.now
    ns.generation += 1
    child, refused = start_child(t, node_id, spec, resolve(spec.input, scope), None, ns.generation)
    if child is None:
        ns.error = refused
        ns.finished_at = t.now
        t.move_node(node_id, NodeStatus.FAILED, f"child run not started: {ns.error}")
        return
    ns.work = ChildWork(child)
    poll_later(t, node_id)
    what = f"until checkpoint {spec.until!r}" if spec.until else "to finish"
    t.move_node(
        node_id,
        NodeStatus.WAITING,
        f"started child run {child} of {spec.workflow!r}; waiting {what}",
    )


def absorb_subworkflows(t: TickContext) -> bool:
    """Finish sub-workflow nodes whose child finished (or reached the awaited checkpoint)."""
    finished = False
    for node_id in t.spec.graph.subworkflows:
        ns = t.nodes[node_id]
        spec = t.spec.graph.nodes[node_id]
        if ns.status != NodeStatus.WAITING or not isinstance(spec, SubworkflowNodeSpec):
            continue
        snap = t.inputs.children.get(ns.child.child_run or "")
        if snap is None:
            poll_due(t, node_id)
            continue
        if spec.until is not None and spec.until in snap.checkpoints:
            ns.finished_at = t.now
            t.outputs[node_id] = snap.checkpoints[spec.until]
            t.move_node(
                node_id, NodeStatus.SUCCEEDED, f"child run reached checkpoint {spec.until!r}"
            )
        elif snap.status == RunStatus.SUCCEEDED and spec.until is None:
            ns.finished_at = t.now
            t.outputs[node_id] = snap.output
            t.move_node(node_id, NodeStatus.SUCCEEDED, f"child run {snap.run_id} succeeded")
        elif snap.status in FAILED_CHILD_STATUSES or snap.status == RunStatus.SUCCEEDED:
            ns.error = child_error(snap, spec.until)
            ns.finished_at = t.now
            t.move_node(node_id, NodeStatus.FAILED, ns.error["message"])
        else:
            poll_due(t, node_id)
            continue
        ns.child.deadline = None
        finished = True
    return finished


def child_error(snap: ChildSnapshot, until: str | None = None) -> dict[str, Any]:
    if snap.status == RunStatus.SUCCEEDED:
        message = f"child run {snap.run_id} finished without reaching checkpoint {until!r}"
    elif snap.status == CHILD_MISSING:
        message = (
            f"child run {snap.run_id} could not be started (its workflow id is taken by an "
            "open run)"
        )
    else:
        cause = (snap.error or {}).get("message", "")
        message = f"child run {snap.run_id} {snap.status}" + (f": {cause}" if cause else "")
    return {
        "type": "ChildRunFailed",
        "message": message,
        "child_run_id": snap.run_id,
        "child_error": snap.error,
    }


def checkpointed_children(spec: WorkflowSpec, state: RunState) -> dict[str, str]:
    """Child runs past the ``until=`` checkpoint their sub-workflow node waited for (child run
    id -> node): the node succeeded, and the child may still be running."""
    found: dict[str, str] = {}
    for node_id, ns in state.nodes.items():
        node = spec.graph.nodes.get(node_id)
        work = ns.work
        if (
            ns.status == NodeStatus.SUCCEEDED
            and isinstance(node, SubworkflowNodeSpec)
            and node.until is not None
            and isinstance(work, ChildWork)
            and work.child_run
        ):
            found[work.child_run] = node_id
    return found


def may_stop(state: RunState, control: ControlIn | None, now: datetime) -> bool:
    """Whether a tick with these inputs may cancel, terminate or time the run out: a cancel or
    terminate control to apply, a cancel requested earlier (it settles once nothing is in
    flight or its grace passes), or a deadline come due. Only then does parent-close reach
    the children past their checkpoint, so only then does the loader read them."""
    if control is not None and control.kind in (ControlKind.CANCEL, ControlKind.TERMINATE):
        return True
    if state.cancel is not None:
        return True
    return state.deadline_at is not None and state.deadline_at <= now


def children_to_read(
    spec: WorkflowSpec, state: RunState, *, stopping: bool
) -> dict[str, str | None]:
    """The child runs whose snapshots a tick needs (child run id -> the checkpoint awaited,
    ``None`` for none): those the run waits on (sub-workflows, child-run scatters), and, when
    the tick ``may_stop`` the run, those past their checkpoint (only their status matters:
    whether parent-close still has something to close). Both loaders read this set."""
    wanted: dict[str, str | None] = {}
    for node_id, ns in state.nodes.items():
        if ns.status != NodeStatus.WAITING:
            continue
        node = spec.graph.nodes.get(node_id)
        work = ns.work
        if isinstance(node, SubworkflowNodeSpec) and isinstance(work, ChildWork):
            if work.child_run:
                wanted[work.child_run] = node.until
        elif isinstance(node, ChildScatterNodeSpec) and ns.scatter is not None:
            wanted.update({b.token: None for b in ns.scatter.branches.values() if b.token})
    if stopping:
        for child in checkpointed_children(spec, state):
            wanted.setdefault(child, None)
    return wanted


def close_checkpointed_children(t: TickContext, reason: str) -> None:
    """Parent-close for the children past their ``until=`` checkpoint, when the run is
    cancelled, terminated or timed out: the node succeeded long ago, but the child belongs
    to the run and is closed by its node's policy as a child still awaited is. A run that
    succeeds or fails leaves them running (its nodes reached what they waited for)."""
    for child, node_id in checkpointed_children(t.spec, t.payload.state).items():
        close_child(t, node_id, child, reason)


def close_child(t: TickContext, node_id: str, child: str, reason: str) -> None:
    """Apply the node's parent-close policy to one open child run."""
    spec = t.spec.graph.nodes[node_id]
    assert isinstance(spec, SubworkflowNodeSpec | ChildScatterNodeSpec)
    snap = t.inputs.children.get(child)
    if snap is not None and snap.status not in OPEN_RUN_STATUSES:
        return  # finished already
    if spec.parent_close == "abandon":
        return
    t.payload.child_controls.append(
        ChildControl(
            child, ControlKind(spec.parent_close), f"parent run {t.inputs.run_id}: {reason}"
        )
    )
    t.payload.changed = True
