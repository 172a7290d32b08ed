"""A cooperative cancel: attempts in flight are asked to stop, then the run closes.

Terminate closes everything at once. Cancel, when attempts are in flight and
``ductor_cancel_grace`` is above zero, only *requests*: the run keeps its status with
``RunState.cancel`` set, its open attempts get ``cancel_requested_at`` (the commit writes it;
the worker reads it back with its heartbeat: ``ctx.cancelled``, ``StepCancelled``), nothing
new starts and no retry fires. Once no attempt is in flight, or the grace has passed, the run
is closed as cancelled exactly as an immediate cancel closes it (docs/operations.md).
"""

from __future__ import annotations

from datetime import datetime

from ..limits import later
from .compensation import end_or_compensate, held_for_saga
from .context import TickContext
from .schedule import close_stopped_run
from .slots import slots
from .state import RunState
from .status import RunStatus


def _in_flight(t: TickContext) -> list[str]:
    """Tokens of the attempts the run still waits on, in node order."""
    return [slot.token for ns in t.nodes.values() for _, slot in slots(ns) if slot.token]


def grace_until(state: RunState) -> datetime | None:
    """When a requested cancel stops waiting for attempts in flight (``None``: none asked)."""
    if state.cancel is None:
        return None
    return datetime.fromisoformat(str(state.cancel["grace_until"]))


def request_cancel(t: TickContext, reason: str) -> bool:
    """Ask the attempts in flight to stop. False when there is nothing to wait for (no
    attempt in flight, or no grace): the caller then closes the run at once."""
    state = t.payload.state
    if state.cancel is not None:
        t.record(None, state.status, state.status, f"{reason}: a cancel is already requested")
        return True
    grace = t.inputs.config.cancel_grace
    tokens = _in_flight(t)
    if grace <= 0 or not tokens:
        return False
    until = later(t.now, grace)
    state.cancel = {"reason": reason, "grace_until": until.isoformat()}
    t.payload.cancel_requested = tokens
    t.record(
        None,
        state.status,
        state.status,
        f"{reason}: cancel requested; {len(tokens)} attempt(s) in flight get {grace:g}s to stop",
    )
    return True


def settle_cancel(t: TickContext) -> None:
    """A requested cancel: close the run once nothing is in flight or the grace is over."""
    state = t.payload.state
    until = grace_until(state)
    assert until is not None and state.cancel is not None
    still = _in_flight(t)
    if still and t.now < until:
        return  # results are folded; nothing starts, no retry fires
    reason = str(state.cancel["reason"])
    closing = reason
    if still:
        closing = f"{reason} ({len(still)} attempt(s) still running after the grace: closed)"
    held = held_for_saga(t, RunStatus.CANCELLED)
    close_stopped_run(t, reason, keep=held)
    state.cancel = None
    state.continue_pending = None
    error = {"type": "Cancel", "message": reason}
    end_or_compensate(t, RunStatus.CANCELLED, closing, error, held)
