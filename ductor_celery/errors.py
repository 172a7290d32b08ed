"""Every exception ductor raises.

::

    DuctorError                  base of everything ductor raises
      DefinitionError            a workflow that cannot be registered (names the node or path)
      WorkflowNotFound           start of an unregistered workflow name
        VersionNotFound          start(version=) / continue_as_new(version=) never registered
      RunNotFound                no run with that id or workflow id
      ScheduleNotFound           no schedule with that name
      InvalidOperation           a control, approval or signal the run's state does not allow
        NodeNotFound             redrive(from_node=) naming no node of the run's workflow
      PayloadTooLarge            an input or payload over ductor_max_payload_bytes
      PayloadNotSerializable     a value that cannot be stored exactly (NaN, NUL, too deep, ...)
      DanglingReference          a large value's reference whose blob is gone (names the blob)
      StoreUnavailable           the database could not be reached
      WrongDatabase              start(connection=/using=) on another database than ductor's
      QueueMismatch              a ductor queue on RabbitMQ exists with other arguments (names
                                 the queue and the two ways out)
      ExportError                a file that is not a run export of a format this version
                                 reads, or a replay it cannot do (a node or step it lacks);
                                 also a ValueError
    NonRetryableError            raise it inside a step to fail without retry
      SecretNotFound             a step's secret the provider does not have (names it)
      InvalidSecretName          ctx.secret(name) of a name that is not [A-Za-z_][A-Za-z0-9_]*
                                 (at most 100 characters); also a ValueError
      InvalidTag                 ctx.tag(key, value) with a key or value that is not a string of
                                 1..100 characters, or a 21st key; also a ValueError
    StepCancelled                ctx.heartbeat() raises it once the run is cancelled

``TimeoutError`` (the builtin) is what ``wait()`` raises when it runs out of time.
"""

from __future__ import annotations


class DuctorError(Exception):
    """Base of everything ductor raises."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or self.__class__.__name__).strip())


class DefinitionError(DuctorError):
    """The workflow definition is invalid."""


class WorkflowNotFound(DuctorError):
    """No workflow registered under that name."""


class VersionNotFound(WorkflowNotFound, ValueError):
    """No definition of that workflow with that version was ever registered."""


class RunNotFound(DuctorError):
    """No run with that run id or workflow id."""


class ScheduleNotFound(DuctorError):
    """No schedule with that name."""


class InvalidOperation(DuctorError):
    """The run's state does not allow this operation."""


class NodeNotFound(InvalidOperation, ValueError):
    """The run's workflow has no node with that id."""


class PayloadTooLarge(DuctorError):
    """A payload is larger than ductor_max_payload_bytes."""


class PayloadNotSerializable(DuctorError):
    """A payload cannot be stored exactly as JSON (NaN or Infinity, NUL, a lone surrogate,
    nesting deeper than limits.MAX_JSON_DEPTH, an integer too long to print, a non-JSON type)."""


class DanglingReference(DuctorError):
    """A reference to a large value whose blob (eec_blob) is missing or damaged: the message
    names the blob id and what held the reference."""


class StoreUnavailable(DuctorError):
    """The database could not be reached."""


class WrongDatabase(DuctorError, ValueError):
    """The connection given to start() is not to ductor's database."""


class QueueMismatch(DuctorError):
    """RabbitMQ refused to declare one of ductor's queues: it exists with other arguments
    (a classic queue where ductor declares a quorum one, or the reverse)."""


class ExportError(DuctorError, ValueError):
    """A file that is not a ductor run export this version reads, or a replay it cannot do
    (a node the export does not hold, a step no longer registered)."""


class NonRetryableError(Exception):
    """Raise inside a step to fail the attempt without retrying it.

    Deliberately not a DuctorError: it is raised by user code, not by ductor.
    """


class SecretNotFound(NonRetryableError):
    """A secret (``$.secret.<name>`` or ``ctx.secret(name)``) that ``ductor_secret_provider``
    does not have: the attempt fails without retry. The message names the secret, never a
    value."""


class InvalidSecretName(NonRetryableError, ValueError):
    """``ctx.secret(name)`` (or a ``$.secret.<name>`` of a definition registered before the
    rule) with a name that is not ASCII letters, digits and ``_``, not starting with a digit,
    at most 100 characters: the provider is not asked, and the attempt fails without retry."""


class InvalidTag(NonRetryableError, ValueError):
    """``ctx.tag(key, value)`` with a key or value that is not a string of 1..100 characters,
    or a 21st key set by one attempt (docs/tags.md): the same call would fail the same way, so
    an attempt that lets it propagate fails without retry."""


class StepCancelled(Exception):
    """The run was cancelled (or the attempt closed): stop the step.

    ``ctx.heartbeat()`` raises it once a cancel is requested; let it propagate (or raise it
    yourself after seeing ``ctx.cancelled``): the attempt is recorded as ``cancelled``, never
    retried and never counted as a failure. Not a DuctorError: it reaches user code, like
    ``NonRetryableError``.
    """
