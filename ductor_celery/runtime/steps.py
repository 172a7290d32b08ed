"""What runs inside a step worker: one attempt's execution, from its claim to its outcome
written and the tick after it (execute, first tick, record and advance). Calling the step and
the outcome that comes to: outcome.py; the Step object and StepContext: step_context.py."""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..coordinator import SETTLED_TICKS, OutcomeNotCarried, TickOutcome
from ..coordinator.read_rows import attempt_result
from ..engine import AttemptResult
from ..engine.status import AttemptOutcome
from ..store import attempts, held_claims, next_read, wakes
from ..store.db import ValuesRefused, keeping_autocommit, outages, with_retry
from ..store.held_claims import HeldClaim
from ..store.outbox import OutboxRow
from ..store.rates import RateHeld
from ..store.schema import dumps_json
from . import metrics
from .dispatch import FIRST_TICK_TASK_NAME
from .failpoints import failpoint
from .inline import InlineChain, hand_back
from .lost_outcomes import lost_outcomes
from .outbox_janitor import sent_outbox
from .outcome import Outcome, call_attempt, invalid, prepare_call
from .step_context import Step
from .task_events import (
    TaskEvents,
    as_current_task,
    events_enabled,
    flush_events,
    publishing_after,
    tick_done,
)
from .tick_task import Keeper, run_tick

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from .dispatch import CarriedBranches
    from .ports import WorkerPort

log = logging.getLogger("ductor_celery.step")

#: How long a worker keeps trying to write a finished attempt's outcome to the database.
FINISH_DEADLINE_S = 600.0


def worker_identity(hostname: str | None) -> str:
    """Who claims: host and pid for people, plus a nonce that makes each claim unique."""
    return f"{(hostname or socket.gethostname())[:150]}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


def _wake_needed(engine: Engine, run_id: str) -> bool:
    try:
        return with_retry(lambda: wakes.request_wake(engine, run_id), what="request wake-up")
    except Exception as exc:  # noqa: BLE001 - a wake-up is a hint: send it when unsure
        log.warning("wake-up bookkeeping for run %s failed (%s); waking anyway", run_id, exc)
        return True


# -- one attempt --------------------------------------------------------------------------------


def execute_attempt(
    rt: WorkerPort,
    step: Step,
    token: str,
    hostname: str | None = None,
    queue: str | None = None,
    carrier: str | None = None,
    held: CarriedBranches | None = None,
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
    ``held``: more branches a bundled message carries (``dispatch.HELD_HEADER``), run after
    the message's own attempt as held branches, even when that one is a duplicate; handed
    back as messages of their own when this worker runs no inline chain.
    """
    engine = rt.engine()
    chain = InlineChain.start(rt, queue, lambda: worker_identity(hostname), carrier)
    me = worker_identity(hostname)
    claimed = _claim(engine, token, me, step, carrier)
    if held is not None:
        _carry(rt, chain, claimed, held, step, queue)
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
        _run_inline(rt, engine, chain, hostname)  # what the message carries, if anything
        return "rate-limited"
    if claimed is None:
        log.info("attempt %s already claimed or closed; message ignored", token)
        _run_inline(rt, engine, chain, hostname)  # what the message carries, if anything
        return "duplicate"
    if chain is not None:
        chain.bind(claimed.run_id)
    try:
        outcome = _run_claimed(rt, engine, step, claimed, me, chain)
    except BaseException:
        if chain is not None:
            chain.release()  # what its message carried goes back now, as messages of their own
        raise
    _run_inline(rt, engine, chain, hostname)
    return outcome


def _carry(
    rt: WorkerPort,
    chain: InlineChain | None,
    claimed: attempts.ClaimedAttempt | attempts.WrongStep | RateHeld | None,
    held: CarriedBranches,
    step: Step,
    queue: str | None,
) -> None:
    """Hold what a bundled message carries for this worker's chain, or hand it back as
    messages of their own: when this worker runs no chain, or the message's own attempt is
    another run's. Nothing of a message for the wrong step is run or sent."""
    if isinstance(claimed, attempts.WrongStep):
        log.warning(
            "message %s for the wrong step carries %d more; dropped",
            claimed.token,
            len(held.tokens),
        )
        return
    if isinstance(claimed, attempts.ClaimedAttempt) and claimed.run_id != held.run_id:
        log.warning("message %s carries attempts of another run; handed back", claimed.token)
    elif chain is not None and chain.carry(held, step):
        return
    hand_back(rt, held, step, queue or step.queue or rt.settings.steps_queue)


def first_tick(
    rt: WorkerPort,
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
    attempt the chain claims (``execute_attempt``), and the id its task event names
    (``task_events.tick_done``: Celery sends none for this task).
    """
    began = time.time()
    if not rt.settings.eager_ticks:
        # This worker ticks nothing itself (a client configured otherwise sent it here).
        rt.wake(run_id)
        _start_message_done(rt, hostname, carrier, run_id, began, "forwarded")
        flush_events(rt.app, hostname)
        return "forwarded"
    engine = rt.engine()
    chain = InlineChain.start(rt, queue, lambda: worker_identity(hostname), carrier, run_id)
    # The task's result (Flower shows its repr): the tick's outcome as plain text, or "failed".
    tick: str
    with keeping_autocommit(engine):  # the first tick's connection serves the chain's
        try:
            tick = run_tick(rt, run_id, eager=True, keep=chain, first=True).value
        except Exception as exc:  # noqa: BLE001 - the coordinator can always do it instead
            log.warning("first tick of run %s failed (%s); waking the coordinator", run_id, exc)
            tick = "failed"
        # What the chain did not publish (it had nothing to run, or did not run), the start
        # message's event included: never left in the thread's buffer for another task's
        # publish (a timer publishes it soon, or at once when this raises).
        with publishing_after(rt.app, hostname):
            if tick in SETTLED_TICKS:
                # Before the chain's steps: it goes out with their events.
                _start_message_done(rt, hostname, carrier, run_id, began, tick)
                _run_inline(rt, engine, chain, hostname)
            else:
                rt.wake(run_id)
                _start_message_done(rt, hostname, carrier, run_id, began, tick)
                if chain is not None and chain.has_next:
                    # A try of this tick may have landed with its answer lost, claiming the
                    # run's first step for this worker, before a retry failed or found the
                    # run busy: the chain runs it if so (``InlineChain.in_doubt``).
                    try:
                        _run_inline(rt, engine, chain, hostname)
                    except Exception as exc:  # noqa: BLE001 - its step times out, as a lost worker's
                        log.warning("run %s: a claim in doubt not looked up (%s)", run_id, exc)
    return tick


def _start_message_done(
    rt: WorkerPort,
    hostname: str | None,
    carrier: str | None,
    run_id: str,
    began: float,
    result: str,
) -> None:
    """The start message's one task event (``task_events.tick_done``), buffered."""
    if carrier is None:  # called with no message (a test's direct call)
        return
    tick_done(
        rt.app,
        hostname,
        task_id=carrier,
        name=FIRST_TICK_TASK_NAME,
        args=[run_id],
        began=began,
        result=result,
    )


def _run_inline(
    rt: WorkerPort, engine: Engine, chain: InlineChain | None, hostname: str | None
) -> None:
    """Run what the chain's ticks claimed or held for this worker (or its message carried),
    one after another."""
    if chain is None or not (chain.has_next or chain.unticked):
        return
    try:
        # One autocommit connection for the chain's claims, reads and commits.
        with publishing_after(rt.app, hostname), keeping_autocommit(engine):
            events_on = events_enabled(rt.app)  # once per chain, not at every step
            while (kept := _next_inline(rt, engine, chain)) is not None:
                next_claimed, next_step, next_me, held = kept
                events = TaskEvents(rt.app, hostname, next_claimed, events_on)
                events.started(flush=chain.flush_events_now(held, next_step.name))
                try:
                    with as_current_task(next_step, next_claimed, hostname, chain.queue):
                        next_outcome = _run_claimed(
                            rt, engine, next_step, next_claimed, next_me, chain
                        )
                except BaseException as exc:  # the process stops, or the store is gone
                    events.failed(exc)
                    raise
                events.finished(next_outcome)
    finally:
        chain.release()
        next_read.forget()


def _claim(
    engine: Engine, token: str, me: str, step: Step, carrier: str | None
) -> attempts.ClaimedAttempt | attempts.WrongStep | RateHeld | None:
    """The claim a message's attempt and a held branch both take (retried on a dropped
    connection: the identity is unique per claim, so a retry finds its own claim), recording
    the message it runs under (``carrier``)."""
    return with_retry(
        functools.partial(attempts.claim, engine, token, me, step=step.name, carrier=carrier),
        what="claim attempt",
    )


def _next_inline(
    rt: WorkerPort, engine: Engine, chain: InlineChain
) -> tuple[attempts.ClaimedAttempt, Step, str, bool] | None:
    """The chain's next attempt: the one its last tick claimed, else the held branch claimed
    with the last outcome, else the next held branch this worker can still claim (one closed
    or taken meanwhile is skipped, as a message for it would be); once none is left, the
    tick of outcomes written alone (which may hold more)."""
    while True:
        kept = chain.pop()
        if kept is not None:
            return (*kept, False)
        claimed_next = chain.pop_claimed()
        if claimed_next is not None:
            return (*claimed_next, True)
        together = chain.claimable_held() if attempts.finishes_in_tick(engine) else None
        if together is not None:
            # The first of them still claimable, in one statement (after a message's own
            # attempt: a bundle's carried branches, some maybe taken by other workers).
            tokens, step = together
            me = chain.identity()
            _take_next(
                engine, chain, tokens, step, me, _claim_first(engine, tokens, me, step, chain)
            )
            continue
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
        doubt = chain.in_doubt()
        if doubt is not None:
            ours = _still_claimed_by(engine, doubt[0].token, doubt[2])
            chain.confirm(ours)
            if ours:
                log.warning(
                    "attempt %s: claimed for this worker by a commit whose answer was lost "
                    "(the connection dropped after it committed); running it",
                    doubt[0].token,
                )
                return (*doubt, False)
            continue
        if chain.unticked is None:
            return None
        run_id, chain.unticked = chain.unticked, None
        _advance_run(rt, engine, run_id, chain)


def _still_claimed_by(engine: Engine, token: str, me: str) -> bool:
    """Whether the attempt is open and claimed by the identity ``me`` (unique per claim)."""
    found = with_retry(
        lambda: attempts.open_claims(engine, [token]), what="look up a claim in doubt"
    )
    return found.get(token) == me


def _claim_first(
    engine: Engine,
    tokens: list[str],
    me: str,
    step: Step,
    chain: InlineChain,
    finished: AttemptResult | None = None,
) -> HeldClaim:
    """``held_claims.claim_first`` for the chain's run, retried on a dropped connection (the
    identity is unique per claim, so a retry finds its own claim)."""
    assert chain.run_id is not None  # bound by the claim or the bundle that held them
    return with_retry(
        functools.partial(
            held_claims.claim_first,
            engine,
            tokens,
            me,
            run_id=chain.run_id,
            step=step.name,
            carrier=chain.carrier,
            finished=finished,
        ),
        what="claim held attempt" if finished is None else "record attempt outcome",
        # As long as the outcome's own write would be retried.
        **({} if finished is None else {"deadline_s": FINISH_DEADLINE_S}),
    )


def _take_next(
    engine: Engine, chain: InlineChain, tokens: list[str], step: Step, me: str, taken: HeldClaim
) -> None:
    """What a held claim over ``tokens`` found: the branch it claimed (by ``me``) runs next;
    one it left to the ordinary claim (a rate limit, a lease) is claimed so now, and runs
    next if that claim takes it (a rate-limited one may be marked waiting in line instead,
    for the sweeper to send when its bucket has a token)."""
    chain.took(tokens, taken.through)
    if taken.claimed is not None:
        chain.claimed_next(taken.claimed, step, me)
    elif taken.ordinary is not None:
        worker = chain.identity()
        claimed = _claim(engine, taken.ordinary, worker, step, chain.carrier)
        if isinstance(claimed, attempts.ClaimedAttempt):
            chain.claimed_next(claimed, step, worker)


def _record_then_claim(
    rt: WorkerPort,
    engine: Engine,
    step: Step,
    claimed: attempts.ClaimedAttempt,
    result: Outcome,
    chain: InlineChain,
) -> str:
    """A held branch's outcome, written alone (its tick comes after the last held branch),
    with the claim of the next held branch this worker can still claim, in one statement
    (``store.held_claims``); the outcome written, or "closed". Values the database refuses,
    an attempt finished or closed meanwhile, and a step whose claim takes a rate-limit token
    take the ordinary path (``_record``; the next claim then comes on its own)."""
    together = chain.claimable_held()
    if together is None or not attempts.finishes_in_tick(engine):
        return _record(rt, engine, step, claimed.token, result)
    tokens, next_step = together
    me = chain.identity()
    finished = _carried(claimed, result)  # its values as the row will hold them
    try:
        taken = _claim_first(engine, tokens, me, next_step, chain, finished)
    except ValuesRefused:
        return _record(rt, engine, step, claimed.token, result)  # writes why, as a failure
    _take_next(engine, chain, tokens, next_step, me, taken)
    # Fault tests: die holding branches, with outcomes written alone and not ticked, and the
    # next one claimed with the last of them, not started (its timeout retries it).
    failpoint("between_held_branches")
    if not taken.written:
        return _record(rt, engine, step, claimed.token, result)
    return result.outcome.value


def _run_claimed(
    rt: WorkerPort,
    engine: Engine,
    step: Step,
    claimed: attempts.ClaimedAttempt,
    me: str,
    chain: InlineChain | None,
) -> str:
    """Run a claimed attempt and make sure a tick folds its outcome; the outcome."""
    limit = rt.settings.max_payload_bytes
    call = prepare_call(rt, step, claimed)
    metrics.record_claim(step.name, claimed.queued_s)
    began = time.perf_counter()
    result, interrupt = call_attempt(engine, step, claimed, me, limit, call)
    ran_s = time.perf_counter() - began
    remember = (
        None if interrupt is not None else _keep_until_safe(rt, engine, step, claimed, me, result)
    )
    # A process about to stop takes no next step (it would be left claimed until its timeout).
    keep = None if interrupt is not None else chain
    try:
        if keep is not None:
            keep.ran(ran_s, step.name, claimed.node)
        try:
            if keep is not None and keep.holding:
                # More branches of this run are held for this worker: write the outcome alone,
                # claiming the next of them; the tick after the last of them folds them all.
                outcome = _record_then_claim(rt, engine, step, claimed, result, keep)
                keep.unticked = claimed.run_id
            else:
                outcome = _record_and_advance(rt, engine, step, claimed, result, keep)
        except Exception:
            if remember is not None:
                remember(False)  # not written: written once the database is back
            raise
        if remember is not None:
            remember(True)
        if outcome == "closed":
            outcome = _written_by_this_claim(engine, claimed.token, me, result) or outcome
        if outcome != "closed":  # a closed attempt was counted by the tick that closed it
            metrics.record_attempt(step.name, outcome, ran_s)
    finally:
        if interrupt is not None:
            raise interrupt
    return outcome


def _keep_until_safe(
    rt: WorkerPort,
    engine: Engine,
    step: Step,
    claimed: attempts.ClaimedAttempt,
    me: str,
    result: Outcome,
) -> Callable[[bool], None] | None:
    """Get ready to remember the outcome about to be written, to write it again if a failover
    loses the commit (runtime/lost_outcomes.py). Call what this returns once the write
    returned (True) or gave up (False: then it is written once the database is back)."""
    keeper = lost_outcomes(rt.settings.database_url, prepare=rt.settings.database_prepare)
    if keeper is None:
        return None
    try:
        # About the outcome's bytes in memory: its output's text when its check made one.
        output = dumps_json(result.output) if result.output_text is None else result.output_text
        size = len(output) + len(dumps_json([result.patch, result.error]))
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


def _record_and_advance(
    rt: WorkerPort,
    engine: Engine,
    step: Step,
    claimed: attempts.ClaimedAttempt,
    result: Outcome,
    keep: Keeper | None = None,
) -> str:
    """Write the outcome, then make sure a tick folds it.

    With eager ticks on PostgreSQL, an unleased attempt's outcome is carried by the eager
    tick: computed with as one more result and written, finished and folded at once, by the
    tick's commit (``run_tick``'s ``carried``; docs/one-statement-step.md). Anything else (the
    run busy, the attempt closed meanwhile, values the database refuses, a tick that fails or
    commits nothing) falls back to the ordinary path: write the outcome alone, then tick or
    wake.

    ``keep``: handed to the eager tick (runtime/inline.py), which may claim one of the steps
    it starts for this worker to run next.
    """
    token, run_id = claimed.token, claimed.run_id
    tick: TickOutcome | None = None
    if rt.settings.eager_ticks and step.concurrency is None and attempts.finishes_in_tick(engine):
        try:
            tick = run_tick(rt, run_id, eager=True, carried=_carried(claimed, result), keep=keep)
        except OutcomeNotCarried:
            tick = None
        except Exception as exc:  # noqa: BLE001 - the ordinary path below still writes it
            log.warning("eager tick of run %s failed (%s); recording on its own", run_id, exc)
        if tick == TickOutcome.COMMITTED:
            # The outcome's value: the task's result, shown by Flower, is the plain string.
            return result.outcome.value
    outcome = _record(rt, engine, step, token, result)
    if tick == TickOutcome.BUSY:  # another tick holds the run: the coordinator folds it
        _wake_coordinator(rt, engine, run_id, keep)
    else:
        _advance_run(rt, engine, run_id, keep)
    return outcome


def _written_by_this_claim(engine: Engine, token: str, me: str, result: Outcome) -> str | None:
    """The outcome, when the attempt its write found closed was finished with it under this
    very claim: this worker's own commit wrote it, and the worker did not see that commit
    succeed (its answer lost when the connection dropped after it committed; a carried
    tick that raised after its commit), so the write that followed found it finished.
    Reported as what it is (the task's result, the attempt metrics), not as an attempt
    someone else closed. A ``cancelled`` outcome stays "closed": a tick closing the attempt
    writes that one too. Asked only when a write found its attempt closed; a lookup that
    fails leaves it "closed", as before."""
    if result.outcome == AttemptOutcome.CANCELLED:
        return None
    try:
        found = with_retry(
            lambda: attempts.finished_as(engine, token),
            what="look up a closed attempt's outcome",
            deadline_s=30.0,
        )
    except Exception as exc:  # noqa: BLE001 - only what the step's result says depends on it
        log.warning("attempt %s: closed, its outcome not looked up (%s)", token, exc)
        return None
    if found != (me, result.outcome.value):
        return None
    log.warning(
        "attempt %s: its outcome was written by this worker's own commit, which it did not "
        "see succeed (its answer lost)",
        token,
    )
    return result.outcome.value


def _carried(claimed: attempts.ClaimedAttempt, result: Outcome) -> AttemptResult:
    """The outcome as the tick's load would read it back from the attempt row: its values as
    JSON stores them (what the commit writes), so the tick computes with what is stored and
    shares no object with the step.

    A checked success's values are that already (``Outcome.checked``: the JSON checks' own
    decoding of the step's values, tags built for it), so they go as they are, marked checked
    (the tick's guard against bad rows does not check them again). Any other outcome goes
    through JSON: a redacted value was changed after its checks, and an error may be a
    constant shared by every attempt stopped the same way."""
    checked = result.checked and result.outcome == AttemptOutcome.SUCCEEDED
    values = [result.output, result.error, result.patch, result.tags]
    output, error, patch, tags = values if checked else json.loads(dumps_json(values))
    return attempt_result(
        claimed.token,
        claimed.node,
        result.outcome,
        output,
        error,
        result.retryable,
        patch,
        claimed.branch,
        tags,
        checked=checked,
        output_text=result.output_text if checked else None,
    )


def _advance_run(rt: WorkerPort, engine: Engine, run_id: str, keep: Keeper | None = None) -> None:
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
    _wake_coordinator(rt, engine, run_id, keep)


def _wake_coordinator(
    rt: WorkerPort, engine: Engine, run_id: str, keep: Keeper | None = None
) -> None:
    """Coalesced: when a wake-up of the run is already queued, its tick will see the outcome
    and no message is sent. After a quick scatter branch (``keep``, an inline chain), the
    wake-up names its node, so the coordinator's tick sends that node's new branches bundled
    (``dispatch.QUICK_HEADER``)."""
    if not _wake_needed(engine, run_id):
        return
    quick = keep.quick() if isinstance(keep, InlineChain) else None
    if quick is None:
        rt.wake(run_id)
    else:
        rt.dispatcher.wake(run_id, quick)


def _record(rt: WorkerPort, engine: Engine, step: Step, token: str, result: Outcome) -> str:
    """Write the outcome and hand on the lease it held; the outcome written, or "closed" when
    the attempt was closed first.

    Last line of defence: if the database refuses the values (a payload the check let
    through), a failure without them is written instead, so the attempt never stays open.
    """
    try:
        written, granted = _finish(engine, step, token, result)
    except ValuesRefused as refused:
        what = "result or context patch" if result.outcome == AttemptOutcome.SUCCEEDED else "error"
        problem = f"step {step.name!r} {what} could not be stored: {refused.cause}"
        log.error("attempt %s: %s; recording the attempt as failed without it", token, problem)
        result = invalid(problem)
        written, granted = _finish(engine, step, token, result)
    if granted:
        # This attempt's lease went to a waiting attempt: send its step message now (the
        # sweeper relays it if we die first), then clear the outbox rows.
        rt.dispatcher.send(granted)
        sent_outbox(engine).add([r.id for r in granted])
    return result.outcome.value if written else "closed"


def _finish(
    engine: Engine, step: Step, token: str, result: Outcome
) -> tuple[bool, list[OutboxRow]]:
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
