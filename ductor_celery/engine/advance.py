"""Phase 1: advance nodes. Fold finished attempts, check in-flight ones, fire due retries.

An attempt lives in a *slot* (``slots.py``): the node itself for a step node, or one in-flight
branch of a scatter. Both keep the same bookkeeping (token, attempt number, check and retry
times), so every rule here (re-send, time out, retry with backoff, ignore stale results) is
written once.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Any

from ..definition.retry import backoff_delay
from ..limits import later
from ..payloads import json_problem
from . import scatter
from .context import TickContext
from .exhausted import pause_on_exhausted
from .inputs import AttemptResult, ClosedAttempt, Dispatch
from .kinds import DispatchKind
from .slots import Slot, first_limit, slots, start_attempt
from .state import AttemptOutput, BranchState, NodeState, StepWork
from .status import AttemptOutcome, NodeStatus
from .tags import apply_step_tags

#: An unclaimed attempt's re-send period doubles at most this many times (30 s * 2**40 is
#: longer than any run; a larger exponent would only overflow).
MAX_RESEND_DOUBLINGS = 40


def fold_results(t: TickContext) -> None:
    """Apply each finished attempt once; a result for a token nobody waits on is stale."""
    for result in t.inputs.results:
        t.payload.folded.append(result.token)
        t.payload.changed = True
        ns = t.nodes.get(result.node)
        slot = _waiting_on(ns, result)
        if ns is None or slot is None:
            status = ns.status.value if ns is not None else "unknown"
            t.record(result.node, status, status, f"stale result ignored (token {result.token})")
            continue
        branch = result.branch if ns.scatter is not None else None
        batched = ns.scatter is not None and ns.scatter.batch > 1 and branch is not None
        if result.outcome == AttemptOutcome.CANCELLED:
            _stopped(t, result, slot, branch)
            continue
        if result.outcome == AttemptOutcome.SUCCEEDED:
            problem = (
                None if result.checked else _bad_success(result, t.inputs.config.max_payload_bytes)
            )
            if problem is None and batched:
                assert ns.scatter is not None and branch is not None
                problem = scatter.batch_shape_problem(ns.scatter, branch, result.output)
            if problem is None:
                _succeed(t, result, slot, branch)
                continue
            attempt_failed(
                t, result.node, slot, branch, {"type": "InvalidResult", "message": problem}, False
            )
        else:
            if batched:
                assert isinstance(slot, BranchState)
                scatter.note_batch_progress(slot, result.output)
            error = result.error or {"type": "Error", "message": f"attempt {result.outcome}"}
            attempt_failed(t, result.node, slot, branch, error, result.retryable)
            if batched and slot.retry_at is None and isinstance(result.patch, dict):
                # The batch gave up: its items with a recorded output count as succeeded, so
                # their context patches (merged by the worker into this attempt's) apply.
                t.payload.state.context.update(result.patch)


def _stopped(t: TickContext, result: AttemptResult, slot: Slot, branch: int | None) -> None:
    """The step stopped on a cancel (``StepCancelled``): never a failure to retry. While the
    run's cancel is pending the slot is only cleared (the cancel closes the node); a step
    that raised it on its own fails its node without retry."""
    where = "attempt" if branch is None else f"branch {branch} attempt"
    if t.payload.state.cancel is None:
        error = result.error or {"type": "StepCancelled", "message": "the step stopped itself"}
        attempt_failed(t, result.node, slot, branch, error, False)
        return
    _clear(slot)
    status = t.nodes[result.node].status
    t.record(result.node, status, status, f"{where} {slot.attempt} stopped on the cancel")


def _waiting_on(ns: NodeState | None, result: AttemptResult) -> Slot | None:
    if ns is None:
        return None
    for _, slot in slots(ns):
        if slot.token == result.token:
            return slot
    return None


def _bad_success(result: AttemptResult, limit: int) -> str | None:
    """The worker validates results; this is the coordinator's own guard against bad rows."""
    if result.patch is not None and not isinstance(result.patch, dict):
        return f"context patch must be a mapping, got {type(result.patch).__name__}"
    # Each on its own, as the worker checked them: wrapped in a list, a result at the depth
    # limit would be one level too deep.
    return (
        json_problem(result.output, "result", limit)[1]
        or json_problem(result.patch, "context patch", limit)[1]
    )


def _succeed(t: TickContext, result: AttemptResult, slot: Slot, branch: int | None) -> None:
    _clear(slot)
    if result.patch:
        t.payload.state.context.update(result.patch)
    if result.tags:
        apply_step_tags(t, result.node, result.tags)
    if branch is not None:
        scatter.branch_succeeded(t, result.node, branch)
        return
    ns = t.nodes[result.node]
    ns.output = AttemptOutput(result.token)
    ns.finished_at = t.now
    ns.error = None
    t.outputs[result.node] = result.output
    t.move_node(result.node, NodeStatus.SUCCEEDED, f"attempt {slot.attempt} succeeded")


def _clear(slot: Slot) -> None:
    slot.token = None
    slot.check_at = None
    slot.resend_at = None
    slot.claimed_at = None
    slot.queued_until = None


def _spread(token: str | None) -> float:
    """Where in its jitter an attempt's retry falls: fixed by the failed attempt's token (a
    uniform fraction of its hash), so recomputing a tick gives the same retry time."""
    if token is None:
        return 0.5
    return int.from_bytes(hashlib.sha256(token.encode()).digest()[:8], "big") / 2**64


def attempt_failed(
    t: TickContext,
    node: str,
    slot: Slot,
    branch: int | None,
    error: dict[str, Any],
    retryable: bool,
) -> None:
    """One attempt failed: schedule a durable retry timer, or give the node (or branch) up."""
    spec = t.attempt_spec(node)
    failed_token = slot.token
    _clear(slot)
    if isinstance(slot, StepWork):
        t.nodes[node].error = error
    else:
        slot.error = error
    message = str(error.get("message", ""))
    where = "attempt" if branch is None else f"branch {branch} attempt"
    if retryable and slot.attempt < spec.retry.max_attempts:
        delay = backoff_delay(spec.retry, slot.attempt, _spread(failed_token))
        slot.retry_at = later(t.now, delay)
        t.move_node(
            node,
            NodeStatus.RUNNING,
            f"{where} {slot.attempt} failed: {message}; retry in {delay:g}s",
        )
        return
    why = "not retryable" if not retryable else f"{slot.attempt} attempts used"
    if branch is not None:
        scatter.branch_failed(t, node, branch, error, f"{where} {slot.attempt} failed ({why})")
        return
    t.nodes[node].finished_at = t.now
    t.move_node(node, NodeStatus.FAILED, f"attempt {slot.attempt} failed ({why}): {message}")
    if retryable and spec.retry.on_exhausted == "pause":
        pause_on_exhausted(t, node)


def check_in_flight(t: TickContext) -> None:
    """Resend unclaimed attempts; time out claimed ones past their start-to-close deadline."""
    for node, ns in t.nodes.items():
        for branch, slot in slots(ns):
            if slot.token is not None and slot.check_at is not None and slot.check_at <= t.now:
                _check_slot(t, node, slot, branch)


def _check_slot(t: TickContext, node: str, slot: Slot, branch: int | None) -> None:
    assert slot.token is not None and slot.check_at is not None
    check = t.inputs.checks.get(slot.token)
    if check is None or check.finished:
        return  # not loaded, or finished after the load: the next tick folds it
    cfg = t.inputs.config
    spec = t.attempt_spec(node)
    timeout = spec.timeout or cfg.default_step_timeout
    where = "attempt" if branch is None else f"branch {branch} attempt"
    if check.claimed_at is None and slot.queued_until is not None:
        if slot.queued_until <= t.now:
            _not_started_in_time(t, node, slot, branch, check.lease_waiting)
            return
    if check.claimed_at is None and check.lease_waiting:
        # Waiting for a lease: whoever frees one sends the message. Look again after one
        # step timeout (the sweeper re-sends a granted message that got lost).
        slot.resends = 0
        slot.resend_at = None
        slot.check_at = _no_later_than_queued(slot, later(t.now, first_limit(spec, cfg)))
        t.payload.changed = True
        return
    if check.claimed_at is None:
        # Not claimed yet. Re-send when the re-send time is due, and look again within one
        # step timeout either way, so a claim made after this look whose worker dies is
        # timed out about one timeout after the claim, not one re-send period.
        resend_at = slot.resend_at or slot.check_at
        if resend_at <= t.now:
            slot.resends += 1
            # The exponent is capped: 2**1100 is too large a float (later() saturates anyway).
            resend_at = later(
                t.now, cfg.resend_unclaimed_after * 2.0 ** min(slot.resends, MAX_RESEND_DOUBLINGS)
            )
            t.payload.dispatches.append(
                Dispatch(
                    DispatchKind.STEP, t.inputs.run_id, node, slot.token, spec.step, spec.queue
                )
            )
            status = t.nodes[node].status
            t.record(node, status, status, f"{where} {slot.attempt} unclaimed: re-sent")
        slot.resend_at = resend_at
        slot.check_at = _no_later_than_queued(
            slot, min(resend_at, later(t.now, first_limit(spec, cfg)))
        )
        t.payload.changed = True
        return
    if slot.queued_until is not None:
        slot.queued_until = None  # claimed in time: the start-to-close rules apply now
        t.payload.changed = True
    deadline = later(check.claimed_at, timeout)
    why = f"did not finish within {timeout:g}s of its start (worker lost or step too slow)"
    silent = False
    if spec.heartbeat_timeout is not None:
        last_sign = max(check.claimed_at, check.heartbeat_at or check.claimed_at)
        silent_until = later(last_sign, spec.heartbeat_timeout)
        if silent_until < deadline:
            deadline = silent_until
            why = f"sent no heartbeat for {spec.heartbeat_timeout:g}s (worker lost)"
            silent = True
    if deadline > t.now:
        if slot.claimed_at != check.claimed_at or slot.check_at != deadline:
            slot.claimed_at = check.claimed_at
            slot.check_at = deadline
            slot.resend_at = None
            t.payload.changed = True
        return
    error = {"type": "StepTimeout", "message": f"{where} {slot.attempt} {why}"}
    t.payload.closed.append(
        ClosedAttempt(slot.token, AttemptOutcome.TIMED_OUT, error, step=spec.step, lost=silent)
    )
    attempt_failed(t, node, slot, branch, error, True)


def _generation(ns: NodeState, slot: Slot) -> int:
    """The generation of a slot's latest attempt (a step node's is the node's own)."""
    return slot.generation if isinstance(slot, BranchState) else ns.generation


def _no_later_than_queued(slot: Slot, check_at: datetime) -> datetime:
    """An unclaimed attempt is looked at again by its schedule-to-start deadline at the latest."""
    return check_at if slot.queued_until is None else min(check_at, slot.queued_until)


def _not_started_in_time(
    t: TickContext, node: str, slot: Slot, branch: int | None, lease_waiting: bool
) -> None:
    """Schedule-to-start: nobody claimed the attempt in time. Closed as timed out (the commit
    withdraws it from its lease queue, if it waited for one) and retried per the policy."""
    assert slot.token is not None
    spec = t.attempt_spec(node)
    where = "attempt" if branch is None else f"branch {branch} attempt"
    why = "waited for a concurrency lease" if lease_waiting else "no worker claimed it"
    error = {
        "type": "ScheduleToStartTimeout",
        "message": (
            f"{where} {slot.attempt} was not started within "
            f"{spec.schedule_to_start_timeout:g}s of its dispatch ({why})"
        ),
    }
    t.payload.closed.append(
        ClosedAttempt(slot.token, AttemptOutcome.TIMED_OUT, error, step=spec.step)
    )
    attempt_failed(t, node, slot, branch, error, True)


def fire_retries(t: TickContext) -> None:
    for node, ns in t.nodes.items():
        for branch, slot in slots(ns):
            if slot.token is None and slot.retry_at is not None and slot.retry_at <= t.now:
                slot.retry_at = None
                # A retry runs with the same arguments as the first attempt: the store copies
                # them from the previous attempt row instead of the tick re-resolving paths.
                start_attempt(
                    t,
                    node,
                    None,
                    args_from=t.token_for(node, _generation(ns, slot)),
                    branch=branch,
                    slot=slot,
                )
                where = "attempt" if branch is None else f"branch {branch} attempt"
                t.record(node, ns.status, ns.status, f"{where} {slot.attempt} dispatched (retry)")
