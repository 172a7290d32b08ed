"""The audit log's vocabulary: what was done (``AuditAction``), where the request came from
(``AuditSource``), and the calling layer's word for the latter (``acting_as``).

An entry is written in the transaction of what it records (docs/operations.md, "Who did what"):
by the client for starts, signals, approvals and schedules; by the tick that applies a control;
by the pruner. Plain Python calls are ``api``; the CLI, the console, bulk controls and the
sweeper say otherwise with ``acting_as``, a context variable, so no public signature carries a
source and a thread or task never sees another's.
"""

from __future__ import annotations

import contextvars
import enum
from collections.abc import Iterator
from contextlib import contextmanager


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


#: Entries of these sources outlive the runs they name until ``ductor_audit_retention_days``.
KEPT_PAST_THEIR_RUN = frozenset({AuditSource.BULK})

_source: contextvars.ContextVar[AuditSource] = contextvars.ContextVar(
    "ductor_audit_source", default=AuditSource.API
)


def current_source() -> AuditSource:
    """The source the calling layer declared (``api`` unless one did)."""
    return _source.get()


@contextmanager
def acting_as(source: AuditSource | str) -> Iterator[None]:
    """Within the block, actions this thread (or task) takes are recorded as from ``source``."""
    token = _source.set(AuditSource(source))
    try:
        yield
    finally:
        _source.reset(token)
