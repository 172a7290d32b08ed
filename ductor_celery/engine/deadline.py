"""A run deadline: past ``RunState.deadline_at`` an open run ends ``timed_out``.

The deadline is a time in the state (set when the run is inserted), so no table is read to
check it: the tick compares it with ``now``, and ``next_wake_at`` keeps it as the run's timer
row, so the sweeper wakes the run at its deadline even when nothing else happens. It counts
while the run is paused too (the deadline is for the whole run, not its busy time).

Timing out closes the run as terminate does: every open attempt is closed as cancelled and
its message (and carrier) revoked with ``terminate=True`` (a step still running is stopped at
once), retry timers and parked nodes are dropped, and open child runs get their node's
parent-close policy, a child past its ``until=`` checkpoint included.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from ..limits import later
from .context import TickContext
from .kinds import DispatchKind
from .schedule import close_stopped_run
from .status import OPEN_RUN_STATUSES, RunStatus


def deadline_after(start: datetime, seconds: Any) -> datetime | None:
    """A new run's ``deadline_at``: ``seconds`` (its workflow's ``deadline``, or the one
    ``start`` was given) after ``start``; ``None`` without one. Used by every store path that
    inserts a run (a client's start, a schedule's fire time, a parent's child run)."""
    return None if seconds is None else later(start, float(seconds))


def time_out_if_due(t: TickContext) -> bool:
    """End an open run whose deadline has passed. Returns True if it did.

    A redrive in this tick (``reopened``) of a run whose deadline has passed drops the
    deadline instead: the operator asked for the run to go on, and it would otherwise time
    out again in the same tick.
    """
    state = t.payload.state
    deadline = state.deadline_at
    if deadline is not None and t.payload.reopened and deadline <= t.now:
        state.deadline_at = None
        t.record(None, state.status, state.status, "redriven past its deadline: deadline dropped")
        return False
    if deadline is None or state.status not in OPEN_RUN_STATUSES or t.now < deadline:
        return False
    reason = f"run deadline {deadline.isoformat()} passed"
    close_stopped_run(t, reason)
    hard_revokes(t)
    state.continue_pending = None
    t.payload.error = {"type": "RunTimeout", "message": reason}
    t.move_run(RunStatus.TIMED_OUT, reason)
    return True


def hard_revokes(t: TickContext) -> None:
    """Turn this tick's revokes into ``revoke(..., terminate=True)``: a step already running
    is killed, not only dropped while queued (terminate and a run deadline)."""
    t.payload.dispatches = [
        dataclasses.replace(d, terminate=True) if d.kind == DispatchKind.REVOKE else d
        for d in t.payload.dispatches
    ]
