"""The rows a commit writes for a payload, shaped once for every store: the outbox intents
and the transitions. ``store/ticks.py`` inserts them in SQL, ``fakes.InMemoryStore`` keeps
them in dicts; sharing this code is what makes the two commits agree."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import datetime
from typing import Any, NotRequired, TypedDict

from ..engine import AttemptResult, TickPayload
from ..engine.inputs import Dispatch
from ..engine.kinds import DispatchKind
from .port import OutboxRow, TickClaim


class AttemptMessage(TypedDict):
    """The payload of a step or revoke row: the attempt it is about."""

    token: str
    run_id: str
    node: str
    #: A step message of a run with a priority (1..9): the broker priority it is sent with.
    priority: NotRequired[int]
    #: A revoke that kills the step if it is running (terminate, a run deadline).
    terminate: NotRequired[bool]
    #: A revoke of the message an attempt with none of its own runs under: that attempt.
    carrier_of: NotRequired[str]
    #: A step message bundling more branches (runtime/inline.py, ``InlineChain.bundle``): their
    #: tokens, sent in its ``HELD_HEADER``. Set on the row as sent, after its commit; never
    #: stored (each of those branches has its own outbox row, forgotten once this is sent).
    held: NotRequired[list[str]]


class WakeupMessage(TypedDict):
    """The payload of a wake-up row."""

    run_id: str


class AttemptIntent(TypedDict):
    """An outbox row to insert that sends (``DispatchKind.STEP``) or revokes
    (``DispatchKind.REVOKE``) an attempt's message; ``task`` is the step's name."""

    run_id: str
    kind: DispatchKind
    task: str
    queue: str | None
    payload: AttemptMessage


class WakeupIntent(TypedDict):
    """An outbox row to insert that wakes a run (``DispatchKind.WAKEUP``, task ``ductor.tick``)."""

    run_id: str
    kind: DispatchKind
    task: str
    queue: None
    payload: WakeupMessage


#: One outbox row before its insert: its columns (``eec_workflow_outbox``) but the id and
#: the time. A plain dict, so the JSON a row holds is the one every version wrote and reads.
OutboxIntent = AttemptIntent | WakeupIntent


def step_intent(
    run_id: str, token: str, node: str, step: str, queue: str | None, priority: int = 0
) -> AttemptIntent:
    """A step message's row; ``priority`` (its run's, 0..9) travels to the broker when set."""
    payload = AttemptMessage(token=token, run_id=run_id, node=node)
    if priority:
        payload["priority"] = priority
    return AttemptIntent(
        run_id=run_id, kind=DispatchKind.STEP, task=step, queue=queue, payload=payload
    )


def wakeup_intent(run_id: str) -> WakeupIntent:
    return WakeupIntent(
        run_id=run_id,
        kind=DispatchKind.WAKEUP,
        task="ductor.tick",
        queue=None,
        payload=WakeupMessage(run_id=run_id),
    )


def outbox_row(row_id: int, intent: OutboxIntent) -> OutboxRow:
    """The row an intent became once inserted with id ``row_id``, as the dispatcher reads it
    (the same values: a sweeper reading it back from the table gets these)."""
    payload: dict[str, Any] = dict(intent["payload"])
    return OutboxRow(
        id=row_id,
        run_id=intent["run_id"],
        kind=intent["kind"],
        task=intent["task"],
        queue=intent["queue"],
        payload=payload,
    )


def unsent(claim: TickClaim | None) -> set[str]:
    """The attempts the tick's worker claimed or holds get no message: it runs them itself."""
    return set() if claim is None else {claim.token, *claim.held}


def outbox_intents(
    payload: TickPayload, waiting: set[str], priority: int = 0
) -> list[OutboxIntent]:
    """The payload's dispatches as outbox rows. A step message for an attempt in ``waiting``
    (for its lease, or claimed by the tick's worker) is not written: the release that hands it
    a slot sends it, or the worker runs it. Step messages carry the run's ``priority``."""
    return [
        wakeup_intent(d.run_id) if d.kind == DispatchKind.WAKEUP else _attempt_intent(d, priority)
        for d in payload.dispatches
        if not (d.kind == DispatchKind.STEP and d.token in waiting)
    ]


def _attempt_intent(d: Dispatch, priority: int = 0) -> AttemptIntent:
    """A step or revoke row; a revoke that kills a running step says so in its payload (a
    version that does not know the key revokes without terminating, as it always did)."""
    row = step_intent(d.run_id, d.token, d.node, d.step, d.queue, priority)
    row["kind"] = d.kind
    if d.terminate:
        row["payload"]["terminate"] = True
    return row


def carrier_revokes(
    payload: TickPayload, carriers: Mapping[str, str | None]
) -> list[AttemptIntent]:
    """Revokes with ``terminate=True`` of the messages the attempts a terminate (or a run
    deadline) closes run under: ``carriers`` maps each closed attempt's token to the task id
    its worker claimed it under (store/schema.py ``carrier``), as the close read it back.

    An attempt run inline after another step's message, or held after it, has no message of
    its own: revoking its token reaches nothing, and the step would run on. Its carrier is the
    message that began its inline chain, still running while the attempt is; killing that
    message kills the step. It is safe because a carrier only ever runs attempts of one run
    (runtime/inline.py), the run being terminated. A carrier that is the attempt's own token,
    or one revoked already in this tick, is not sent again; a revoke that only drops a queued
    message (cancel) kills nothing, so it has none."""
    revoked = {d.token for d in payload.dispatches if d.kind == DispatchKind.REVOKE}
    rows: list[AttemptIntent] = []
    for d in payload.dispatches:
        if d.kind != DispatchKind.REVOKE or not d.terminate:
            continue
        carrier = carriers.get(d.token)
        if not carrier or carrier in revoked:
            continue
        revoked.add(carrier)
        row = _attempt_intent(dataclasses.replace(d, token=carrier))
        row["payload"]["carrier_of"] = d.token
        rows.append(row)
    return rows


def transition_rows(run_id: str, now: datetime, payload: TickPayload) -> list[dict[str, Any]]:
    """The payload's transitions, numbered on from the run's count before this tick."""
    first = payload.state.transitions - len(payload.transitions)
    return [
        {
            "run_id": run_id,
            "seq": first + i,
            "node": tr.node,
            "from_status": str(tr.from_status) if tr.from_status is not None else None,
            "to_status": str(tr.to_status),
            "reason": tr.reason[:2000],
            "at": now,
        }
        for i, tr in enumerate(payload.transitions)
    ]


def folded_by_commit(payload: TickPayload, carried: AttemptResult | None) -> list[str]:
    """The results a commit marks folded: all the tick folded but a carried one, whose
    attempt the commit writes finished and folded at once (``Coordinator.tick``)."""
    if carried is None:
        return list(payload.folded)
    return [token for token in payload.folded if token != carried.token]
