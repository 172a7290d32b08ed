"""The pure tick. Imports nothing from store/, runtime/, SQLAlchemy or Celery."""

from .inputs import (
    AttemptCheck,
    AttemptResult,
    ClosedAttempt,
    Dispatch,
    EngineConfig,
    NewAttempt,
    TickInputs,
    TickPayload,
    Transition,
)
from .state import NodeState, RunState
from .status import NodeStatus, RunStatus
from .tick import compute_tick, needed_outputs

__all__ = [
    "AttemptCheck",
    "AttemptResult",
    "ClosedAttempt",
    "Dispatch",
    "EngineConfig",
    "NewAttempt",
    "NodeState",
    "NodeStatus",
    "RunState",
    "RunStatus",
    "TickInputs",
    "TickPayload",
    "Transition",
    "compute_tick",
    "needed_outputs",
]
