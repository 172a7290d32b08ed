"""Calling a step and what its attempt comes to: the arguments it is called with (secrets
filled in, large values read back), its context, its call (one, or one per item of a batch),
and the ``Outcome`` that call comes to, checked and ready to be written (the errors it
records: step_errors.py). Nothing here writes the attempt: ``steps.py`` records the outcome
and advances the run.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from .. import tracing
from ..definition.blobrefs import contains_ref, may_hold_ref
from ..definition.spec import BATCH_ARG
from ..engine.status import AttemptOutcome
from ..engine.tags import StepTags
from ..errors import DanglingReference, InvalidSecretName, SecretNotFound, StepCancelled
from ..payloads import JsonCheck, storable_text
from ..store import attempts, blobs
from ..store.db import with_retry
from ..values import may_hold_envelope
from . import batch
from .arguments import ArgumentRefused, prepare
from .heartbeats import HeartbeatPause, heartbeat, should_stop
from .large_values import by_reference, patch_problem
from .secrets import AttemptSecrets, SecretUnavailable, Slots, slots_for
from .step_context import Step, StepContext
from .step_errors import checked_payload, describe, error_of, is_non_retryable, payload_of

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from .ports import WorkerPort

_V = TypeVar("_V")

log = logging.getLogger("ductor_celery.step")


def _non_retryable_of(
    rt: WorkerPort, step: Step, claimed: attempts.ClaimedAttempt
) -> frozenset[str]:
    """The exceptions that fail this attempt's node without retry: its retry policy as the
    run's pinned definition stores it, which is the node's own ``retry=`` when it has one (in
    every respect: its ``non_retryable`` replaces the step's), else the step's."""
    if claimed.spec_hash is not None:
        try:
            # A compensation's spec is pinned too.
            node = rt.spec_for(claimed.spec_hash).graph.declared(claimed.node)
        except Exception as exc:  # noqa: BLE001 - the step's own policy is the fallback
            log.warning("attempt %s: definition not readable (%s)", claimed.token, exc)
            node = None
        retry = getattr(node, "retry", None)
        if retry is not None:
            return frozenset(retry.non_retryable)
    return frozenset(f"{e.__module__}.{e.__qualname__}" for e in step.retry.non_retryable)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one execution of a step comes to, ready to be written to its attempt row."""

    outcome: AttemptOutcome
    output: Any = None
    patch: Any = None
    error: dict[str, Any] | None = None
    retryable: bool = True
    #: What the step set with ``ctx.tag``: applied to the run only if it succeeded.
    tags: StepTags | None = None
    #: The output and patch are the JSON checks' own decoding of the step's values
    #: (``_storable``), the tags a list built for them: the values as stored, sharing nothing
    #: with the step (``steps._carried`` computes with them as they are).
    checked: bool = False
    #: The JSON text ``output`` was checked as (``payloads.JsonCheck.text``): what its size
    #: and the commit's parameter are taken from, instead of encoding it again.
    #: Only beside a checked output; None as soon as the output is replaced (redacted, or by
    #: its reference).
    output_text: str | None = None


#: An attempt claimed after its run's cancel was requested: never run.
_CANCELLED_BEFORE_START = Outcome(
    AttemptOutcome.CANCELLED,
    error={"type": "StepCancelled", "message": "the run was cancelled before the step began"},
    retryable=False,
)


def invalid(problem: str) -> Outcome:
    """Failed without retry: the same step would return the same unstorable value again."""
    error = {"type": "InvalidResult", "message": storable_text(problem)}
    return Outcome(AttemptOutcome.FAILED, error=error, retryable=False)


@dataclass(frozen=True, slots=True)
class Call:
    """What every call of one attempt shares: its secrets, where its arguments hold secret
    references, and (read lazily) the exceptions that fail it without retry."""

    secrets: AttemptSecrets
    slots: Slots
    non_retryable: Callable[[], frozenset[str]] = frozenset
    #: ``ductor_offload_bytes``: a larger result goes to eec_blob, a larger patch is refused.
    offload_bytes: int = 262_144
    #: The arguments' JSON text holds no typed value and no reference (``args_text``), so
    #: nothing in them (a batch's items included) needs decoding.
    plain_args: bool = False


def _slots_of(rt: WorkerPort, claimed: attempts.ClaimedAttempt) -> Slots:
    """Where the node's argument template holds secret references (none known: none)."""
    if claimed.spec_hash is None:
        return ()
    try:
        return slots_for(claimed.spec_hash, claimed.node, rt.spec_for)
    except Exception as exc:  # noqa: BLE001 - not cached: the next attempt reads again
        log.warning("attempt %s: definition not readable (%s)", claimed.token, exc)
        return ()


def _once(fn: Callable[[], _V]) -> Callable[[], _V]:
    """``fn``'s value, computed at the first call and kept: ``functools.cache`` for a function
    of no arguments, without the wrapper's making (its ``update_wrapper``), which cost more
    than the rest of an inline step's call, twice per attempt."""
    kept: list[_V] = []

    def value() -> _V:
        if not kept:
            kept.append(fn())
        return kept[0]

    return value


def _input_reader(engine: Engine, run_id: str) -> Callable[[], Any]:
    """Reads the run's input once, on first use (shared by the items of a batch)."""
    return _once(
        lambda: with_retry(lambda: attempts.run_input(engine, run_id), what="read run input")
    )


def _contexts(
    engine: Engine,
    claimed: attempts.ClaimedAttempt,
    read_input: Callable[[], Any],
    limit: int,
    secrets: AttemptSecrets,
) -> Callable[[int | None], StepContext]:
    """Makes the step's context for one call of the attempt (``branch``: the branch, or a
    batch item's index). What ties a context to the attempt (its heartbeats, its cancel, its
    run's input) is made once per attempt and shared by a batch's items: their heartbeats are
    the attempt's own."""
    pause = HeartbeatPause()

    def heartbeat_fn(details: Any) -> bool | None:
        return heartbeat(engine, claimed.token, details, limit, secrets.redact, pause)

    def cancelled_fn() -> bool:
        return should_stop(engine, claimed.token)

    def undone_fn() -> int:
        return attempts.times_undone(engine, claimed.run_id, claimed.node)

    def context(branch: int | None) -> StepContext:
        return StepContext(
            run_id=claimed.run_id,
            workflow_id=claimed.workflow_id,
            node=claimed.node,
            branch=branch,
            attempt=claimed.attempt,
            input_fn=read_input,
            context=claimed.context,
            heartbeat_fn=heartbeat_fn,
            secret_fn=secrets.get,
            cancelled_fn=cancelled_fn,
            cancelled=claimed.cancel_requested,
            undone_fn=undone_fn,
        )

    return context


def _run_batch(
    engine: Engine,
    step: Step,
    claimed: attempts.ClaimedAttempt,
    me: str,
    limit: int,
    call_info: Call,
) -> tuple[Outcome, BaseException | None]:
    """A batch attempt (runtime/batch.py): the step once per item without a recorded output;
    each item gets its own context (``ctx.branch`` is the item's index) and the same checks
    an unbatched branch gets."""
    token = claimed.token
    spec = claimed.args[BATCH_ARG]
    earlier: list[Any] = []
    branch = claimed.branch
    if claimed.attempt > 1 and branch is not None:
        earlier = with_retry(
            lambda: attempts.batch_progress(
                engine, claimed.run_id, claimed.node, branch, int(spec["base"]), token
            ),
            what="read batch progress",
        )
    read_input = _input_reader(engine, claimed.run_id)
    # The tags the items that ran in this attempt set, in item order: the batch's attempt
    # carries them, applied if it succeeds (docs/tags.md).
    tags: dict[str, str] = {}  # key -> value, in the order first set

    context = _contexts(engine, claimed, read_input, limit, call_info.secrets)

    def call(index: int, args: dict[str, Any]) -> tuple[batch.ItemOutcome, BaseException | None]:
        item, interrupt = _run(step, context(index), args, token, limit, call_info)
        if item.tags:
            tags.update((k, v) for k, v in item.tags)
        # Each item's large output alone: the batch's list (and its checkpoints) hold references.
        item = _by_reference(engine, claimed.run_id, item, call_info.offload_bytes)
        return (
            batch.ItemOutcome(
                item.outcome == AttemptOutcome.SUCCEEDED,
                item.output,
                item.patch,
                item.error,
                item.retryable,
            ),
            interrupt,
        )

    def checkpoint(progress: dict[str, Any]) -> None:
        try:
            attempts.batch_checkpoint(engine, token, me, progress)
        except Exception as exc:  # noqa: BLE001 - a checkpoint only saves a retry some work
            log.warning("attempt %s: batch checkpoint not recorded: %s", token, describe(exc))

    done, interrupt = batch.run_batch(spec, earlier, call, checkpoint)
    what = f"step {step.name!r} batch of {len(spec['items'])} items"
    # Each item's result was checked (reserved key included) in _run before a large one was
    # replaced by its reference: the list holds ductor's own references, not forged ones.
    output, patch, problem = _storable(
        done.output, done.patch, what, limit, call_info.offload_bytes, refs_allowed=True
    )
    if problem is not None:
        log.error("attempt %s: %s", token, problem)
        return invalid(f"{problem} (a smaller batch_size keeps it under the limit)"), interrupt
    if done.succeeded:
        return Outcome(
            AttemptOutcome.SUCCEEDED,
            output=output.value,
            patch=patch,
            tags=[[k, v] for k, v in tags.items()] or None,
            checked=True,
            output_text=output.text,
        ), interrupt
    return (
        Outcome(
            AttemptOutcome.FAILED,
            output=output.value,
            patch=patch,
            error=done.error,
            retryable=done.retryable,
        ),
        interrupt,
    )


def _run(
    step: Step,
    ctx: StepContext,
    args: dict[str, Any],
    token: str,
    limit: int,
    call: Call,
) -> tuple[Outcome, BaseException | None]:
    """Call the step: its outcome (every secret it used redacted), and the interrupt to
    re-raise once that is written."""
    outcome, interrupt = _call(step, ctx, args, token, limit, call)
    if call.secrets.used:
        redact = call.secrets.redact
        outcome = dataclasses.replace(
            outcome,
            output_text=None,
            output=redact(outcome.output),
            patch=redact(outcome.patch),
            error=redact(outcome.error),
            tags=redact(outcome.tags),
            checked=False,  # redacted after the checks: checked again where it is folded
        )
    return outcome, interrupt


def _call(
    step: Step,
    ctx: StepContext,
    args: dict[str, Any],
    token: str,
    limit: int,
    call: Call,
) -> tuple[Outcome, BaseException | None]:
    try:
        kwargs = prepare(
            step.fn, step.name, call.secrets.fill(args, call.slots), plain=call.plain_args
        )
    except (ArgumentRefused, SecretNotFound, InvalidSecretName) as exc:
        # A bad name reaches here from a definition registered before names were checked.
        kind = "InvalidArgument" if isinstance(exc, ArgumentRefused) else type(exc).__name__
        error = {"type": kind, "message": storable_text(str(exc))}
        return Outcome(AttemptOutcome.FAILED, error=error, retryable=False), None
    except SecretUnavailable as exc:
        error = {"type": "SecretUnavailable", "message": storable_text(str(exc))}
        return Outcome(AttemptOutcome.FAILED, error=error, retryable=True), None
    try:
        value = step.fn(ctx, **kwargs)
    except StepCancelled as exc:
        # Stopped on a cancel: recorded as cancelled, never a failure to retry.
        error = error_of(exc, call.secrets.redact_text)
        return Outcome(AttemptOutcome.CANCELLED, error=error, retryable=False), None
    except BaseException as exc:  # noqa: BLE001 - a step's failure is data, not a crash
        failed = Outcome(
            AttemptOutcome.FAILED,
            error=error_of(exc, call.secrets.redact_text),
            retryable=not is_non_retryable(exc, call.non_retryable()),
        )
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            return failed, exc
        if not isinstance(exc, Exception):
            # Celery's tracer treats these as failures too; the worker carries on.
            log.warning("attempt %s: step %r raised %s", token, step.name, describe(exc))
        return failed, None
    what = f"step {step.name!r}"
    output, patch, problem = _storable(value, ctx.patch_value, what, limit, call.offload_bytes)
    if problem is not None:
        log.error("attempt %s: %s", token, problem)
        return invalid(problem), None
    succeeded = Outcome(
        AttemptOutcome.SUCCEEDED,
        output=output.value,
        patch=patch,
        tags=ctx.tags_value,
        checked=True,
        output_text=output.text,
    )
    return succeeded, None


def _storable(
    value: Any,
    patch_value: Any,
    what: str,
    limit: int,
    offload_bytes: int,
    *,
    refs_allowed: bool = False,
) -> tuple[JsonCheck, Any, str | None]:
    """A step's (or a batch's) result (checked: its value and JSON text) and context patch as
    they are stored, or the first problem that keeps them from being stored (too large, not
    JSON, a patch over its limit)."""
    output = checked_payload(value, f"{what} result", limit, refs_allowed=refs_allowed)
    problem = output.problem
    patch = None
    # Most steps set no context patch: nothing to check (None is stored as it is).
    if problem is None and patch_value is not None:
        patch, problem = payload_of(patch_value, f"{what} context patch", limit)
    if problem is None:
        problem = patch_problem(patch, f"{what} context patch", offload_bytes)
    return output, patch, problem


def _with_values(
    engine: Engine, claimed: attempts.ClaimedAttempt
) -> tuple[attempts.ClaimedAttempt, Outcome | None]:
    """The attempt with the large values its arguments refer to read back (no query when
    they refer to none), or the failure naming a reference whose blob is gone."""
    text = claimed.args_text
    if not (may_hold_ref(text) if text is not None else contains_ref(claimed.args)):
        return claimed, None
    try:
        args = with_retry(
            lambda: blobs.resolved_on(engine, claimed.args, f"the arguments of {claimed.token}"),
            what="read large arguments",
        )
    except DanglingReference as exc:
        error = {"type": "DanglingReference", "message": storable_text(str(exc))}
        return claimed, Outcome(AttemptOutcome.FAILED, error=error, retryable=False)
    return dataclasses.replace(claimed, args=dict(args), args_text=None), None


def _by_reference(engine: Engine, run_id: str, result: Outcome, threshold: int) -> Outcome:
    """The outcome with a large output replaced by a reference to its blob, written now."""
    try:
        output = by_reference(engine, run_id, result.output, threshold, result.output_text)
    except Exception as exc:  # noqa: BLE001 - recorded as the attempt's outcome instead
        # Raised, it would leave the attempt claimed until its timeout; like the outcome's own
        # write failures it becomes a failure, retryable (the next attempt may store it).
        log.error("run %s: a large result could not be stored: %s", run_id, describe(exc))
        error = {"type": "LargeValueNotStored", "message": describe(exc)}
        return Outcome(AttemptOutcome.FAILED, error=error, retryable=True)
    if output is result.output:
        return result
    # Only the output changes: the tags the step set (ctx.tag) and the rest go with it.
    return dataclasses.replace(result, output=output, output_text=None)


def prepare_call(rt: WorkerPort, step: Step, claimed: attempts.ClaimedAttempt) -> Call:
    """What every call of a claimed attempt shares (read before its run time is measured)."""
    # Read only when the step raises: most attempts succeed.
    non_retryable = _once(lambda: _non_retryable_of(rt, step, claimed))
    text = claimed.args_text
    return Call(
        AttemptSecrets(rt.settings.secret_provider),
        _slots_of(rt, claimed),
        non_retryable,
        rt.settings.offload_bytes,
        plain_args=text is not None and not may_hold_ref(text) and not may_hold_envelope(text),
    )


def call_attempt(
    engine: Engine,
    step: Step,
    claimed: attempts.ClaimedAttempt,
    me: str,
    limit: int,
    call: Call,
) -> tuple[Outcome, BaseException | None]:
    """Run a claimed attempt's step (not at all if its run's cancel came first, or a large
    argument is gone): its outcome, and the interrupt to re-raise once that is written."""
    # The attempt's span is current while the step runs: the user's own spans nest under it.
    with tracing.attempt_span(
        claimed.trace_context,
        claimed.run_id,
        claimed.workflow,
        claimed.node,
        claimed.attempt,
        step.name,
    ) as span:
        claimed, dangling = _with_values(engine, claimed)
        if claimed.cancel_requested:
            # Claimed after its run's cancel was requested: stopped before it began.
            result, interrupt = _CANCELLED_BEFORE_START, None
        elif dangling is not None:
            result, interrupt = dangling, None
        elif batch.is_batch(claimed.args, BATCH_ARG):
            result, interrupt = _run_batch(engine, step, claimed, me, limit, call)
        else:
            read_input = _input_reader(engine, claimed.run_id)
            ctx = _contexts(engine, claimed, read_input, limit, call.secrets)(claimed.branch)
            result, interrupt = _run(step, ctx, claimed.args, claimed.token, limit, call)
            result = _by_reference(engine, claimed.run_id, result, call.offload_bytes)
        tracing.mark_outcome(span, result.outcome, result.error)
    return result, interrupt
