"""A tick's commit on the in-memory tables: ``store/ticks.py:commit_on`` over dicts, the same
writes in the same order, conditional on ``record_version`` the same way.

The caller's transaction (``InMemoryStore.transaction``) restores the tables if anything
here raises, so a conflict found half-way writes nothing, as a rolled-back SQL commit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from ..coordinator.port import (
    LoadedRun,
    OutboxRow,
    OutcomeNotCarried,
    TickClaim,
    VersionConflict,
    WorkflowIdTaken,
)
from ..coordinator.rows import (
    OutboxIntent,
    carrier_revokes,
    folded_by_commit,
    outbox_intents,
    outbox_row,
    transition_rows,
    unsent,
    wakeup_intent,
)
from ..definition.spec import WorkflowSpec
from ..engine import AttemptResult, RunState, TickPayload
from ..engine.children import child_workflow_id
from ..engine.deadline import deadline_after
from ..engine.kinds import CONTROL_APPLIED
from ..engine.status import OPEN_RUN_STATUSES
from .load import newest_of_chain
from .tables import AttemptRow, AuditRow, ControlRow, RunRow, Tables, TransitionRow, json_copy

_OPEN = frozenset(s.value for s in OPEN_RUN_STATUSES)


def _finish_carried(tables: Tables, carried: AttemptResult, now: datetime) -> None:
    """The outcome the tick carried, finished and folded at once (``store/attempts.py``'s
    ``CARRIED_SET``); ``OutcomeNotCarried`` when its attempt is finished or closed already."""
    row = tables.attempts.get(carried.token)
    if row is None or row.finished_at is not None:
        raise OutcomeNotCarried(carried.token)
    row.finished_at, row.finished_seq = now, tables.next_id("finish")
    row.outcome, row.retryable = carried.outcome, carried.retryable
    row.output, row.error = json_copy(carried.output), json_copy(carried.error)
    row.patch, row.tags = json_copy(carried.patch), json_copy(carried.tags)
    row.folded = True


class NotModelled(Exception):
    """The tick needs something the in-memory store does not model (concurrency leases, rate
    limits):
    test that against the SQL store (``store.tick_store.SqlTickStore``)."""


def commit(
    tables: Tables,
    specs: dict[str, WorkflowSpec],
    loaded: LoadedRun,
    payload: TickPayload,
    claim: TickClaim | None,
    carried: AttemptResult | None = None,
) -> list[OutboxRow]:
    now = loaded.now
    state = payload.state
    if carried is not None:
        _finish_carried(tables, carried, now)
    run = tables.runs.get(loaded.run_id)
    if run is None or run.record_version != loaded.record_version:
        raise VersionConflict(loaded.run_id)
    if payload.reopened and _open_elsewhere(tables, run.workflow_id, run.run_id):
        raise WorkflowIdTaken(loaded.workflow_id)
    leased = next((a for a in payload.new_attempts if a.lease_key), None)
    if leased is not None:
        raise NotModelled(f"concurrency leases ({leased.step!r} has a ConcurrencyLimit)")
    limited = next((a for a in payload.new_attempts if a.rate_key), None)
    if limited is not None:
        raise NotModelled(f"rate limits ({limited.step!r} has a RateLimit)")

    run.status = state.status.value
    run.state = json_copy(state.to_json())
    run.record_version = loaded.record_version + 1
    run.transition_count = state.transitions
    run.updated_at = now
    if payload.finished:
        run.output, run.error, run.finished_at = payload.output, payload.error, now
    elif payload.reopened:
        run.output = run.error = run.finished_at = None
    if payload.successor is not None:
        run.continued_to = payload.successor.run_id

    carriers: dict[str, str | None] = {}
    for closed in payload.closed:
        row = tables.attempts.get(closed.token)
        if row is None or row.finished_at is not None:
            # Its worker finished it after our load: roll back, recompute, fold the result.
            raise VersionConflict(f"attempt {closed.token} finished meanwhile")
        carriers[closed.token] = row.carrier
        row.finished_at, row.outcome, row.error = now, closed.outcome, json_copy(closed.error)
        row.finished_seq = tables.next_id("finish")
        row.retryable, row.folded = False, True
    for token in folded_by_commit(payload, carried):
        if token in tables.attempts:
            tables.attempts[token].folded = True
    for token in payload.cancel_requested:  # as store/ticks.py: open attempts only
        asked = tables.attempts.get(token)
        if asked is not None and asked.finished_at is None:
            asked.cancel_requested_at = now
    _insert_attempts(tables, loaded, payload, now, claim)
    for t in transition_rows(loaded.run_id, now, payload):
        tables.transitions.append(TransitionRow(**t))
    intents = outbox_intents(payload, unsent(claim))
    outbox = _insert_outbox(tables, [*intents, *carrier_revokes(payload, carriers)])

    for applied in payload.applied_signals:
        signal = next((s for s in tables.signals if s.id == applied.id), None)
        if signal is None or signal.applied_at is not None:
            raise VersionConflict(f"signal {applied.id} applied meanwhile")
        signal.applied_at, signal.applied_to = now, applied.node
        signal.applied_version = loaded.record_version + 1
    handled = payload.handled_control
    if handled is not None:
        for c in tables.controls:
            if c.id == handled.id:
                c.handled_at, c.result = now, handled.result[:2000]
                if handled.result == CONTROL_APPLIED:
                    tables.audit.append(
                        AuditRow(
                            at=now,
                            actor=c.requested_by,
                            action=c.kind,
                            run_id=c.run_id,
                            workflow_id=run.workflow_id,
                            node=c.node,
                            detail={"reason": c.reason[:500]} if c.reason else None,
                            source=c.source or "api",
                        )
                    )
        # A tick drains one control: wake the run at once for the next one.
        if any(c.run_id == run.run_id and c.handled_at is None for c in tables.controls):
            outbox += _insert_outbox(tables, [wakeup_intent(run.run_id)])
    if payload.tags_set:  # as store/ticks.py: the index follows the state
        tables.tags.setdefault(run.run_id, {}).update(payload.tags_set)
    if payload.successor is not None:
        outbox += _insert_successor(tables, run, payload, now)
    if payload.child_starts or payload.child_controls:
        outbox += _children(tables, specs, run, payload, now)
    if run.parent_run_id is not None and (payload.checkpoint_reached or payload.finished):
        parent = newest_of_chain(tables, run.parent_run_id)
        parent_id = parent.run_id if parent is not None else run.parent_run_id
        outbox += _insert_outbox(tables, [wakeup_intent(parent_id)])
    set_timer(tables, loaded, payload.next_wake_at)
    return outbox


def set_timer(tables: Tables, loaded: LoadedRun, fire_at: datetime | None) -> None:
    """``store/ticks.py:_set_timer``: a row in the future no later than ``fire_at`` stays."""
    current = loaded.timer_at
    if fire_at is None:
        tables.timers.pop(loaded.run_id, None)
    elif current is None or not (loaded.now < current <= fire_at):
        tables.timers[loaded.run_id] = fire_at


def _open_elsewhere(tables: Tables, workflow_id: str, run_id: str) -> bool:
    return any(
        r.workflow_id == workflow_id and r.run_id != run_id and r.status in _OPEN
        for r in tables.runs.values()
    )


def _insert_outbox(tables: Tables, intents: Iterable[OutboxIntent]) -> list[OutboxRow]:
    rows = []
    for intent in intents:
        row = outbox_row(tables.next_id("outbox"), intent)
        # The payload as the JSON column gives it back: the row shares nothing with the intent.
        row = dataclasses.replace(row, payload=json_copy(row.payload))
        tables.outbox[row.id] = row
        rows.append(row)
    return rows


def _insert_attempts(
    tables: Tables, loaded: LoadedRun, payload: TickPayload, now: datetime, claim: TickClaim | None
) -> None:
    for a in payload.new_attempts:
        if a.token in tables.attempts:
            # The attempt table's unique token, which the SQL insert would break: an error,
            # not a conflict to recompute (a token is never computed twice for one version).
            raise RuntimeError(f"attempt {a.token} exists: its token is unique")
        source = tables.attempts.get(a.args_from) if a.args_from else None
        args = (source.args if source is not None else {}) if a.args_from else a.args
        claimed_by = claim.worker if claim is not None and claim.token == a.token else None
        tables.attempts[a.token] = AttemptRow(
            token=a.token,
            run_id=loaded.run_id,
            node=a.node,
            branch=a.branch,
            generation=a.generation,
            attempt=a.attempt,
            step=a.step,
            queue=a.queue,
            args=json_copy(args),
            timeout=a.timeout,
            created_at=now,
            claimed_at=None if claimed_by is None else now,
            claimed_by=claimed_by,
            carrier=None if claimed_by is None or claim is None else claim.carrier,
        )


def new_run(
    *,
    run_id: str,
    workflow_id: str,
    spec: WorkflowSpec,
    state: RunState,
    input: Any,
    now: datetime,
    **links: Any,
) -> RunRow:
    """A pending run row (``store/runs.py:pending_run``): a start, a successor or a child."""
    return RunRow(
        run_id=run_id,
        workflow_id=workflow_id,
        workflow=spec.name,
        version=spec.version,
        spec_hash=spec.spec_hash,
        status="pending",
        state=json_copy(state.to_json()),
        input=json_copy(input),
        created_at=now,
        updated_at=now,
        **links,
    )


def _insert_successor(
    tables: Tables, run: RunRow, payload: TickPayload, now: datetime
) -> list[OutboxRow]:
    successor = payload.successor
    assert successor is not None
    tables.runs[successor.run_id] = RunRow(
        run_id=successor.run_id,
        workflow_id=run.workflow_id,
        workflow=run.workflow,
        version=successor.version or run.version,
        spec_hash=successor.spec_hash or run.spec_hash,
        status="pending",
        state=json_copy(successor.state.to_json()),
        input=json_copy(successor.input),
        created_at=now,
        updated_at=now,
        parent_run_id=run.parent_run_id,
        continued_from=run.run_id,
    )
    if successor.state.tags:
        tables.tags[successor.run_id] = dict(successor.state.tags)
    # Signals and controls the predecessor never consumed belong to the successor now.
    for s in tables.signals:
        if s.run_id == run.run_id and s.applied_at is None:
            s.run_id = successor.run_id
    for c in tables.controls:
        if c.run_id == run.run_id and c.handled_at is None:
            c.run_id = successor.run_id
    return _insert_outbox(tables, [wakeup_intent(successor.run_id)])


def _definition(specs: dict[str, WorkflowSpec], name: str, spec_hash: str | None) -> WorkflowSpec:
    if spec_hash is not None:
        found = specs.get(spec_hash)
    else:  # not pinned: the newest version of the name (the last added among equals)
        named = [s for s in specs.values() if s.name == name]
        found = max(reversed(named), key=lambda s: s.version) if named else None
    if found is None:
        raise LookupError(
            f"child workflow {name!r} ({spec_hash}) is not stored: add its definition first"
        )
    return found


def _children(
    tables: Tables, specs: dict[str, WorkflowSpec], run: RunRow, payload: TickPayload, now: datetime
) -> list[OutboxRow]:
    intents: list[OutboxIntent] = []
    for child in payload.child_starts:
        spec = _definition(specs, child.workflow, child.spec_hash)
        if child.run_id in tables.runs:
            continue  # the same child, from a recomputed tick
        workflow_id = child_workflow_id(run.workflow_id, child.workflow_id_suffix)
        if _open_elsewhere(tables, workflow_id, child.run_id):
            # Not inserted: tick the parent again at once, so it reads the child as missing.
            intents.append(wakeup_intent(run.run_id))
            continue
        tables.runs[child.run_id] = new_run(
            run_id=child.run_id,
            workflow_id=workflow_id,
            spec=spec,
            state=RunState.initial(
                [n.id for n in spec.nodes], deadline_at=deadline_after(now, spec.deadline)
            ),
            input=child.input,
            now=now,
            parent_run_id=run.run_id,
            parent_node=child.node,
        )
        intents.append(wakeup_intent(child.run_id))
    for control in payload.child_controls:
        if control.run_id not in tables.runs:
            continue  # never inserted (its workflow id was taken): nothing to close
        target = newest_of_chain(tables, control.run_id)
        assert target is not None
        tables.controls.append(
            ControlRow(
                id=tables.next_id("control"),
                run_id=target.run_id,
                kind=str(control.kind),
                reason=control.reason[:2000],
                input=None,
                has_input=False,
                requested_by=f"parent:{run.run_id}",
                created_at=now,
                source="parent",
            )
        )
        intents.append(wakeup_intent(target.run_id))
    return _insert_outbox(tables, intents)
