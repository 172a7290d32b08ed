"""Inline steps: the next step of a run, run by the step worker that has just ticked it.

With eager ticks, the step worker that writes an attempt's outcome also runs the tick that
folds it. When that tick starts a step for the queue this worker's message came from,
publishing it only for a worker (often this one) to take it off the broker again costs a
publish, a hop, a claim and the consumer's bookkeeping: about half of a step. Instead the tick
inserts that one attempt already claimed by this worker, with no outbox row and no message
(``run_tick(keep=...)``, ``coordinator.TickClaim``), and the worker runs it right away, as if
its message had just arrived and been claimed (``ductor_inline_steps``; docs/architecture.md,
"Inline steps"):

- The claim is part of the tick's commit: the attempt is this worker's exactly as after a
  claim from a message. A worker that dies before or while running it leaves a claimed, open
  attempt, which the step's timeout (or heartbeat timeout) retries under a new token: what
  happens to a worker killed mid-step after a message.
- At most ``ductor_inline_steps`` attempts follow one message, and none is chosen once
  ``INLINE_BUDGET_S`` has passed since that message started: then the next step goes through
  the broker, so the messages waiting for this process are not held back for long.
- Only a step this process has registered, routed to the queue the message came from, with
  no concurrency limit (a lease is handed on through the broker path) and not a retry (whose
  arguments the store copies from the earlier attempt). A rate-limited attempt is claimed in
  the commit like any other, and the commit takes its token (``TickClaim.rate``); with none
  to take, the commit inserts it waiting in line instead, unclaimed, and the chain does not
  run it (docs/flow-control.md).
- With task events on, each inline attempt sends ``task-started`` (with its name and
  arguments) and ``task-succeeded`` under its own token, so Flower lists it as a task
  (runtime/task_events.py). After a slow step the next one's events go out at once (and a
  chain's first step's, unless it ran quickly last time in this process); a chain of quick
  steps publishes them every ``EVENTS_AT_MOST_EVERY_S`` and at its end (one broker publish
  costs more than a quick step), one ``task-succeeded`` per attempt that tells its start too.
- Held branches: after a quick step, the tick also gives the worker more branches of the same
  scatter (``TickClaim.held``, and earlier ones still in flight, adopted), which it claims and
  runs one after another, writing each outcome alone, before one tick folds them all
  (docs/architecture.md, "Held branches").
- One run per chain: a chain is bound to the run of the message that began it and claims
  nothing in a tick of any other run. Every claim it makes (in a commit, or of a held branch)
  records that message's task id as the attempt's carrier; a terminate or a run deadline
  revokes it with ``terminate=True``, which under prefork kills the process running the step
  (docs/operations.md, "Terminate reaches every running step"). One run per chain is what
  makes that kill safe.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..coordinator.port import RateTake, TickClaim
from ..coordinator.rows import outbox_row, step_intent
from ..engine.kinds import DispatchKind
from ..store.attempts import ClaimedAttempt
from ..store.outbox import OutboxRow
from ..store.schema import dumps_json
from .dispatch import MAX_CARRIED, QuickBranches

if TYPE_CHECKING:
    from ..coordinator.port import LoadedRun
    from ..engine import NewAttempt, TickPayload
    from .dispatch import CarriedBranches
    from .ports import WorkerPort
    from .step_context import Step

log = logging.getLogger("ductor_celery.step")

#: No inline attempt starts later than this after the message that began the chain.
INLINE_BUDGET_S = 5.0
#: At most this many branches of one scatter per tick for one worker (the one claimed in the
#: commit and the ones held after it), and only after a step quicker than HOLD_IF_QUICKER_S.
HOLD_MAX = 16
HOLD_IF_QUICKER_S = 0.005
#: After a quick step, the next inline attempt's task events wait for a later flush (each flush
#: is one broker publish, which costs more than a quick step), but never longer than this.
EVENTS_AT_MOST_EVERY_S = 0.05

#: How long each step (by name) took the last time it ran in this process: whether a chain's
#: first attempt, which has no step before it in the chain, is announced to Flower at once
#: (``InlineChain.flush_events_now``). One entry per registered step name.
_last_ran_by_step: dict[str, float] = {}


@dataclass(frozen=True, slots=True)
class _Held:
    """A branch held for this worker: a new attempt its tick left unclaimed with no message,
    or (``adopted``) an earlier one still in flight; the worker claims it when it gets to it."""

    token: str
    step: Step
    run_id: str
    node: str
    queue: str
    #: Dispatched by an earlier tick, with a message of its own.
    adopted: bool = False
    #: Its run's priority, for the message it gets if handed back (``release``).
    priority: int = 0


@dataclass
class InlineChain:
    """The attempts one step message's worker runs after its own, one at a time."""

    rt: WorkerPort
    #: The queue the message came from: only steps routed there are run inline.
    queue: str
    #: Makes this worker's claim identity (one per claim, as for a message's claim).
    identity: Callable[[], str]
    left: int
    deadline: float
    #: The task id of the message the chain runs in: written with each claim it makes, so a
    #: terminate can kill the step it runs by revoking this message (coordinator/rows.py,
    #: ``carrier_revokes``). None: a message with no id (a direct call), nothing recorded.
    carrier: str | None = None
    #: The one run whose attempts this chain runs (``bind``). A chain never runs another
    #: run's attempt: that is what makes killing its message on a terminate safe.
    run_id: str | None = None
    _chosen: tuple[ClaimedAttempt, Step, str] | None = None
    _kept: tuple[ClaimedAttempt, Step, str] | None = None
    _chosen_held: list[_Held] = field(default_factory=list)
    _held: list[_Held] = field(default_factory=list)
    #: The chosen attempt's rate-limit token, which its tick's commit takes (or not).
    _rate: RateTake | None = None
    #: How long the attempt this worker ran last took (``_holdable``).
    last_ran_s: float | None = None
    #: The step and node of the attempt this worker ran last, if it was quick: more of that
    #: node's branches go out bundled (``bundle``).
    _quick: tuple[str, str] | None = None
    #: A run whose outcome this worker wrote alone, to tick after its held branches.
    unticked: str | None = None
    #: A held branch claimed by the statement that wrote the outcome run before it.
    _claimed_next: tuple[ClaimedAttempt, Step, str] | None = None
    #: When this chain last published its buffered task events (``flush_events_now``).
    events_flushed_at: float = field(default_factory=time.monotonic)
    #: Choices whose commit this worker never saw succeed (``in_doubt``).
    _in_doubt: list[tuple[tuple[ClaimedAttempt, Step, str], list[_Held]]] = field(
        default_factory=list
    )

    @classmethod
    def start(
        cls,
        rt: WorkerPort,
        queue: str | None,
        identity: Callable[[], str],
        carrier: str | None = None,
        run_id: str | None = None,
    ) -> InlineChain | None:
        """A chain for a message delivered from ``queue`` with task id ``carrier``, for the
        run ``run_id`` if already known (else ``bind`` names it); None when inline steps are
        off."""
        limit = rt.settings.inline_steps
        if not queue or limit <= 0 or not rt.settings.eager_ticks:
            return None
        return cls(rt, queue, identity, limit, time.monotonic() + INLINE_BUDGET_S, carrier, run_id)

    def bind(self, run_id: str) -> None:
        """The run of the attempt the message claimed: the only run whose attempts this chain
        will run. Bound once; a chain asked to run another run's attempts refuses (``choose``)."""
        if self.run_id is None:
            self.run_id = run_id

    def choose(self, loaded: LoadedRun, payload: TickPayload) -> TickClaim | None:
        """``Keeper.choose``: the first of the tick's new attempts this worker may run, and,
        after a quick step, more branches of the same scatter to run after it (``held``).
        Only attempts of the chain's own run: its message (the carrier) is killed when that
        run is terminated, so it must never be running another run's step then."""
        self._doubt_chosen()  # clears the last choice
        self._rate = None
        if self._kept is not None or self.left <= 0 or time.monotonic() > self.deadline:
            return None
        if loaded.run_id != self.run_id:
            return None
        new = {a.token: a for a in payload.new_attempts}
        first: TickClaim | None = None
        first_node: str | None = None
        for dispatch in payload.dispatches:
            attempt = new.get(dispatch.token) if dispatch.kind == DispatchKind.STEP else None
            step = None if attempt is None else self._runnable(attempt)
            if attempt is None or step is None:
                continue
            if first is not None:
                if attempt.node == first_node and len(self._chosen_held) < self._holdable():
                    self._chosen_held.append(
                        _Held(
                            attempt.token,
                            step,
                            loaded.run_id,
                            attempt.node,
                            self.queue,
                            priority=loaded.priority,
                        )
                    )
                continue
            worker = self.identity()
            # The values as a claim would read them back: JSON, and no object the tick shares
            # (the arguments from their check's text when the tick kept it).
            args_json = attempt.args_text or dumps_json(attempt.args)
            args, context = json.loads(f"[{args_json},{dumps_json(payload.state.context)}]")
            claimed = ClaimedAttempt(
                token=attempt.token,
                run_id=loaded.run_id,
                workflow_id=loaded.workflow_id,
                node=attempt.node,
                branch=attempt.branch,
                generation=attempt.generation,
                attempt=attempt.attempt,
                step=attempt.step,
                args=dict(args or {}),
                context=dict(context or {}),
                spec_hash=loaded.spec_hash,
                queued_s=0.0,  # claimed in the commit that creates it
                workflow=loaded.workflow,
                trace_context=loaded.trace_context,
                args_text=args_json,
            )
            self._chosen = (claimed, step, worker)
            self._rate = (
                None
                if attempt.rate_key is None
                else RateTake(attempt.rate_key, attempt.rate_limit or 1, attempt.rate_period or 1)
            )
            first = TickClaim(attempt.token, worker, carrier=self.carrier, rate=self._rate)
            first_node = attempt.node
        if first is None:
            return None
        self._adopt(payload, first.token)
        if not any(not h.adopted for h in self._chosen_held):
            return first
        return TickClaim(
            first.token,
            first.worker,
            tuple(h.token for h in self._chosen_held if not h.adopted),
            carrier=self.carrier,
            rate=first.rate,
        )

    def _adopt(self, payload: TickPayload, first: str) -> None:
        """Room left after the new branches: earlier branches of the same scatter still in
        flight, whose messages may still wait in the broker. The worker tries to claim each
        as it gets to it; one another worker claimed first is skipped, and a message for one
        this worker claimed is dropped as a duplicate where it arrives."""
        assert self._chosen is not None
        claimed = self._chosen[0]
        room = self._holdable() - len(self._chosen_held)
        node = payload.state.nodes.get(claimed.node)
        if room <= 0 or node is None or node.scatter is None:
            return
        taken = {first, *(h.token for h in self._chosen_held)}
        step = self._chosen[1]
        queue = self.queue
        for _, branch in sorted(node.scatter.branches.items(), reverse=True):
            if room <= 0:
                break
            if branch.token is None or branch.token in taken:
                continue
            self._chosen_held.append(
                _Held(branch.token, step, claimed.run_id, claimed.node, queue, adopted=True)
            )
            room -= 1

    def _runnable(self, attempt: NewAttempt) -> Step | None:
        """The step of a new attempt this worker may run itself: registered here, routed to
        this queue, with no concurrency limit (a lease is handed on through the broker path),
        not a retry (the store copies a retry's arguments from the earlier attempt row). A
        rate-limited one is chosen too: the chain takes its token before running it."""
        if attempt.args_from is not None or attempt.lease_key is not None:
            return None
        if (attempt.queue or self.rt.settings.steps_queue) != self.queue:
            return None
        step = self.rt.step_named(attempt.step)
        return None if step is None or step.concurrency is not None else step

    def _holdable(self) -> int:
        """How many more branches to hold after the chosen one: none after a slow step (held
        branches run one after another here while other workers might run them at once)."""
        if self.last_ran_s is None or self.last_ran_s > HOLD_IF_QUICKER_S:
            return 0
        return max(0, min(HOLD_MAX - 1, self.left - 1))

    def committed(self) -> None:
        """``Keeper.committed``: the attempts chosen for the commit are now this worker's."""
        if self._chosen is not None:
            # A rate-limited attempt whose commit found no token waits in line, unclaimed.
            refused = self._rate is not None and self._rate.taken is False
            self._kept, self._chosen = (None if refused else self._chosen), None
            self.left -= 1 + len(self._chosen_held)
            self._held.extend(self._chosen_held)
            self._chosen_held = []

    def refused(self) -> None:
        """``Keeper.refused``: the commit wrote nothing, so the choice made for it is void."""
        self._chosen, self._chosen_held = None, []

    def _doubt_chosen(self) -> None:
        """The last choice was never confirmed (``committed``): its commit failed, or landed
        with its answer lost (the connection dropped after PostgreSQL committed). Kept for
        ``in_doubt``; a commit that did not land is told apart there."""
        if self._chosen is not None:
            self._in_doubt.append((self._chosen, self._chosen_held))
        self._chosen, self._chosen_held = None, []

    def in_doubt(self) -> tuple[ClaimedAttempt, Step, str] | None:
        """The next choice whose commit this worker never saw succeed: the caller looks up
        whether the database has its attempt open and claimed by the identity it carried
        (``claimed.token``, the ``str``), and if so runs it (``confirm``). Only this worker
        holds that identity: if it moved on, the step would wait for its timeout. A choice
        whose commit did not land finds its attempt absent, unclaimed, finished, or claimed
        under another identity (the retry's own claim of the same attempt)."""
        self._doubt_chosen()
        if not self._in_doubt:
            return None
        return self._in_doubt[0][0]

    def confirm(self, ours: bool) -> None:
        """The answer for ``in_doubt``'s choice: claimed by this worker (its held branches are
        then held again, claimed one by one as after any commit), or not."""
        _, held = self._in_doubt.pop(0)
        if ours:
            self.left -= 1 + len(held)
            self._held.extend(held)

    def ran(self, seconds: float, step: str | None = None, node: str | None = None) -> None:
        """The attempt just run (of ``step`` at ``node``, when named) took ``seconds``. After
        a slow one, the branches held behind it go back to the broker: other workers may run
        them at once."""
        self.last_ran_s = seconds
        quick = seconds <= HOLD_IF_QUICKER_S
        self._quick = (step, node) if quick and step is not None and node is not None else None
        if step is not None:
            _last_ran_by_step[step] = seconds
        if not quick:
            self.release()

    def bundle(self, rows: list[OutboxRow]) -> list[OutboxRow]:
        """The rows a tick of this chain sends, with the step messages of more branches of
        the scatter node whose attempt this worker has just run quickly bundled: one message
        for up to ``HOLD_MAX`` of them, carrying the others' tokens (``dispatch.HELD_HEADER``).
        The worker taking it runs them one after another, as held branches: what this chain
        would have done with them, had it not run out of ``ductor_inline_steps`` or of
        ``INLINE_BUDGET_S``, or room to hold them. One message per branch would have the
        workers' chains adopt most of them first, leaving their messages to be delivered and
        dropped as duplicates, each costing about what a task costs.

        Only branches of the chain's run at that node, of the step just run (quick: under
        ``HOLD_IF_QUICKER_S``), routed to this queue, with no concurrency limit. Every row is
        still sent and forgotten as before: a bundled branch's outbox row is deleted once its
        bundle is sent, and one whose message is lost is re-sent by the tick after
        ``ductor_resend_unclaimed_after``, as any lost message is.

        A chain that has run nothing yet (a run's first tick, ``steps.first_tick``) bundles
        a scatter's first branches when their step ran quickly the last time it ran in this
        process (``_last_ran_by_step``): a quick scatter's first fill is then a few messages,
        not one per branch (``max_parallel``, 64 by default)."""
        if self.run_id is None or len(rows) < 2:  # a chain's tick: one row, nothing to bundle
            return rows
        steps_queue = self.rt.settings.steps_queue
        if self.last_ran_s is None:
            for quick in self._quick_before(rows):
                rows = bundle_rows(rows, self.run_id, quick, steps_queue)
            return rows
        just_ran = self.quick()
        return rows if just_ran is None else bundle_rows(rows, self.run_id, just_ran, steps_queue)

    def _quick_before(self, rows: list[OutboxRow]) -> list[QuickBranches]:
        """The nodes of ``rows``' step messages whose step ran quickly the last time it ran
        in this process, of a step registered here with no concurrency limit."""
        found: dict[tuple[str, str], None] = {}
        for row in rows:
            last = _last_ran_by_step.get(row.task)
            if row.kind == DispatchKind.STEP and last is not None and last <= HOLD_IF_QUICKER_S:
                if may_bundle(self.rt, row.task):
                    found[(row.task, str(row.payload.get("node")))] = None
        return [QuickBranches(step, node, self.queue) for step, node in found]

    def quick(self) -> QuickBranches | None:
        """The node whose attempt this worker has just run quickly, when more of its branches
        may go out bundled: of a step registered here with no concurrency limit (a lease is
        handed on through the broker path), on this chain's queue."""
        if self._quick is None or not may_bundle(self.rt, self._quick[0]):
            return None
        return QuickBranches(*self._quick, self.queue)

    def carry(self, carried: CarriedBranches, step: Step) -> bool:
        """Hold the attempts a bundled message carries (``dispatch.HELD_HEADER``), to claim
        and run after the message's own attempt, as held branches; False (none held) when
        they are not this chain's run's or would exceed ``MAX_CARRIED``."""
        self.bind(carried.run_id)
        if self.run_id != carried.run_id or len(self._held) + len(carried.tokens) > MAX_CARRIED:
            return False
        self._held.extend(
            _Held(t, step, carried.run_id, carried.node, self.queue, priority=carried.priority)
            for t in carried.tokens
        )
        self.left -= len(carried.tokens)
        return True

    def flush_events_now(self, held: bool, step: str | None = None) -> bool:
        """Whether the next inline attempt's (of ``step``) ``task-started`` goes out at once
        (with what is buffered). Not for a held branch, nor after a quick step while the
        last flush is recent: a chain of quick steps publishes its events every
        ``EVENTS_AT_MOST_EVERY_S`` and at its end instead of once per step. After a slow step
        it goes out at once, so Flower sees a long step start (one that follows quick ones
        shows when it ends or at the next flush). A chain's first attempt, with no step run
        before it in the chain (a run's first tick's), counts as after a quick one when the
        same step ran quickly last time in this process (``_last_ran_by_step``)."""
        now = time.monotonic()
        before = self.last_ran_s
        if before is None and step is not None:
            before = _last_ran_by_step.get(step)
        quick = before is not None and before <= HOLD_IF_QUICKER_S
        if held or (quick and now - self.events_flushed_at < EVENTS_AT_MOST_EVERY_S):
            return False
        self.events_flushed_at = now
        return True

    @property
    def holding(self) -> bool:
        """Branches are held for this worker after the attempt it is running: its outcome is
        written alone, and the tick waits for the last of them."""
        return bool(self._held)

    @property
    def kept(self) -> tuple[ClaimedAttempt, Step, str] | None:
        return self._kept

    @property
    def has_next(self) -> bool:
        """An attempt is claimed for this worker to run next (by a tick, or with the last
        held outcome), or branches are held for it, or a claim's commit is in doubt."""
        return (
            self._kept is not None
            or self._claimed_next is not None
            or bool(self._held)
            or self._chosen is not None
            or bool(self._in_doubt)
        )

    def pop(self) -> tuple[ClaimedAttempt, Step, str] | None:
        """The attempt to run next (claimed by the worker identity returned with it)."""
        kept, self._kept = self._kept, None
        return kept

    def claimable_held(self) -> tuple[list[str], Step] | None:
        """The tokens of the held branches, in order, as far as they are of the next one's
        step, when one statement may claim the first of them that is still claimable
        (``store.held_claims``): a step with no rate limit (whose claim takes its bucket's
        token) and no concurrency limit. None: claim them one by one (``pop_held``)."""
        if not self._held:
            return None
        step = self._held[0].step
        if step.rate_limit is not None or step.concurrency is not None:
            return None
        tokens: list[str] = []
        for held in self._held:
            if held.step is not step:
                break
            tokens.append(held.token)
        return tokens, step

    def took(self, tokens: list[str], through: str | None) -> None:
        """After one statement dealt with the held ``tokens`` (``claimable_held``) up to
        ``through`` (claimed it, or left it to the ordinary claim): those before it could not
        be claimed, and they and it are no longer held; all of them when ``through`` is None
        (none was claimable)."""
        del self._held[: len(tokens) if through is None else tokens.index(through) + 1]

    def claimed_next(self, claimed: ClaimedAttempt, step: Step, worker: str) -> None:
        """A held branch claimed (by ``worker``) after the attempt running now: it runs next
        (``pop_claimed``)."""
        self._claimed_next = (claimed, step, worker)

    def pop_claimed(self) -> tuple[ClaimedAttempt, Step, str] | None:
        """The held branch claimed with the outcome before it (``took``), if any."""
        claimed, self._claimed_next = self._claimed_next, None
        return claimed

    def pop_held(self) -> tuple[str, Step] | None:
        """The next held branch (not claimed yet: the caller claims it, as for a message)."""
        if not self._held:
            return None
        held = self._held.pop(0)
        return held.token, held.step

    def release(self) -> None:
        """Send the step messages of held branches this worker will not run (it is stopping,
        or a step raised through the chain), so another worker takes them now rather than
        when the tick re-sends them. A message lost here is re-sent by that tick."""
        held, self._held = [h for h in self._held if not h.adopted], []
        send_held(self.rt, held)


def bundle_rows(
    rows: list[OutboxRow], run_id: str, quick: QuickBranches, steps_queue: str
) -> list[OutboxRow]:
    """``rows`` as sent, the step messages of the run's branches at ``quick``'s node (of its
    step, routed to its queue) bundled up to ``HOLD_MAX`` to a message, by priority: the first
    of each bundle carries the others' tokens (``payload["held"]``, sent in its
    ``HELD_HEADER``) in its place among the rows, and they are left out. Every other row
    stays as it is, in its order."""
    chunks: dict[int, list[int]] = {}  # the index of a chunk's lead -> the chunk's indices
    filling: dict[int, list[int]] = {}  # by priority: the chunk being filled
    for i, row in enumerate(rows):
        if (
            row.kind != DispatchKind.STEP
            or row.run_id != run_id
            or row.task != quick.step
            or row.payload.get("node") != quick.node
            or (row.queue or steps_queue) != quick.queue
        ):
            continue
        priority = int(row.payload.get("priority") or 0)
        chunk = filling.get(priority)
        if chunk is None or len(chunk) == HOLD_MAX:
            chunk = filling[priority] = chunks[i] = []
        chunk.append(i)
    carried = {j for chunk in chunks.values() for j in chunk[1:]}
    if not carried:
        return rows
    out: list[OutboxRow] = []
    for i, row in enumerate(rows):
        if i in carried:
            continue
        if len(chunk := chunks.get(i, [])) > 1:
            held = [rows[j].payload["token"] for j in chunk[1:]]
            row = dataclasses.replace(row, payload={**row.payload, "held": held})
        out.append(row)
    return out


def bundler(
    rt: WorkerPort, run_id: str, quick: QuickBranches | None
) -> Callable[[list[OutboxRow]], list[OutboxRow]] | None:
    """How a tick woken with ``quick`` (``dispatch.QUICK_HEADER``) sends its rows: bundled
    when that step is registered in this process with no concurrency limit; else as they are.
    The hint is a step worker's (its own tick found the run busy): a tick on the coordinator
    queue sends the node's branches bundled, as that worker's tick would have. A bundle whose
    first step turns out slow hands the rest back as messages of their own."""
    if quick is None or not may_bundle(rt, quick.step):
        return None
    return lambda rows: bundle_rows(rows, run_id, quick, rt.settings.steps_queue)


def may_bundle(rt: WorkerPort, step_name: str) -> bool:
    """Whether messages of ``step_name`` may go out bundled from this process: a step
    registered here with no concurrency limit (a lease is never held by a message waiting
    behind another one's step)."""
    step = rt.step_named(step_name)
    return step is not None and step.concurrency is None


def send_held(rt: WorkerPort, held: list[_Held]) -> None:
    """A message of its own for each held attempt this worker will not run."""
    if not held:
        return
    # Sent now, never inserted: no id.
    rows = [
        outbox_row(0, step_intent(h.run_id, h.token, h.node, h.step.name, h.queue, h.priority))
        for h in held
    ]
    try:
        rt.dispatcher.send(rows)
    except Exception as exc:  # noqa: BLE001 - the tick re-sends unclaimed attempts
        log.warning("held attempts not handed back (%s); they are re-sent later", exc)


def hand_back(rt: WorkerPort, carried: CarriedBranches, step: Step, queue: str) -> None:
    """The attempts a bundled message carries, sent back as messages of their own: this
    worker will not run them (it runs no inline steps, or they are not its chain's)."""
    send_held(
        rt,
        [
            _Held(t, step, carried.run_id, carried.node, queue, priority=carried.priority)
            for t in carried.tokens
        ],
    )
