"""The pure tick. Imports nothing from store/, runtime/, SQLAlchemy or Celery."""

from .inputs import (
    AttemptCheck,
    AttemptResult,
    ClosedAttempt,
    ControlIn,
    Dispatch,
    EngineConfig,
    NewAttempt,
    SignalIn,
    TickInputs,
    TickPayload,
    Transition,
)
from .state import NodeState, RunState
from .status import AttemptOutcome, NodeStatus, RunStatus
from .tick import compute_tick, needed_outputs

__all__ = [
    "AttemptCheck",
    "AttemptOutcome",
    "AttemptResult",
    "ClosedAttempt",
    "ControlIn",
    "Dispatch",
    "EngineConfig",
    "NewAttempt",
    "NodeState",
    "NodeStatus",
    "RunState",
    "RunStatus",
    "SignalIn",
    "TickInputs",
    "TickPayload",
    "Transition",
    "compute_tick",
    "needed_outputs",
]
