"""Bulk controls: one operator control (cancel, pause, ...) on every run that matches a
workflow, a status and a creation time. The CLI shows the count first and acts only with
``--yes``.

Each run gets the same checked control a single ``ductor cancel TARGET`` sends; a run whose
state moved on between the selection and its control is refused and counted, never half-done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from . import limits
from .call_checks import check_aware, check_id
from .client import Client
from .engine.kinds import REDRIVE_FROM_NODE_ALLOWED, ControlKind, statuses_allowing
from .engine.status import RunStatus
from .errors import InvalidOperation, RunNotFound
from .store import bulk


@dataclass(frozen=True, slots=True)
class Selection:
    kind: ControlKind
    run_ids: tuple[str, ...]


@dataclass(slots=True)
class BulkResult:
    applied: int = 0
    refused: list[tuple[str, str]] = field(default_factory=list)


def select(
    client: Client,
    kind: ControlKind | str,
    *,
    workflow: str | None = None,
    status: str | None = None,
    since: datetime | None = None,
    limit: int | None = None,
    from_node: bool = False,
) -> Selection:
    """The runs the control would act on; checks every filter first. ``from_node``: a
    redrive from a node, which any finished run allows."""
    kind = ControlKind(kind)
    if workflow is None and status is None:
        raise ValueError("a bulk control needs --workflow or --status (or both)")
    if workflow is not None:
        check_id(workflow, "workflow")
    allowed = (
        REDRIVE_FROM_NODE_ALLOWED
        if from_node and kind == ControlKind.REDRIVE
        else statuses_allowing(kind)
    )
    if status is None:
        statuses = sorted(allowed)
    else:
        try:
            chosen = RunStatus(status)
        except ValueError:
            known = ", ".join(s.value for s in RunStatus)
            raise ValueError(
                f"unknown run status {limits.show(status)} (one of: {known})"
            ) from None
        if chosen not in allowed:
            raise InvalidOperation(
                f"cannot {kind.replace('_', '-')} {chosen.value} runs "
                f"(allowed when {', '.join(sorted(s.value for s in allowed))})"
            )
        statuses = [chosen]
    if since is not None:
        if not isinstance(since, datetime) or since.tzinfo is None:
            raise ValueError("since must be an aware datetime")
        since = check_aware(since, "since")  # in UTC; ValueError past the calendar's ends
    if limit is not None:
        problem = limits.int_problem(limit, minimum=1)
        if problem is not None:
            raise ValueError(f"limit {problem}")
    run_ids = client._read(
        bulk.matching_run_ids,
        client.engine,
        workflow=workflow,
        statuses=statuses,
        since=since,
        limit=limit,
    )
    return Selection(kind=kind, run_ids=tuple(run_ids))


def apply(client: Client, selection: Selection, **options: Any) -> BulkResult:
    """Send the control to every selected run (``options``: reason; a redrive's node and
    input; a continue-as-new's input and version)."""
    result = BulkResult()
    for run_id in selection.run_ids:
        try:
            if selection.kind == ControlKind.CONTINUE_AS_NEW and "version" in options:
                client.continue_as_new(run_id, **options)
            else:
                client.control(run_id, selection.kind, **options)
        except (InvalidOperation, RunNotFound) as exc:
            result.refused.append((run_id, str(exc)))
        else:
            result.applied += 1
    return result
