"""What readers get: RunHandle, RunView and NodeView, frozen.

Their values (input, context, outputs) are the Python values the run was given and its steps
returned: typed values are rebuilt from their stored encoding (``ductor_celery.values``); a
model or dataclass whose class cannot be imported in the reading process stays as its JSON
envelope, so a run can always be read (by the CLI, say).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

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

    _typed_values = field_validator("input", "context", "output", mode="before")(decode_lenient)

    @property
    def done(self) -> bool:
        from .engine.status import TERMINAL_RUN_STATUSES

        return self.status in TERMINAL_RUN_STATUSES
