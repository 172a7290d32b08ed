"""Workflow definitions: the builder, the stored spec, paths and validation. Pure."""

from .builder import StepLike, Workflow
from .retry import RetryPolicy
from .spec import RetrySpec, StepNodeSpec, WorkflowSpec

__all__ = ["RetryPolicy", "RetrySpec", "StepLike", "StepNodeSpec", "Workflow", "WorkflowSpec"]
