"""The engine's closed vocabulary besides statuses: what a dispatch asks for, which operator
controls exist, which of them each run status allows, and what a handled control records.

Every value is stored as its string in the database (``eec_workflow_outbox.kind``,
``eec_workflow_control.kind`` and ``.result``), the same strings as before these enums existed:
no migration. A row may hold a kind this version does not know (written by a newer ductor):
``parse`` keeps it as the raw string, and whoever acts on it logs or rejects it, never crashes.
"""

from __future__ import annotations

import enum
from enum import StrEnum
from typing import NewType, Self

from .status import TERMINAL_RUN_STATUSES, RunStatus


class StoredKind(StrEnum):
    """A kind stored as its value. Has no members itself: the kinds below subclass it."""

    @classmethod
    def parse(cls, value: str) -> Self | str:
        """The member a stored value names, or the value itself if this version does not know
        it (the caller logs or rejects it)."""
        try:
            return cls(value)
        except ValueError:
            return value


class DispatchKind(StoredKind):
    """What a dispatch intent (``Dispatch``, an outbox row) asks the dispatcher to do."""

    STEP = "step"  #: send the step message of an attempt (its token is the task id)
    REVOKE = "revoke"  #: drop a closed attempt's message if it is still queued
    WAKEUP = "wakeup"  #: send a run a ``ductor.tick`` (the run itself, a parent, a child)


class ControlKind(StoredKind):
    """An operator control, queued by a client (or a parent closing its child runs) and
    applied by the coordinator, one per tick."""

    PAUSE = "pause"  #: dispatch nothing new until resumed; attempts in flight finish
    RESUME = "resume"  #: a paused run goes on
    CANCEL = "cancel"  #: close the run as cancelled, revoking and closing what is in flight
    TERMINATE = "terminate"  #: as cancel, and the run ends as terminated
    REDRIVE = "redrive"  #: reopen a failed, cancelled or terminated run: unfinished nodes rerun
    CONTINUE_AS_NEW = "continue_as_new"  #: close the run once drained, in favour of a successor


#: Allowed in every open run.
_WHILE_OPEN = frozenset({ControlKind.CANCEL, ControlKind.TERMINATE, ControlKind.CONTINUE_AS_NEW})
#: Allowed in a finished run that can be reopened.
_REDRIVE = frozenset({ControlKind.REDRIVE})

#: Which controls a run in each status accepts: the one table both the client (refusing a
#: control up front with ``InvalidOperation``) and the coordinator (rejecting one whose run
#: moved on before it was applied) read.
CONTROL_ALLOWED: dict[RunStatus, frozenset[ControlKind]] = {
    RunStatus.PENDING: _WHILE_OPEN | {ControlKind.PAUSE},
    RunStatus.RUNNING: _WHILE_OPEN | {ControlKind.PAUSE},
    RunStatus.PAUSED: _WHILE_OPEN | {ControlKind.RESUME},
    RunStatus.SUCCEEDED: frozenset(),
    RunStatus.FAILED: _REDRIVE,
    RunStatus.CANCELLED: _REDRIVE,
    RunStatus.TERMINATED: _REDRIVE,
    RunStatus.CONTINUED: frozenset(),  # its successor is the run to control
    RunStatus.TIMED_OUT: _REDRIVE,  # redriven like a failed run (with a fresh deadline)
}


#: A redrive from a node (``redrive(t, from_node=...)``) reopens any finished run, a succeeded
#: one too, but a continued one: its successor is the run to redrive.
REDRIVE_FROM_NODE_ALLOWED: frozenset[RunStatus] = TERMINAL_RUN_STATUSES - {RunStatus.CONTINUED}


def statuses_allowing(kind: ControlKind) -> frozenset[RunStatus]:
    """The run statuses in which ``kind`` is allowed (``CONTROL_ALLOWED`` read the other way)."""
    return frozenset(s for s, kinds in CONTROL_ALLOWED.items() if kind in kinds)


#: What a handled control row records (``eec_workflow_control.result``): ``CONTROL_APPLIED``,
#: or ``"rejected: <why>"`` made by ``control_rejected`` and read by ``rejection_of``.
ControlResult = NewType("ControlResult", str)

CONTROL_APPLIED = ControlResult("applied")
_REJECTED = "rejected: "


def control_rejected(why: str) -> ControlResult:
    """The result of a control the run's state did not allow."""
    return ControlResult(f"{_REJECTED}{why}")


def rejection_of(result: str | None) -> str | None:
    """Why a handled control was rejected; ``None`` if it was applied (or is not handled)."""
    if result is not None and result.startswith(_REJECTED):
        return result[len(_REJECTED) :]
    return None


# -- the audit log (docs/operations.md, "Who did what") ------------------------------------


class AuditAction(enum.StrEnum):
    START = "start"
    PAUSE = "pause"
    RESUME = "resume"
    CANCEL = "cancel"
    TERMINATE = "terminate"
    REDRIVE = "redrive"
    CONTINUE_AS_NEW = "continue_as_new"
    SIGNAL = "signal"
    APPROVE = "approve"
    REJECT = "reject"
    SCHEDULE = "schedule"
    UNSCHEDULE = "unschedule"
    PRUNE = "prune"


class AuditSource(enum.StrEnum):
    #: A Python call (the default).
    API = "api"
    #: The ``ductor`` command.
    CLI = "cli"
    #: The web console (the actor is the acting token's name).
    WEB = "web"
    #: A bulk control: one entry per run it acted on.
    BULK = "bulk"
    #: A schedule's fire (the actor is the schedule's name).
    SCHEDULE = "schedule"
    #: A parent run's tick: a child it started, its parent_close control on a child.
    PARENT = "parent"
    #: Run concurrency's ``cancel_in_progress``: the cancel of the oldest open run of a key,
    #: asked by a newer run's first tick (docs/flow-control.md; the actor is "ductor").
    CONCURRENCY = "concurrency"


#: Entries of these sources outlive the runs they name until ``ductor_audit_retention_days``.
KEPT_PAST_THEIR_RUN = frozenset({AuditSource.BULK})
