"""What runs inside a step worker: one attempt's execution, from its claim to its outcome and
the tick after it (the Step object and StepContext: step_context.py)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import tracing
from ..coordinator import SETTLED_TICKS, TickOutcome
from ..definition.blobrefs import contains_ref
from ..definition.spec import BATCH_ARG
from ..engine.tags import StepTags
from ..errors import DanglingReference, InvalidSecretName, SecretNotFound, StepCancelled
from ..payloads import storable_text
from ..store import attempts, blobs, wakes
from ..store.db import ValuesRefused, outages, with_retry
from ..store.outbox import OutboxRow
from ..store.rates import RateHeld
from ..store.schema import dumps_json
from . import batch, metrics
from .arguments import ArgumentRefused, prepare
from .failpoints import failpoint
from .heartbeats import HeartbeatPause, heartbeat, should_stop
from .inline import InlineChain, TaskEvents, as_current_task, flush_events
from .large_values import by_reference, patch_problem
from .lost_outcomes import lost_outcomes
from .outbox_janitor import sent_outbox
from .secrets import (
    AttemptSecrets,
    SecretUnavailable,
    Slots,
    slots_for,
)
from .step_context import Step, StepContext
from .step_errors import describe, error_of, is_non_retryable, payload_of
from .tick_task import Keeper, PreludeRefused, run_tick

if TYPE_CHECKING:
    from .runtime import Runtime

log = logging.getLogger("ductor_celery.step")

#: How long a worker keeps trying to write a finished attempt's outcome to the database.
FINISH_DEADLINE_S = 600.0


def _non_retryable_of(rt: Runtime, step: Step, claimed: attempts.ClaimedAttempt) -> frozenset[str]:
    """The exceptions that fail this attempt's node without retry: its retry policy as the
    run's pinned definition stores it, which is the node's own ``retry=`` when it has one (in
    every respect: its ``non_retryable`` replaces the step's), else the step's."""
    if claimed.spec_hash is not None:
        try:
            node = rt.spec_for(claimed.spec_hash).graph.nodes.get(claimed.node)
        except Exception as exc:  # noqa: BLE001 - the step's own policy is the fallback
            log.warning("attempt %s: definition not readable (%s)", claimed.token, exc)
            node = None
        retry = getattr(node, "retry", None)
        if retry is not None:
            return frozenset(retry.non_retryable)
    return frozenset(f"{e.__module__}.{e.__qualname__}" for e in step.retry.non_retryable)


def worker_identity(hostname: str | None) -> str:
    """Who claims: host and pid for people, plus a nonce that makes each claim unique."""
    return f"{(hostname or socket.gethostname())[:150]}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


def _wake_needed(engine: Any, run_id: str) -> bool:
    try:
        return with_retry(lambda: wakes.request_wake(engine, run_id), what="request wake-up")
    except Exception as exc:  # noqa: BLE001 - a wake-up is a hint: send it when unsure
        log.warning("wake-up bookkeeping for run %s failed (%s); waking anyway", run_id, exc)
        return True


# -- one attempt --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Outcome:
    """What one execution of a step comes to, ready to be written to its attempt row."""

    outcome: str
    output: Any = None
    patch: Any = None
    error: dict[str, Any] | None = None
    retryable: bool = True
    #: What the step set with ``ctx.tag``: applied to the run only if it succeeded.
    tags: StepTags | None = None


#: An attempt claimed after its run's cancel was requested: never run.
_CANCELLED_BEFORE_START = _Outcome(
    "cancelled",
    error={"type": "StepCancelled", "message": "the run was cancelled before the step began"},
    retryable=False,
)


def _invalid(problem: str) -> _Outcome:
    """Failed without retry: the same step would return the same unstorable value again."""
    error = {"type": "InvalidResult", "message": storable_text(problem)}
    return _Outcome("failed", error=error, retryable=False)


def execute_attempt(
    rt: Runtime,
    step: Step,
    token: str,
    hostname: str | None = None,
    queue: str | None = None,
    carrier: str | None = None,
) -> str:
    """Claim, run, record, wake. Returns what happened (for logs and tests).

    Whatever the step does (raises anything, returns anything), its attempt's outcome is
    written before this returns: an attempt left open keeps its node waiting for the whole
    step timeout. ``KeyboardInterrupt`` and ``SystemExit`` are re-raised once it is written,
    as Celery's tracer does, so the process still stops or is replaced.

    ``queue``: the queue the message came from. A step the tick then starts on that same
    queue may run here next, claimed in the tick's commit, with no message (runtime/inline.py).
    ``carrier``: the message's task id (the token, as the dispatcher sends it), written with
    every claim this message's process makes, so that a terminate can kill it whichever of
    them it is running (coordinator/rows.py, ``carrier_revokes``).
    """
    engine = rt.engine()
    chain = InlineChain.start(rt, queue, lambda: worker_identity(hostname), carrier)
    me = worker_identity(hostname)
    claimed = _claim(engine, token, me, step, carrier)
    if isinstance(claimed, attempts.WrongStep):
        # Run nothing: the arguments are another function's. The attempt's own message (or
        # the sweeper's re-send) still claims it.
        log.warning(
            "attempt %s belongs to step %r but came in a message for task %r; message dropped",
            token,
            claimed.step,
            step.name,
        )
        return "wrong-step"
    if isinstance(claimed, RateHeld):
        # Its bucket is empty (or older attempts of its key wait): it waits, marked, and the
        # sweeper sends its message again when a token is there (docs/flow-control.md).
        log.debug(
            "attempt %s waits for rate-limit key %r (a token at %s)",
            token,
            claimed.key,
            claimed.ready_at.isoformat(),
        )
        return "rate-limited"
    if claimed is None:
        log.info("attempt %s already claimed or closed; message ignored", token)
        return "duplicate"
    if chain is not None:
        chain.bind(claimed.run_id)
    outcome = _run_claimed(rt, engine, step, claimed, me, chain)
    _run_inline(rt, engine, chain, hostname)
    return outcome


def first_tick(
    rt: Runtime,
    run_id: str,
    hostname: str | None,
    queue: str | None,
    carrier: str | None = None,
) -> str:
    """The first tick of a run just started, run by the step worker its start message reached
    (eager ticks; ``Runtime.wake_started``), then the step that tick claimed for this worker
    and the inline chain after it (runtime/inline.py): no hop to the coordinator and no step
    message before a run's first step, as a raw chain's first task has one hop.

    The tick is the coordinator's own code as an eager tick: it takes the run's lock without
    waiting. When another tick holds it, or the tick fails, the coordinator is woken and ticks
    the run instead; a start message that is lost is covered by the sweeper, which wakes the
    coordinator for a run still pending after ``LOST_WAKEUP_AFTER_S``.

    ``carrier``: the start message's task id (``dispatch.first_tick_id``), written with each
    attempt the chain claims (``execute_attempt``).
    """
    if not rt.settings.eager_ticks:
        # This worker ticks nothing itself (a client configured otherwise sent it here).
        rt.wake(run_id)
        return "forwarded"
    engine = rt.engine()
    chain = InlineChain.start(rt, queue, lambda: worker_identity(hostname), carrier, run_id)
    # The task's result (Flower shows it): the tick's outcome, or "failed".
    tick: str
    try:
        tick = run_tick(rt, run_id, eager=True, keep=chain)
    except Exception as exc:  # noqa: BLE001 - the coordinator can always do it instead
        log.warning("first tick of run %s failed (%s); waking the coordinator", run_id, exc)
        tick = "failed"
    if tick not in SETTLED_TICKS:
        rt.wake(run_id)
        return tick
    _run_inline(rt, engine, chain, hostname)
    return tick


def _run_inline(rt: Runtime, engine: Any, chain: InlineChain | None, hostname: str | None) -> None:
    """Run what the chain's ticks claimed or held for this worker, one after another."""
    if chain is None or chain.kept is None:
        return
    try:
        while (kept := _next_inline(rt, engine, chain)) is not None:
            next_claimed, next_step, next_me, held = kept
            events = TaskEvents(rt.app, hostname, next_claimed)
            events.started(flush=chain.flush_events_now(held))
            with as_current_task(next_step, next_claimed, hostname, chain.queue):
                next_outcome = _run_claimed(rt, engine, next_step, next_claimed, next_me, chain)
            events.finished(next_outcome)
    finally:
        flush_events(rt.app, hostname)
        chain.release()


def _claim(
    engine: Any, token: str, me: str, step: Step, carrier: str | None
) -> attempts.ClaimedAttempt | attempts.WrongStep | RateHeld | None:
    """The claim a message's attempt and a held branch both take (retried on a dropped
    connection: the identity is unique per claim, so a retry finds its own claim), recording
    the message it runs under (``carrier``)."""
    return with_retry(
        functools.partial(attempts.claim, engine, token, me, step=step.name, carrier=carrier),
        what="claim attempt",
    )


def _next_inline(
    rt: Runtime, engine: Any, chain: InlineChain
) -> tuple[attempts.ClaimedAttempt, Step, str, bool] | None:
    """The chain's next attempt: the one its last tick claimed, else the next held branch
    this worker can still claim (one closed or taken meanwhile is skipped, as a message for
    it would be); once none is left, the tick of outcomes written alone (which may hold more)."""
    while True:
        kept = chain.pop()
        if kept is not None:
            return (*kept, False)
        held = chain.pop_held()
        if held is not None:
            token, step = held
            # Fault tests: die holding branches, with outcomes written alone and not ticked.
            failpoint("held_before_claim")
            me = chain.identity()
            claimed = _claim(engine, token, me, step, chain.carrier)
            if isinstance(claimed, attempts.ClaimedAttempt):
                return claimed, step, me, True
            continue
        if chain.unticked is None:
            return None
        run_id, chain.unticked = chain.unticked, None
        _advance_run(rt, engine, run_id, chain)


def _run_claimed(
    rt: Runtime,
    engine: Any,
    step: Step,
    claimed: attempts.ClaimedAttempt,
    me: str,
    chain: InlineChain | None,
) -> str:
    """Run a claimed attempt and make sure a tick folds its outcome; the outcome."""
    limit = rt.settings.max_payload_bytes
    # Read only when the step raises: most attempts succeed.
    non_retryable = functools.cache(lambda: _non_retryable_of(rt, step, claimed))
    call = _Call(
        AttemptSecrets(rt.settings.secret_provider),
        _slots_of(rt, claimed),
        non_retryable,
        rt.settings.offload_bytes,
    )
    metrics.record_claim(step.name, claimed.queued_s)
    began = time.perf_counter()
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
            ctx = _context(engine, claimed, claimed.branch, read_input, limit, call.secrets)
            result, interrupt = _run(step, ctx, claimed.args, claimed.token, limit, call)
            result = _by_reference(engine, claimed.run_id, result, call.offload_bytes)
        tracing.mark_outcome(span, result.outcome, result.error)
    ran_s = time.perf_counter() - began
    remember = (
        None if interrupt is not None else _keep_until_safe(rt, engine, step, claimed, me, result)
    )
    # A process about to stop takes no next step (it would be left claimed until its timeout).
    keep = None if interrupt is not None else chain
    try:
        if keep is not None:
            keep.ran(ran_s)
        try:
            if keep is not None and keep.holding:
                # More branches of this run are held for this worker: write the outcome alone;
                # the tick after the last of them folds them all.
                outcome = _record(rt, engine, step, claimed.token, result)
                keep.unticked = claimed.run_id
            else:
                outcome = _record_and_advance(
                    rt, engine, step, claimed.token, claimed.run_id, result, keep
                )
        except Exception:
            if remember is not None:
                remember(False)  # not written: written once the database is back
            raise
        if remember is not None:
            remember(True)
        if outcome != "closed":  # a closed attempt was counted by the tick that closed it
            metrics.record_attempt(step.name, outcome, ran_s)
    finally:
        if interrupt is not None:
            raise interrupt
    return outcome


def _keep_until_safe(
    rt: Runtime,
    engine: Any,
    step: Step,
    claimed: attempts.ClaimedAttempt,
    me: str,
    result: _Outcome,
) -> Callable[[bool], None] | None:
    """Get ready to remember the outcome about to be written, to write it again if a failover
    loses the commit (runtime/lost_outcomes.py). Call what this returns once the write
    returned (True) or gave up (False: then it is written once the database is back)."""
    keeper = lost_outcomes(rt.settings.database_url, prepare=rt.settings.database_prepare)
    if keeper is None:
        return None
    try:
        size = len(dumps_json([result.output, result.patch, result.error]))
    except Exception:  # noqa: BLE001 - not measurable: not kept (the write reports it)
        return None
    began = outages()

    def write_again() -> str:
        outcome = _record(rt, engine, step, claimed.token, result)
        rt.wake(claimed.run_id)  # not coalesced: a wake-up row may be a lost commit's too
        return outcome

    def remember(written: bool) -> None:
        keeper.keep(
            claimed.token, claimed.run_id, me, size, write_again, since=began, written=written
        )

    return remember


@dataclass(frozen=True, slots=True)
class _Call:
    """What every call of one attempt shares: its secrets, where its arguments hold secret
    references, and (read lazily) the exceptions that fail it without retry."""

    secrets: AttemptSecrets
    slots: Slots
    non_retryable: Callable[[], frozenset[str]] = frozenset
    #: ``ductor_offload_bytes``: a larger result goes to eec_blob, a larger patch is refused.
    offload_bytes: int = 262_144


def _slots_of(rt: Runtime, claimed: attempts.ClaimedAttempt) -> Slots:
    """Where the node's argument template holds secret references (none known: none)."""
    if claimed.spec_hash is None:
        return ()
    try:
        return slots_for(claimed.spec_hash, claimed.node, rt.spec_for)
    except Exception as exc:  # noqa: BLE001 - not cached: the next attempt reads again
        log.warning("attempt %s: definition not readable (%s)", claimed.token, exc)
        return ()


def _input_reader(engine: Any, run_id: str) -> Callable[[], Any]:
    """Reads the run's input once, on first use (shared by the items of a batch)."""
    return functools.cache(
        lambda: with_retry(lambda: attempts.run_input(engine, run_id), what="read run input")
    )


def _context(
    engine: Any,
    claimed: attempts.ClaimedAttempt,
    branch: int | None,
    read_input: Callable[[], Any],
    limit: int,
    secrets: AttemptSecrets,
) -> StepContext:
    pause = HeartbeatPause()
    return StepContext(
        run_id=claimed.run_id,
        workflow_id=claimed.workflow_id,
        node=claimed.node,
        branch=branch,
        attempt=claimed.attempt,
        input_fn=read_input,
        context=claimed.context,
        heartbeat_fn=lambda details: heartbeat(
            engine, claimed.token, details, limit, secrets.redact, pause
        ),
        secret_fn=secrets.get,
        cancelled_fn=lambda: should_stop(engine, claimed.token),
        cancelled=claimed.cancel_requested,
    )


def _run_batch(
    engine: Any,
    step: Step,
    claimed: attempts.ClaimedAttempt,
    me: str,
    limit: int,
    call_info: _Call,
) -> tuple[_Outcome, BaseException | None]:
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

    def call(index: int, args: dict[str, Any]) -> tuple[batch.ItemOutcome, BaseException | None]:
        ctx = _context(engine, claimed, index, read_input, limit, call_info.secrets)
        item, interrupt = _run(step, ctx, args, token, limit, call_info)
        if item.tags:
            tags.update((k, v) for k, v in item.tags)
        # Each item's large output alone: the batch's list (and its checkpoints) hold references.
        item = _by_reference(engine, claimed.run_id, item, call_info.offload_bytes)
        return (
            batch.ItemOutcome(
                item.outcome == "succeeded", item.output, item.patch, item.error, item.retryable
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
    output, problem = payload_of(done.output, f"{what} result", limit)
    patch = None
    if problem is None:
        patch, problem = payload_of(done.patch, f"{what} context patch", limit)
    if problem is None:
        problem = patch_problem(patch, f"{what} context patch", call_info.offload_bytes)
    if problem is not None:
        log.error("attempt %s: %s", token, problem)
        return _invalid(f"{problem} (a smaller batch_size keeps it under the limit)"), interrupt
    if done.succeeded:
        return _Outcome(
            "succeeded", output=output, patch=patch, tags=[[k, v] for k, v in tags.items()] or None
        ), interrupt
    return (
        _Outcome("failed", output=output, patch=patch, error=done.error, retryable=done.retryable),
        interrupt,
    )


def _record_and_advance(
    rt: Runtime,
    engine: Any,
    step: Step,
    token: str,
    run_id: str,
    result: _Outcome,
    keep: Keeper | None = None,
) -> str:
    """Write the outcome, then make sure a tick folds it.

    With eager ticks on PostgreSQL, an unleased attempt's outcome is written first in the
    eager tick's own transaction (one commit for both; ``run_tick``'s prelude). Anything
    unusual (the attempt closed meanwhile, values the database refuses, a tick that fails)
    falls back to the ordinary path: write the outcome alone, then tick or wake.

    ``keep``: handed to the eager tick (runtime/inline.py), which may claim one of the steps
    it starts for this worker to run next.
    """
    if rt.settings.eager_ticks and step.concurrency is None and attempts.finishes_in_tick(engine):
        try:
            tick = run_tick(rt, run_id, eager=True, prelude=_prelude(token, result), keep=keep)
        except PreludeRefused:
            tick = None
        except Exception as exc:  # noqa: BLE001 - the ordinary path below still writes it
            log.warning("eager tick of run %s failed (%s); recording on its own", run_id, exc)
            tick = None
        if tick in SETTLED_TICKS:
            return result.outcome
        if tick == TickOutcome.BUSY:  # the outcome is committed; the coordinator folds it
            _wake_coordinator(rt, engine, run_id)
            return result.outcome
    outcome = _record(rt, engine, step, token, result)
    _advance_run(rt, engine, run_id, keep)
    return outcome


def _prelude(token: str, result: _Outcome) -> Callable[[Any], bool]:
    return lambda conn: attempts.finish_unleased_on(
        conn,
        token,
        outcome=result.outcome,
        output=result.output,
        error=result.error,
        retryable=result.retryable,
        patch=result.patch,
        tags=result.tags,
    )


def _advance_run(rt: Runtime, engine: Any, run_id: str, keep: Keeper | None = None) -> None:
    """Make sure a tick folds the outcome just written.

    Eager (``ductor_eager_ticks``): run the run's tick here and now, if no other tick holds the
    run (docs/architecture.md, "Who runs a tick"); it loads after our commit, so it sees our
    outcome. Otherwise, or if it fails, wake the coordinator; coalesced: when a wake-up of the
    run is already queued, its tick will see this outcome and no message is sent.
    """
    if rt.settings.eager_ticks:
        try:
            if run_tick(rt, run_id, eager=True, keep=keep) in SETTLED_TICKS:
                return
        except Exception as exc:  # noqa: BLE001 - the coordinator can always do it instead
            log.warning("eager tick of run %s failed (%s); waking the coordinator", run_id, exc)
    _wake_coordinator(rt, engine, run_id)


def _wake_coordinator(rt: Runtime, engine: Any, run_id: str) -> None:
    """Coalesced: when a wake-up of the run is already queued, its tick will see the outcome
    and no message is sent."""
    if _wake_needed(engine, run_id):
        rt.wake(run_id)


def _run(
    step: Step,
    ctx: StepContext,
    args: dict[str, Any],
    token: str,
    limit: int,
    call: _Call,
) -> tuple[_Outcome, BaseException | None]:
    """Call the step: its outcome (every secret it used redacted), and the interrupt to
    re-raise once that is written."""
    outcome, interrupt = _call(step, ctx, args, token, limit, call)
    if call.secrets.used:
        outcome = _Outcome(
            outcome.outcome,
            output=call.secrets.redact(outcome.output),
            patch=call.secrets.redact(outcome.patch),
            error=call.secrets.redact(outcome.error),
            retryable=outcome.retryable,
            tags=call.secrets.redact(outcome.tags),
        )
    return outcome, interrupt


def _call(
    step: Step,
    ctx: StepContext,
    args: dict[str, Any],
    token: str,
    limit: int,
    call: _Call,
) -> tuple[_Outcome, BaseException | None]:
    try:
        kwargs = prepare(step.fn, step.name, call.secrets.fill(args, call.slots))
    except (ArgumentRefused, SecretNotFound, InvalidSecretName) as exc:
        # A bad name reaches here from a definition registered before names were checked.
        kind = "InvalidArgument" if isinstance(exc, ArgumentRefused) else type(exc).__name__
        error = {"type": kind, "message": storable_text(str(exc))}
        return _Outcome("failed", error=error, retryable=False), None
    except SecretUnavailable as exc:
        error = {"type": "SecretUnavailable", "message": storable_text(str(exc))}
        return _Outcome("failed", error=error, retryable=True), None
    try:
        value = step.fn(ctx, **kwargs)
    except StepCancelled as exc:
        # Stopped on a cancel: recorded as cancelled, never a failure to retry.
        error = error_of(exc, call.secrets.redact_text)
        return _Outcome("cancelled", error=error, retryable=False), None
    except BaseException as exc:  # noqa: BLE001 - a step's failure is data, not a crash
        failed = _Outcome(
            "failed",
            error=error_of(exc, call.secrets.redact_text),
            retryable=not is_non_retryable(exc, call.non_retryable()),
        )
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            return failed, exc
        if not isinstance(exc, Exception):
            # Celery's tracer treats these as failures too; the worker carries on.
            log.warning("attempt %s: step %r raised %s", token, step.name, describe(exc))
        return failed, None
    output, problem = payload_of(value, f"step {step.name!r} result", limit)
    patch = None
    if problem is None:
        patch, problem = payload_of(ctx.patch_value, f"step {step.name!r} context patch", limit)
    if problem is None:
        problem = patch_problem(patch, f"step {step.name!r} context patch", call.offload_bytes)
    if problem is not None:
        log.error("attempt %s: %s", token, problem)
        return _invalid(problem), None
    return _Outcome("succeeded", output=output, patch=patch, tags=ctx.tags_value), None


def _with_values(
    engine: Any, claimed: attempts.ClaimedAttempt
) -> tuple[attempts.ClaimedAttempt, _Outcome | None]:
    """The attempt with the large values its arguments refer to read back (no query when
    they refer to none), or the failure naming a reference whose blob is gone."""
    if not contains_ref(claimed.args):
        return claimed, None
    try:
        args = with_retry(
            lambda: blobs.resolved_on(engine, claimed.args, f"the arguments of {claimed.token}"),
            what="read large arguments",
        )
    except DanglingReference as exc:
        error = {"type": "DanglingReference", "message": storable_text(str(exc))}
        return claimed, _Outcome("failed", error=error, retryable=False)
    return dataclasses.replace(claimed, args=dict(args)), None


def _by_reference(engine: Any, run_id: str, result: _Outcome, threshold: int) -> _Outcome:
    """The outcome with a large output replaced by a reference to its blob, written now."""
    output = by_reference(engine, run_id, result.output, threshold)
    if output is result.output:
        return result
    return _Outcome(result.outcome, output, result.patch, result.error, result.retryable)


def _record(rt: Runtime, engine: Any, step: Step, token: str, result: _Outcome) -> str:
    """Write the outcome and hand on the lease it held; the outcome written, or "closed" when
    the attempt was closed first.

    Last line of defence: if the database refuses the values (a payload the check let
    through), a failure without them is written instead, so the attempt never stays open.
    """
    try:
        written, granted = _finish(engine, step, token, result)
    except ValuesRefused as refused:
        what = "result or context patch" if result.outcome == "succeeded" else "error"
        problem = f"step {step.name!r} {what} could not be stored: {refused.cause}"
        log.error("attempt %s: %s; recording the attempt as failed without it", token, problem)
        result = _invalid(problem)
        written, granted = _finish(engine, step, token, result)
    if granted:
        # This attempt's lease went to a waiting attempt: send its step message now (the
        # sweeper relays it if we die first), then clear the outbox rows.
        rt.dispatcher.send(granted)
        sent_outbox(engine).add([r.id for r in granted])
    return result.outcome if written else "closed"


def _finish(engine: Any, step: Step, token: str, result: _Outcome) -> tuple[bool, list[OutboxRow]]:
    return with_retry(
        lambda: attempts.finish(
            engine,
            token,
            outcome=result.outcome,
            output=result.output,
            error=result.error,
            retryable=result.retryable,
            patch=result.patch,
            leased=step.concurrency is not None,
            tags=result.tags,
        ),
        what="record attempt outcome",
        deadline_s=FINISH_DEADLINE_S,
    )
