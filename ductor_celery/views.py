"""What readers get: RunHandle, RunView, NodeView, RunPage and ScheduleView, frozen.

Their values (input, context, outputs) are the Python values the run was given and its steps
returned: typed values are rebuilt from their stored encoding (``ductor_celery.values``); a
model or dataclass this process has not declared (``register_type``, a step's annotations)
stays as its JSON envelope, and so does one that does not rebuild: a run can always be read
(by the CLI, the console, a dashboard without your models).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, overload

from pydantic import BaseModel, ConfigDict, field_validator

from .definition.spec import compensation_id
from .engine.state import RunState
from .engine.status import NodeStatus, RunStatus
from .values import decode_lenient


@dataclass(frozen=True, slots=True)
class RunHandle:
    run_id: str
    workflow_id: str


class NodeView(BaseModel):
    model_config = ConfigDict(frozen=True)

    status: NodeStatus
    attempts: int = 0
    output: Any = None
    error: Any = None
    started_at: datetime | None = None
    finished_at: datetime | None = None

    _typed_output = field_validator("output", mode="before")(decode_lenient)


class CompensationView(BaseModel):
    """One compensation of a run's saga (docs/compensation.md), in the order they run."""

    model_config = ConfigDict(frozen=True)

    #: The compensated node's id.
    node: str
    status: NodeStatus
    #: What the compensation step returned (once it succeeded).
    output: Any = None
    #: Its last attempt's error (``None`` once it succeeded).
    error: Any = None
    attempts: int = 0

    _typed_output = field_validator("output", mode="before")(decode_lenient)


def compensation_views(state: RunState, outputs: Mapping[str, Any]) -> list[CompensationView]:
    """The saga of a run as its view lists it; ``outputs`` by node id (compensation ids)."""
    if state.compensation is None:
        return []
    out: list[CompensationView] = []
    for node in state.compensation["order"]:
        cid = compensation_id(node)
        ns = state.nodes.get(cid)
        if ns is None:
            continue
        succeeded = ns.status == NodeStatus.SUCCEEDED
        out.append(
            CompensationView(
                node=node,
                status=ns.status,
                output=outputs.get(cid) if succeeded else None,
                error=None if succeeded else ns.error,
                attempts=ns.generation,
            )
        )
    return out


class RunView(BaseModel):
    model_config = ConfigDict(frozen=True)

    run_id: str
    workflow_id: str
    workflow: str
    version: int
    status: RunStatus
    input: Any = None
    context: dict[str, Any] = {}
    output: Any = None
    error: Any = None
    nodes: dict[str, NodeView] = {}
    parent_run_id: str | None = None
    continued_from: str | None = None
    continued_to: str | None = None
    created_at: datetime
    finished_at: datetime | None = None
    #: A delayed run's start time (``start(delay=...)`` / ``start_at=``); it is pending until then.
    start_at: datetime | None = None
    #: When the whole run times out, if it has a deadline.
    deadline_at: datetime | None = None
    #: The run's tags (``start(tags=)``, ``ctx.tag``; docs/tags.md).
    tags: dict[str, str] = {}
    #: The run's saga: the compensations of its succeeded nodes, the first to run first
    #: (empty when it never compensated, or was redriven since).
    compensations: list[CompensationView] = []

    _typed_values = field_validator("input", "context", "output", mode="before")(decode_lenient)

    @property
    def done(self) -> bool:
        from .engine.status import TERMINAL_RUN_STATUSES

        return self.status in TERMINAL_RUN_STATUSES


@dataclass(frozen=True, slots=True, eq=False)
class RunPage(Sequence[RunView]):
    """One page of ``list_runs``: its runs, newest first, and the cursor of the next page.

    It is a sequence of its runs, so code written when ``list_runs`` returned a list keeps
    working (iterate it, index it, ``len()`` it, compare it with a list). ``next_cursor`` is
    ``None`` on the last page; pass it as ``cursor=`` to read the page after this one.
    """

    runs: list[RunView]
    next_cursor: str | None = None

    @overload
    def __getitem__(self, index: int) -> RunView: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[RunView]: ...

    def __getitem__(self, index: int | slice) -> RunView | Sequence[RunView]:
        return self.runs[index]

    def __len__(self) -> int:
        return len(self.runs)

    def __iter__(self) -> Iterator[RunView]:
        return iter(self.runs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RunPage):
            return self.runs == other.runs and self.next_cursor == other.next_cursor
        if isinstance(other, list | tuple):
            return self.runs == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to a list, which has no hash


class ScheduleView(BaseModel):
    """A schedule as ``list_schedules()`` shows it."""

    model_config = ConfigDict(frozen=True)

    name: str
    workflow: str
    cron: str | None = None
    every: float | None = None
    timezone: str = "UTC"
    input: Any = None
    overlap: str = "skip"
    catchup_window: float
    paused: bool = False
    #: The next fire time (UTC); while paused, the one it would fire next if resumed now.
    next_fire_at: datetime | None = None
    #: A ``buffer_one`` fire time waiting for the previous run to end.
    buffered_fire_at: datetime | None = None
    #: The workflow id of the newest run the schedule started.
    last_workflow_id: str | None = None


class AuditEntry(BaseModel):
    """One action that took effect (docs/operations.md, "Who did what")."""

    model_config = ConfigDict(frozen=True)

    #: When it took effect (the database's clock).
    at: datetime
    #: Who: ``by=`` (the CLI's default, the operating-system user; the console, the token's
    #: name), or ``None``.
    actor: str | None = None
    #: ``start``, ``pause``, ``resume``, ``cancel``, ``terminate``, ``redrive``,
    #: ``continue_as_new``, ``signal``, ``approve``, ``reject``, ``schedule``, ``unschedule``,
    #: ``prune``.
    action: str
    run_id: str | None = None
    workflow_id: str | None = None
    node: str | None = None
    detail: dict[str, Any] = {}
    #: ``api``, ``cli``, ``web``, ``schedule``, ``parent``, ``bulk``.
    source: str


@dataclass(frozen=True, slots=True)
class AuditPage:
    """One page of ``audit()``, newest first; ``next_cursor`` (``None`` on the last page) is
    the ``cursor=`` of the page after it. Iterable like the list of its entries."""

    entries: list[AuditEntry]
    next_cursor: str | None = None

    def __iter__(self) -> Iterator[AuditEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)
