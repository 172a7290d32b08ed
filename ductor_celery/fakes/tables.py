"""The in-memory store's rows: one dataclass per ``eec_`` table the tick reads or writes.

Values are kept as JSON would keep them (``json_copy``): what a test reads back is what the
SQL store would have returned, not an object the caller may still be holding.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..coordinator.port import OutboxRow


def json_copy(value: Any) -> Any:
    """``value`` as it comes back from a JSON column; a value JSON cannot hold is refused
    here, naming its type, as the SQL store refuses it."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"not storable as JSON: {exc}") from None


@dataclass
class RunRow:
    run_id: str
    workflow_id: str
    workflow: str
    version: int
    spec_hash: str
    status: str
    #: The stored run state (``RunState.to_json()``), as the run row's JSON column holds it.
    state: dict[str, Any]
    input: Any
    created_at: datetime
    updated_at: datetime
    record_version: int = 0
    transition_count: int = 0
    output: Any = None
    error: Any = None
    finished_at: datetime | None = None
    parent_run_id: str | None = None
    parent_node: str | None = None
    continued_from: str | None = None
    continued_to: str | None = None


@dataclass
class AttemptRow:
    token: str
    run_id: str
    node: str
    branch: int | None
    generation: int
    attempt: int
    step: str
    queue: str | None
    args: Any
    timeout: float
    created_at: datetime
    folded: bool = False
    claimed_at: datetime | None = None
    claimed_by: str | None = None
    #: The task id of the message whose worker runs it (``store/schema.py``'s column).
    carrier: str | None = None
    heartbeat_at: datetime | None = None
    #: A cooperative cancel asked this attempt to stop (the commit of the cancel's tick).
    cancel_requested_at: datetime | None = None
    finished_at: datetime | None = None
    #: The order attempts finished in: the test clock can give several the same
    #: ``finished_at``, the database's clock does not.
    finished_seq: int = 0
    outcome: str | None = None
    output: Any = None
    error: Any = None
    retryable: bool | None = None
    patch: Any = None
    #: What the step set with ``ctx.tag`` (applied by the tick if it succeeded).
    tags: Any = None


@dataclass
class SignalRow:
    id: int
    run_id: str
    workflow_id: str
    name: str
    payload: Any
    created_at: datetime
    applied_at: datetime | None = None
    applied_to: str | None = None
    applied_version: int | None = None


@dataclass
class ControlRow:
    id: int
    run_id: str
    kind: str
    reason: str | None
    input: Any
    has_input: bool
    requested_by: str | None
    created_at: datetime
    handled_at: datetime | None = None
    result: str | None = None
    node: str | None = None
    spec_hash: str | None = None
    source: str | None = None


@dataclass
class AuditRow:
    """An ``eec_audit`` row (store/audit.py): an action that took effect."""

    at: datetime
    actor: str | None
    action: str
    run_id: str | None
    workflow_id: str | None
    node: str | None
    detail: dict[str, Any] | None
    source: str


@dataclass
class TransitionRow:
    run_id: str
    seq: int
    node: str | None
    from_status: str | None
    to_status: str
    reason: str
    at: datetime


@dataclass
class Tables:
    """Every row; a transaction restores a copy of this on rollback."""

    runs: dict[str, RunRow] = field(default_factory=dict)
    #: By token, in insertion order.
    attempts: dict[str, AttemptRow] = field(default_factory=dict)
    signals: list[SignalRow] = field(default_factory=list)
    controls: list[ControlRow] = field(default_factory=list)
    audit: list[AuditRow] = field(default_factory=list)
    transitions: list[TransitionRow] = field(default_factory=list)
    #: Unsent outbox rows by id (``InMemoryStore.delete_outbox`` removes sent ones).
    outbox: dict[int, OutboxRow] = field(default_factory=dict)
    #: Each run's one timer row: when the sweeper would wake it.
    timers: dict[str, datetime] = field(default_factory=dict)
    #: Runs a tick message is queued for, whose tick has not started (``eec_workflow_wake``).
    wakes: set[str] = field(default_factory=set)
    #: ``eec_run_tag``: each run's tags, {run_id: {key: value}} (docs/tags.md).
    tags: dict[str, dict[str, str]] = field(default_factory=dict)
    #: The last id each sequence gave ("signal", "control", "outbox", "finish"): one per
    #: table, as the database keeps them, so ids in a stored state match a fresh database's.
    last_ids: dict[str, int] = field(default_factory=dict)

    def next_id(self, sequence: str) -> int:
        self.last_ids[sequence] = found = self.last_ids.get(sequence, 0) + 1
        return found

    def snapshot(self) -> Tables:
        return copy.deepcopy(self)
