"""Phase 1: advance nodes. Fold finished attempts, check in-flight ones, fire due retries."""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from typing import Any

from ..definition.paths import Scope, resolve
from ..definition.retry import backoff_delay
from ..definition.spec import StepNodeSpec
from .context import TickContext
from .inputs import AttemptResult, ClosedAttempt, Dispatch, EngineConfig, NewAttempt
from .payloads import json_problem
from .status import NodeStatus


def fold_results(t: TickContext) -> None:
    """Apply each finished attempt once; a result for a token nobody waits on is stale."""
    for result in t.inputs.results:
        t.payload.folded.append(result.token)
        t.payload.changed = True
        ns = t.nodes.get(result.node)
        if ns is None or ns.token != result.token or ns.status != NodeStatus.RUNNING:
            status = ns.status.value if ns is not None else "unknown"
            t.record(result.node, status, status, f"stale result ignored (token {result.token})")
            continue
        if result.outcome == "succeeded":
            problem = _bad_success(result, t.inputs.config.max_payload_bytes)
            if problem is None:
                _succeed(t, result)
                continue
            _fail_attempt(t, result.node, {"type": "InvalidResult", "message": problem}, False)
        else:
            error = result.error or {"type": "Error", "message": f"attempt {result.outcome}"}
            _fail_attempt(t, result.node, error, result.retryable)


def _bad_success(result: AttemptResult, limit: int) -> str | None:
    """The worker validates results; this is the coordinator's own guard against bad rows."""
    if result.patch is not None and not isinstance(result.patch, dict):
        return f"context patch must be a mapping, got {type(result.patch).__name__}"
    return json_problem([result.output, result.patch], "result", limit)[1]


def _succeed(t: TickContext, result: AttemptResult) -> None:
    ns = t.nodes[result.node]
    ns.output_token = result.token
    ns.token = None
    ns.check_at = None
    ns.resend_at = None
    ns.finished_at = t.now
    ns.error = None
    if result.patch:
        t.payload.state.context.update(result.patch)
    t.outputs[result.node] = result.output
    t.move_node(result.node, NodeStatus.SUCCEEDED, f"attempt {ns.attempt} succeeded")


def _fail_attempt(t: TickContext, node: str, error: dict[str, Any], retryable: bool) -> None:
    """One attempt failed: schedule a durable retry timer, or fail the node."""
    ns = t.nodes[node]
    spec = t.step_spec(node)
    ns.token = None
    ns.check_at = None
    ns.resend_at = None
    ns.claimed_at = None
    message = str(error.get("message", ""))
    if retryable and ns.attempt < spec.retry.max_attempts:
        delay = backoff_delay(spec.retry, ns.attempt)
        ns.retry_at = t.now + timedelta(seconds=delay)
        ns.error = error
        t.move_node(
            node,
            NodeStatus.RUNNING,
            f"attempt {ns.attempt} failed: {message}; retry in {delay:g}s",
        )
        return
    ns.error = error
    ns.finished_at = t.now
    why = "not retryable" if not retryable else f"{ns.attempt} attempts used"
    t.move_node(node, NodeStatus.FAILED, f"attempt {ns.attempt} failed ({why}): {message}")


def check_in_flight(t: TickContext) -> None:
    """Resend unclaimed attempts; time out claimed ones past their start-to-close deadline."""
    cfg = t.inputs.config
    for node, ns in t.nodes.items():
        if ns.status != NodeStatus.RUNNING or ns.token is None or ns.check_at is None:
            continue
        if ns.check_at > t.now:
            continue
        check = t.inputs.checks.get(ns.token)
        if check is None or check.finished:
            continue  # not loaded, or finished after the load: the next tick folds it
        spec = t.step_spec(node)
        timeout = spec.timeout or cfg.default_step_timeout
        if check.claimed_at is None:
            # Not claimed yet. Re-send when the re-send time is due, and look again within one
            # step timeout either way, so a claim made after this look whose worker dies is
            # timed out about one timeout after the claim, not one re-send period.
            resend_at = ns.resend_at or ns.check_at
            if resend_at <= t.now:
                ns.resends += 1
                resend_at = t.now + timedelta(seconds=cfg.resend_unclaimed_after * 2**ns.resends)
                t.payload.dispatches.append(
                    Dispatch("step", t.inputs.run_id, node, ns.token, spec.step, spec.queue)
                )
                t.record(node, ns.status, ns.status, f"attempt {ns.attempt} unclaimed: re-sent")
            ns.resend_at = resend_at
            ns.check_at = min(resend_at, t.now + timedelta(seconds=_first_limit(spec, cfg)))
            t.payload.changed = True
            continue
        deadline = check.claimed_at + timedelta(seconds=timeout)
        why = f"did not finish within {timeout:g}s of its start (worker lost or step too slow)"
        if spec.heartbeat_timeout is not None:
            last_sign = max(check.claimed_at, check.heartbeat_at or check.claimed_at)
            silent_until = last_sign + timedelta(seconds=spec.heartbeat_timeout)
            if silent_until < deadline:
                deadline = silent_until
                why = f"sent no heartbeat for {spec.heartbeat_timeout:g}s (worker lost)"
        if deadline > t.now:
            if ns.claimed_at != check.claimed_at or ns.check_at != deadline:
                ns.claimed_at = check.claimed_at
                ns.check_at = deadline
                ns.resend_at = None
                t.payload.changed = True
            continue
        error = {"type": "StepTimeout", "message": f"attempt {ns.attempt} {why}"}
        t.payload.closed.append(ClosedAttempt(ns.token, "timed_out", error))
        _fail_attempt(t, node, error, True)


def _first_limit(spec: StepNodeSpec, cfg: EngineConfig) -> float:
    """The shortest time after a claim at which the attempt may have to be declared lost."""
    timeout = spec.timeout or cfg.default_step_timeout
    return min(timeout, spec.heartbeat_timeout or timeout)


def fire_retries(t: TickContext) -> None:
    for node, ns in t.nodes.items():
        if ns.status == NodeStatus.RUNNING and ns.token is None and ns.retry_at is not None:
            if ns.retry_at <= t.now:
                ns.retry_at = None
                # A retry runs with the same arguments as the first attempt: the store copies
                # them from the previous attempt row instead of the tick re-resolving paths.
                start_attempt(t, node, None, args_from=t.token_for(node, ns.generation))
                t.record(node, ns.status, ns.status, f"attempt {ns.attempt} dispatched (retry)")


def lease_key_for(spec: StepNodeSpec, scope: Scope) -> str | None:
    """The lease key of an attempt: the step's name and its resolved concurrency key.

    A key that resolves to something other than a string is keyed by its canonical JSON; a
    very long one by its hash (the column holds 500 characters).
    """
    if spec.concurrency is None:
        return None
    value = resolve(spec.concurrency.key, scope)
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    key = f"{spec.step}|{text}"
    if len(key) > 500:
        key = f"{spec.step[:300]}|sha256:{hashlib.sha256(text.encode()).hexdigest()}"
    return key


def start_attempt(
    t: TickContext,
    node: str,
    args: dict[str, Any] | None,
    args_from: str | None = None,
    lease_key: str | None = None,
) -> None:
    """Insert a new attempt under a new generation and queue its message.

    A retry (``args_from``) keeps its first attempt's arguments and lease key: the store copies
    both from that attempt's row.
    """
    ns = t.nodes[node]
    spec = t.step_spec(node)
    ns.generation += 1
    ns.attempt += 1
    ns.token = t.token_for(node, ns.generation)
    cfg = t.inputs.config
    # First look at the re-send time or after one step timeout, whichever comes first.
    ns.resend_at = t.now + timedelta(seconds=cfg.resend_unclaimed_after)
    ns.check_at = min(ns.resend_at, t.now + timedelta(seconds=_first_limit(spec, cfg)))
    ns.resends = 0
    ns.claimed_at = None
    if ns.started_at is None:
        ns.started_at = t.now
    t.payload.new_attempts.append(
        NewAttempt(
            token=ns.token,
            node=node,
            step=spec.step,
            queue=spec.queue,
            generation=ns.generation,
            attempt=ns.attempt,
            args=args or {},
            args_from=args_from,
            timeout=spec.timeout or t.inputs.config.default_step_timeout,
            lease_key=lease_key,
            lease_limit=spec.concurrency.limit if spec.concurrency is not None else None,
        )
    )
    t.payload.dispatches.append(
        Dispatch("step", t.inputs.run_id, node, ns.token, spec.step, spec.queue)
    )
    t.payload.changed = True
