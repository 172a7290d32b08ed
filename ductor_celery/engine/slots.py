"""Attempt slots, shared by step nodes (``advance``) and scatter branches (``scatter``).

An attempt lives in a *slot*: the node itself for a step node, or one in-flight branch of a
scatter. Both phases start attempts here, so neither imports the other's starting code.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from ..definition.paths import Scope, resolve
from ..definition.spec import AttemptNodeSpec
from ..limits import later
from .context import TickContext
from .inputs import Dispatch, EngineConfig, NewAttempt
from .kinds import DispatchKind
from .state import BranchState, NodeState, ScatterState, StepWork
from .status import NodeStatus

#: An attempt slot: a step node's ``StepWork``, or one in-flight branch of a scatter.
Slot = StepWork | BranchState


def slots(ns: NodeState) -> Sequence[tuple[int | None, Slot]]:
    """The attempt slots of a running node: (branch, slot); branch is None for a step node.
    A sequence, not a generator: every tick asks it of every node four times, and most
    nodes have none (on a 40-node chain's tick 21 us where generators took 27)."""
    if ns.status != NodeStatus.RUNNING:
        return ()
    work = ns.work
    if isinstance(work, ScatterState):
        return list(work.branches.items())
    if isinstance(work, StepWork) and (work.token is not None or work.retry_at is not None):
        return ((None, work),)
    return ()


def first_limit(spec: AttemptNodeSpec, cfg: EngineConfig) -> float:
    """The shortest time after a claim at which the attempt may have to be declared lost."""
    timeout = spec.timeout or cfg.default_step_timeout
    return min(timeout, spec.heartbeat_timeout or timeout)


def lease_key_for(spec: AttemptNodeSpec, scope: Scope) -> str | None:
    """The lease key of an attempt: the step's name and its resolved concurrency key.

    A key that resolves to something other than a string is keyed by its canonical JSON; a
    very long one by its hash (the column holds 500 characters).
    """
    if spec.concurrency is None:
        return None
    return scoped_key(spec.step, resolve(spec.concurrency.key, scope))


def rate_key_for(spec: AttemptNodeSpec, scope: Scope) -> str | None:
    """The rate-limit bucket of an attempt: the step's name and its resolved rate key (the
    step's name alone when the limit has no key). See docs/flow-control.md."""
    if spec.rate_limit is None:
        return None
    if spec.rate_limit.key is None:
        return spec.step
    return scoped_key(spec.step, resolve(spec.rate_limit.key, scope))


def scoped_key(step: str, value: object) -> str:
    """``"<step>|<value>"`` (a workflow's name in place of a step's for run concurrency): a
    value that is not a string by its canonical JSON, a key too long for its column (500
    characters) by its hash."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    key = f"{step}|{text}"
    if len(key) > 500:
        key = f"{step[:300]}|sha256:{hashlib.sha256(text.encode()).hexdigest()}"
    return key


def start_attempt(
    t: TickContext,
    node: str,
    args: dict[str, Any] | None,
    args_from: str | None = None,
    lease_key: str | None = None,
    branch: int | None = None,
    slot: Slot | None = None,
    rate_key: str | None = None,
    args_text: str | None = None,
) -> None:
    """Insert a new attempt under a new generation and queue its message. ``args_text``:
    ``NewAttempt.args_text``.

    Generations count per node across all its branches, so every token is unique. A retry
    (``args_from``) keeps its first attempt's arguments, lease key and rate key: the store
    copies them from that attempt's row.
    """
    if not args:  # no arguments (None): stored as {}; a retry's are copied from its first's
        args, args_text = {}, ("{}" if args_from is None else None)
    ns = t.nodes[node]
    slot = ns.step if slot is None else slot
    spec = t.attempt_spec(node)
    ns.generation += 1
    if isinstance(slot, BranchState):
        slot.generation = ns.generation
    slot.attempt += 1
    slot.token = t.token_for(node, ns.generation)
    cfg = t.inputs.config
    # First look at the re-send time or after one step timeout, whichever comes first.
    slot.resend_at = later(t.now, cfg.resend_unclaimed_after)
    slot.check_at = min(slot.resend_at, later(t.now, first_limit(spec, cfg)))
    slot.resends = 0
    slot.claimed_at = None
    slot.queued_until = None
    if spec.schedule_to_start_timeout is not None:
        # Not claimed by then (no worker took it, or it waits for a lease): it times out.
        slot.queued_until = later(t.now, spec.schedule_to_start_timeout)
        slot.check_at = min(slot.check_at, slot.queued_until)
    if ns.started_at is None:
        ns.started_at = t.now
    t.payload.new_attempts.append(
        NewAttempt(
            token=slot.token,
            node=node,
            step=spec.step,
            queue=spec.queue,
            generation=ns.generation,
            attempt=slot.attempt,
            args=args,
            args_from=args_from,
            timeout=spec.timeout or t.inputs.config.default_step_timeout,
            lease_key=lease_key,
            lease_limit=spec.concurrency.limit if spec.concurrency is not None else None,
            branch=branch,
            rate_key=rate_key,
            rate_limit=spec.rate_limit.limit if spec.rate_limit is not None else None,
            rate_period=float(spec.rate_limit.period) if spec.rate_limit is not None else None,
            args_text=args_text,
        )
    )
    t.payload.dispatches.append(
        Dispatch(DispatchKind.STEP, t.inputs.run_id, node, slot.token, spec.step, spec.queue)
    )
    t.payload.changed = True
