"""A delayed start: a run inserted with ``start_at`` stays ``pending`` until then.

The client writes the run's timer row at ``start_at`` with the run (never a broker ETA), so the
sweeper wakes it when it is due. A tick before that (a lost wake-up re-sent, a control) only
applies controls: cancel and terminate end the run without it ever starting, pause parks it,
and a resume before ``start_at`` puts it back to waiting for its start.
"""

from __future__ import annotations

from datetime import datetime

from .state import RunState
from .status import RunStatus


def waiting_to_start(state: RunState, now: datetime) -> bool:
    """The run has not started and its start time has not come yet."""
    return state.status == RunStatus.PENDING and state.start_at is not None and now < state.start_at


def resumed_status(state: RunState, now: datetime, admitted: bool = True) -> RunStatus:
    """Where a resume takes a paused run: back to pending if it was paused before its delayed
    start and that start is still ahead (a run never starts before it), or before its run
    concurrency slot was granted (it waits for one again), else running."""
    if state.start_at is not None and now < state.start_at:
        return RunStatus.PENDING
    if not admitted:
        return RunStatus.PENDING
    return RunStatus.RUNNING
