"""ductor_celery: durable workflow execution for Celery.

The public surface (see the README and docs/): everything a user imports lives here.
"""

from .definition.builder import Workflow
from .definition.retry import ConcurrencyLimit, RetryPolicy
from .ductor import Ductor
from .engine.status import NodeStatus, RunStatus
from .errors import (
    DefinitionError,
    DuctorError,
    InvalidOperation,
    NonRetryableError,
    PayloadNotSerializable,
    PayloadTooLarge,
    RunNotFound,
    SecretNotFound,
    WorkflowNotFound,
)
from .runtime.steps import Step, StepContext
from .views import NodeView, RunHandle, RunView

__all__ = [
    "ConcurrencyLimit",
    "DefinitionError",
    "Ductor",
    "DuctorError",
    "InvalidOperation",
    "NodeStatus",
    "NodeView",
    "NonRetryableError",
    "PayloadNotSerializable",
    "PayloadTooLarge",
    "RetryPolicy",
    "RunHandle",
    "RunNotFound",
    "RunStatus",
    "RunView",
    "SecretNotFound",
    "Step",
    "StepContext",
    "Workflow",
    "WorkflowNotFound",
]
