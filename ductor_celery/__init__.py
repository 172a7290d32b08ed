"""ductor_celery: durable workflow execution for Celery.

The public surface (see the README and docs/): everything a user imports lives here.
"""

from .definition.builder import Workflow
from .definition.retry import ConcurrencyLimit, RateLimit, RetryPolicy, RunConcurrency
from .ductor import Ductor
from .engine.status import NodeStatus, RunStatus
from .errors import (
    DanglingReference,
    DefinitionError,
    DuctorError,
    InvalidOperation,
    NodeNotFound,
    NonRetryableError,
    PayloadNotSerializable,
    PayloadTooLarge,
    RunNotFound,
    ScheduleNotFound,
    SecretNotFound,
    StepCancelled,
    VersionNotFound,
    WorkflowNotFound,
    WrongDatabase,
)
from .runtime.step_context import Step, StepContext
from .views import AuditEntry, AuditPage, NodeView, RunHandle, RunPage, RunView, ScheduleView

__all__ = [
    "AuditEntry",
    "AuditPage",
    "ConcurrencyLimit",
    "DefinitionError",
    "Ductor",
    "DuctorError",
    "InvalidOperation",
    "NodeNotFound",
    "NodeStatus",
    "NodeView",
    "NonRetryableError",
    "StepCancelled",
    "DanglingReference",
    "PayloadNotSerializable",
    "PayloadTooLarge",
    "RateLimit",
    "RetryPolicy",
    "RunHandle",
    "RunNotFound",
    "RunConcurrency",
    "RunPage",
    "RunStatus",
    "RunView",
    "ScheduleNotFound",
    "ScheduleView",
    "SecretNotFound",
    "Step",
    "StepContext",
    "VersionNotFound",
    "Workflow",
    "WorkflowNotFound",
    "WrongDatabase",
]
