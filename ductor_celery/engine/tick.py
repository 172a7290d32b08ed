"""compute_tick: one pure step of a run. No clock, no IO, no randomness, no exceptions.

advance (fold results, check in-flight attempts, fire due retries)
  -> settle (fail the run on a fatal node, or start ready nodes, or finish)
  -> schedule the next wake-up
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ..definition.blobrefs import BlobValues
from ..definition.spec import WorkflowSpec
from .advance import check_in_flight, fire_retries, fold_results
from .cancel import settle_cancel
from .children import absorb_subworkflows
from .compensation import (
    compensating,
    compensation_reads,
    draining,
    drive_compensation,
    stop_compensating,
)
from .context import TickContext
from .controls import apply_control, maybe_continue_as_new, request_auto_continue
from .deadline import time_out_if_due
from .delay import waiting_to_start
from .external import absorb_external
from .inputs import Dispatch, TickInputs, TickPayload
from .kinds import DispatchKind
from .scatter import drive_scatters
from .schedule import fail_run_on_fatal_node, finish_if_done, next_wake_at, start_ready_nodes
from .state import AttemptOutput, NodeState, RunState
from .status import TERMINAL_RUN_STATUSES, NodeStatus, RunStatus


def compute_tick(
    definition: WorkflowSpec, state: RunState, inputs: TickInputs, now: datetime
) -> TickPayload:
    """Decide what the run does next. The input ``state`` is never modified."""
    payload = TickPayload(state=state.copy())
    t = TickContext(
        spec=definition,
        inputs=inputs,
        now=now,
        payload=payload,
        blobs=BlobValues(inputs.blobs, inputs.items),
    )
    t.outputs.update(inputs.outputs)
    _ensure_nodes(t)
    # A workflow with compensations folds the outcomes already written before a control or
    # the deadline closes anything: a step (or a compensation) that succeeded did change the
    # world, and recording it as cancelled would lose the charge to undo (or undo it twice
    # after a redrive). Runs without compensations keep the old order.
    folded_first = bool(definition.graph.compensations) and payload.state.status in (
        RunStatus.RUNNING,
        RunStatus.PAUSED,
    )
    if folded_first:
        fold_results(t)
    apply_control(t)
    time_out_if_due(t)  # before anything else moves: past its deadline nothing new starts
    if payload.state.status in TERMINAL_RUN_STATUSES:
        # Late results for a finished run are folded so nobody wakes the run for them again.
        for result in () if folded_first else inputs.results:
            payload.folded.append(result.token)
            payload.changed = True
        return _finish(t)
    if waiting_to_start(payload.state, now):
        return _finish(t)  # a delayed start: its timer row wakes it at start_at
    if payload.state.status == RunStatus.PENDING and not inputs.admitted:
        _wait_for_a_slot(t)
        return _finish(t)
    if payload.state.status == RunStatus.PENDING:
        t.move_run(RunStatus.RUNNING, "started")
    if not folded_first:
        fold_results(t)
    check_in_flight(t)
    if compensating(payload.state):
        # Undoing succeeded nodes (engine/compensation.py): nothing else moves; while it
        # drains attempts in flight no retry fires (their effect would not be undone).
        if payload.state.status == RunStatus.RUNNING and not draining(payload.state):
            fire_retries(t)
        drive_compensation(t)
        return _finish(t)
    if payload.state.cancel is not None:
        settle_cancel(t)  # a cancel waiting for attempts to stop: nothing else moves
        return _finish(t)
    if fail_run_on_fatal_node(t):
        return _finish(t)
    request_auto_continue(t)
    if payload.state.continue_pending is not None:
        maybe_continue_as_new(t)  # nothing new starts while attempts in flight drain
        return _finish(t)
    if payload.state.status == RunStatus.PAUSED:
        return _finish(t)  # results are folded; nothing is dispatched, no timer fires
    fire_retries(t)
    # Starting nodes can fail one (arguments too large), and parked nodes can finish at once
    # on signals that were already waiting: settle until nothing moves.
    for _ in range(len(t.nodes) + 1):
        moved = drive_scatters(t)
        moved = start_ready_nodes(t) or moved
        moved = absorb_external(t) or moved
        moved = absorb_subworkflows(t) or moved
        if not moved:
            break
    if not fail_run_on_fatal_node(t):
        finish_if_done(t)
    return _finish(t)


def _ensure_nodes(t: TickContext) -> None:
    for node_id in t.spec.graph.order:
        if node_id not in t.nodes:
            t.nodes[node_id] = NodeState()


def _wait_for_a_slot(t: TickContext) -> None:
    """Run concurrency: the run has no slot of its key. ``cancel_newest`` ends it at once;
    otherwise it stays pending (the commit that ends a holder grants it one and wakes it), and
    the holders asked to cancel for it (``cancel_in_progress``) are woken."""
    for run_id in t.inputs.wake:
        t.payload.dispatches.append(Dispatch(DispatchKind.WAKEUP, run_id, "", "", "", None))
        t.payload.changed = True
    refused = t.inputs.refused
    if refused is not None:
        t.payload.error = {"type": "RunConcurrencyLimit", "message": refused}
        t.move_run(RunStatus.CANCELLED, refused)


def _finish(t: TickContext) -> TickPayload:
    payload = t.payload
    if t.blobs.needs:
        # A path read inside a large value the load had not read: compute again with it.
        payload.needs = t.blobs.needs
    if payload.state.status in TERMINAL_RUN_STATUSES:
        payload.state.cancel = None  # ended otherwise (terminate, deadline) while cancelling
        stop_compensating(payload.state)
    payload.next_wake_at = (
        None if payload.state.status in TERMINAL_RUN_STATUSES else next_wake_at(t)
    )
    payload.state.transitions += len(payload.transitions)
    return payload


ACTIVE = frozenset({NodeStatus.RUNNING, NodeStatus.WAITING})

#: Nodes that may resolve paths this tick: pending ones, and failed or cancelled ones that a
#: redrive in this very tick puts back to pending.
READER_STATUSES = frozenset({NodeStatus.PENDING, NodeStatus.FAILED, NodeStatus.CANCELLED})


def read_nodes(definition: WorkflowSpec, state: RunState) -> set[str]:
    """Nodes whose outputs this tick may resolve: read by a would-be reader or the run output."""
    graph = definition.graph
    wanted: set[str] = set(graph.output_reads)
    for node_id, ns in state.nodes.items():
        # A running scatter reads its item list (and branch arguments) as it starts branches.
        if ns.status in READER_STATUSES or (ns.status in ACTIVE and ns.scatter):
            wanted |= graph.reads.get(node_id, frozenset())
    return wanted | compensation_reads(state)


def needed_outputs(definition: WorkflowSpec, state: RunState) -> dict[str, str]:
    """Node -> output token for every succeeded node that a pending node or the output reads.

    The loader fetches these outputs from attempt rows before computing the tick; outputs folded
    in the tick itself are available without a read.
    """
    out: dict[str, str] = {}
    for node_id in read_nodes(definition, state):
        found = state.nodes.get(node_id)
        if (
            found is not None
            and found.status == NodeStatus.SUCCEEDED
            and isinstance(found.output, AttemptOutput)
        ):
            out[node_id] = found.output.token
    return out


def describe(payload: TickPayload) -> dict[str, Any]:
    """A compact, JSON-friendly summary of a payload, for golden tests and debugging."""
    return {
        "status": payload.state.status.value,
        "nodes": {k: v.status.value for k, v in payload.state.nodes.items()},
        "new_attempts": [a.token for a in payload.new_attempts],
        "closed": [(c.token, c.outcome) for c in payload.closed],
        "folded": list(payload.folded),
        "dispatches": [d.token for d in payload.dispatches],
        "transitions": [
            (tr.node, tr.from_status, tr.to_status, tr.reason) for tr in payload.transitions
        ],
        "next_wake_at": payload.next_wake_at.isoformat() if payload.next_wake_at else None,
        "output": payload.output,
        "error": payload.error,
    }
