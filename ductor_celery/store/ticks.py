"""The coordinator's side of the store: load a run for a tick, commit the tick's payload.

``commit_tick`` is the only code that updates ``eec_workflow_run`` after its insert, and it
always does so ``WHERE record_version = :expected``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Engine

from ..definition.spec import WorkflowSpec
from ..engine import (
    AttemptCheck,
    AttemptResult,
    ControlIn,
    EngineConfig,
    NodeStatus,
    RunState,
    RunStatus,
    SignalIn,
    TickInputs,
    TickPayload,
    needed_outputs,
)
from ..engine.status import TERMINAL_RUN_STATUSES
from .db import aware, is_postgres
from .schema import (
    step_attempt,
    workflow_control,
    workflow_outbox,
    workflow_run,
    workflow_signal,
    workflow_timer,
    workflow_transition,
)

RUN_FINISHED_CHANNEL = "ductor_run_finished"


class VersionConflict(Exception):
    """Someone else committed this run (or an attempt changed) since we loaded it."""


@dataclass(slots=True)
class LoadedRun:
    run_id: str
    workflow_id: str
    workflow: str
    spec_hash: str
    record_version: int
    state: RunState
    now: datetime


@dataclass(frozen=True, slots=True)
class OutboxRow:
    id: int
    run_id: str
    kind: str
    task: str
    queue: str | None
    payload: dict[str, Any]


class _OutputCache:
    """Outputs are immutable once written, so each process keeps the recent ones."""

    def __init__(self, size: int = 4096) -> None:
        self._data: OrderedDict[str, Any] = OrderedDict()
        self._size = size

    def get_many(self, tokens: list[str]) -> tuple[dict[str, Any], list[str]]:
        found: dict[str, Any] = {}
        missing: list[str] = []
        for token in tokens:
            if token in self._data:
                self._data.move_to_end(token)
                found[token] = self._data[token]
            else:
                missing.append(token)
        return found, missing

    def put(self, token: str, value: Any) -> None:
        self._data[token] = value
        self._data.move_to_end(token)
        while len(self._data) > self._size:
            self._data.popitem(last=False)


_outputs = _OutputCache()


def db_now(conn: Connection) -> datetime:
    if conn.dialect.name == "postgresql":
        value = conn.execute(sa.select(sa.func.now())).scalar_one()
        return aware(value) or datetime.now(UTC)
    return datetime.now(UTC)


def load_tick(
    engine: Engine,
    run_id: str,
    spec_for: Callable[[str], WorkflowSpec],
    config: EngineConfig,
) -> tuple[LoadedRun, WorkflowSpec, TickInputs] | None:
    """Read everything one tick needs. None when the run does not exist."""
    with engine.connect() as conn:
        now_col = sa.func.now() if is_postgres(engine) else sa.literal(None)
        row = conn.execute(
            sa.select(
                workflow_run.c.run_id,
                workflow_run.c.workflow_id,
                workflow_run.c.workflow,
                workflow_run.c.spec_hash,
                workflow_run.c.record_version,
                workflow_run.c.state,
                workflow_run.c.input,
                now_col.label("now"),
            ).where(workflow_run.c.run_id == run_id)
        ).one_or_none()
        if row is None:
            return None
        now = aware(row.now) if row.now is not None else datetime.now(UTC)
        assert now is not None
        state = RunState.from_json(row.state)
        loaded = LoadedRun(
            run_id=row.run_id,
            workflow_id=row.workflow_id,
            workflow=row.workflow,
            spec_hash=row.spec_hash,
            record_version=row.record_version,
            state=state,
            now=now,
        )
        spec = spec_for(row.spec_hash)
        results = tuple(
            AttemptResult(
                token=r.token,
                node=r.node,
                outcome=r.outcome or "failed",
                output=r.output,
                error=r.error,
                retryable=bool(r.retryable) if r.retryable is not None else True,
                patch=r.patch,
            )
            for r in conn.execute(
                sa.select(
                    step_attempt.c.token,
                    step_attempt.c.node,
                    step_attempt.c.outcome,
                    step_attempt.c.output,
                    step_attempt.c.error,
                    step_attempt.c.retryable,
                    step_attempt.c.patch,
                )
                .where(
                    step_attempt.c.run_id == run_id,
                    step_attempt.c.finished_at.is_not(None),
                    sa.not_(step_attempt.c.folded),
                )
                .order_by(step_attempt.c.finished_at, step_attempt.c.token)
            )
        )
        control_row = conn.execute(
            sa.select(
                workflow_control.c.id,
                workflow_control.c.kind,
                workflow_control.c.reason,
                workflow_control.c.input,
                workflow_control.c.has_input,
            )
            .where(workflow_control.c.run_id == run_id, workflow_control.c.handled_at.is_(None))
            .order_by(workflow_control.c.id)
            .limit(1)
        ).one_or_none()
        control = (
            ControlIn(
                id=control_row.id,
                kind=control_row.kind,
                reason=control_row.reason,
                input=control_row.input,
                has_input=bool(control_row.has_input),
            )
            if control_row is not None
            else None
        )
        if state.status in TERMINAL_RUN_STATUSES and control is None:
            return loaded, spec, TickInputs(run_id=run_id, results=results, config=config)
        signals = tuple(
            SignalIn(id=sig.id, name=sig.name, payload=sig.payload)
            for sig in conn.execute(
                sa.select(workflow_signal.c.id, workflow_signal.c.name, workflow_signal.c.payload)
                .where(workflow_signal.c.run_id == run_id, workflow_signal.c.applied_at.is_(None))
                .order_by(workflow_signal.c.id)
            )
        )
        due = [
            ns.token
            for ns in state.nodes.values()
            if ns.status == NodeStatus.RUNNING
            and ns.token is not None
            and ns.check_at is not None
            and ns.check_at <= now
        ]
        checks: dict[str, AttemptCheck] = {}
        if due:
            for r in conn.execute(
                sa.select(
                    step_attempt.c.token, step_attempt.c.claimed_at, step_attempt.c.finished_at
                ).where(step_attempt.c.token.in_(due))
            ):
                checks[r.token] = AttemptCheck(
                    token=r.token,
                    claimed_at=aware(r.claimed_at),
                    finished=r.finished_at is not None,
                )
        wanted = needed_outputs(spec, state)
        outputs: dict[str, Any] = _parked_outputs(conn, spec, state)
        if wanted:
            cached, missing = _outputs.get_many(list(wanted.values()))
            if missing:
                for out in conn.execute(
                    sa.select(step_attempt.c.token, step_attempt.c.output).where(
                        step_attempt.c.token.in_(missing)
                    )
                ):
                    _outputs.put(out.token, out.output)
                    cached[out.token] = out.output
            outputs.update({node: cached.get(token) for node, token in wanted.items()})
        earlier = [
            i
            for ns in state.nodes.values()
            if ns.status == NodeStatus.WAITING and ns.output_signals
            for i in ns.output_signals.values()
        ]
        received: dict[int, Any] = {}
        if earlier:
            received = dict(
                conn.execute(
                    sa.select(workflow_signal.c.id, workflow_signal.c.payload).where(
                        workflow_signal.c.id.in_(earlier)
                    )
                ).all()
            )
        inputs = TickInputs(
            run_id=run_id,
            input=row.input,
            results=results,
            checks=checks,
            outputs=outputs,
            config=config,
            signals=signals,
            control=control,
            received=received,
        )
        return loaded, spec, inputs


def commit_tick(engine: Engine, loaded: LoadedRun, payload: TickPayload) -> list[OutboxRow]:
    """Write the payload in one transaction, or raise VersionConflict and write nothing."""
    with engine.begin() as conn:
        return _commit(conn, loaded, payload)


def _commit(conn: Connection, loaded: LoadedRun, payload: TickPayload) -> list[OutboxRow]:
    now = loaded.now
    state = payload.state
    finished = state.status in TERMINAL_RUN_STATUSES
    values: dict[str, Any] = {
        "status": state.status.value,
        "state": state.to_json(),
        "record_version": loaded.record_version + 1,
        "transition_count": state.transitions,
        "updated_at": now,
    }
    if finished and loaded.state.status not in TERMINAL_RUN_STATUSES:
        values.update(output=payload.output, error=payload.error, finished_at=now)
    if payload.reopened:
        values.update(output=None, error=None, finished_at=None)
    if payload.successor is not None:
        values["continued_to"] = payload.successor.run_id
    updated = conn.execute(
        sa.update(workflow_run)
        .where(
            workflow_run.c.run_id == loaded.run_id,
            workflow_run.c.record_version == loaded.record_version,
        )
        .values(**values)
    )
    if updated.rowcount != 1:
        raise VersionConflict(loaded.run_id)

    for closed in payload.closed:
        # Conditional on the attempt still being open: if its worker finished it after our
        # load, roll back and recompute, so the worker's result is folded, not overwritten.
        res = conn.execute(
            sa.update(step_attempt)
            .where(step_attempt.c.token == closed.token, step_attempt.c.finished_at.is_(None))
            .values(
                finished_at=now,
                outcome=closed.outcome,
                error=closed.error,
                retryable=False,
                folded=True,
            )
        )
        if res.rowcount != 1:
            raise VersionConflict(f"attempt {closed.token} finished meanwhile")

    if payload.folded:
        conn.execute(
            sa.update(step_attempt)
            .where(step_attempt.c.token.in_(payload.folded))
            .values(folded=True)
        )

    if payload.new_attempts:
        copied = [a.args_from for a in payload.new_attempts if a.args_from]
        prior: dict[str, Any] = {}
        if copied:
            prior = dict(
                conn.execute(
                    sa.select(step_attempt.c.token, step_attempt.c.args).where(
                        step_attempt.c.token.in_(copied)
                    )
                ).all()
            )
        conn.execute(
            sa.insert(step_attempt),
            [
                {
                    "token": a.token,
                    "run_id": loaded.run_id,
                    "node": a.node,
                    "branch": None,
                    "generation": a.generation,
                    "attempt": a.attempt,
                    "step": a.step,
                    "queue": a.queue,
                    "args": prior.get(a.args_from, {}) if a.args_from else a.args,
                    "timeout": a.timeout,
                    "created_at": now,
                    "folded": False,
                }
                for a in payload.new_attempts
            ],
        )

    if payload.transitions:
        first = state.transitions - len(payload.transitions)
        conn.execute(
            sa.insert(workflow_transition),
            [
                {
                    "run_id": loaded.run_id,
                    "seq": first + i,
                    "node": tr.node,
                    "from_status": str(tr.from_status) if tr.from_status is not None else None,
                    "to_status": str(tr.to_status),
                    "reason": tr.reason[:2000],
                    "at": now,
                }
                for i, tr in enumerate(payload.transitions)
            ],
        )

    outbox: list[OutboxRow] = []
    if payload.dispatches:
        rows: list[dict[str, Any]] = [
            {
                "run_id": d.run_id,
                "kind": d.kind,
                "task": d.step,
                "queue": d.queue,
                "payload": {"token": d.token, "run_id": d.run_id, "node": d.node},
                "created_at": now,
            }
            for d in payload.dispatches
        ]
        result = conn.execute(
            sa.insert(workflow_outbox).returning(
                workflow_outbox.c.id, sort_by_parameter_order=True
            ),
            rows,
        )
        ids = [r.id for r in result]
        outbox = [
            OutboxRow(
                id=i,
                run_id=r["run_id"],
                kind=r["kind"],
                task=r["task"],
                queue=r["queue"],
                payload=r["payload"],
            )
            for i, r in zip(ids, rows, strict=True)
        ]

    for applied in payload.applied_signals:
        res = conn.execute(
            sa.update(workflow_signal)
            .where(workflow_signal.c.id == applied.id, workflow_signal.c.applied_at.is_(None))
            .values(
                applied_at=now, applied_to=applied.node, applied_version=loaded.record_version + 1
            )
        )
        if res.rowcount != 1:
            raise VersionConflict(f"signal {applied.id} applied meanwhile")
    if payload.handled_control is not None:
        conn.execute(
            sa.update(workflow_control)
            .where(workflow_control.c.id == payload.handled_control.id)
            .values(handled_at=now, result=payload.handled_control.result[:2000])
        )
    if payload.successor is not None:
        outbox.extend(_insert_successor(conn, loaded, payload, now))

    _set_timer(conn, loaded.run_id, payload.next_wake_at)

    if finished and loaded.state.status not in TERMINAL_RUN_STATUSES and is_postgres(conn.engine):
        conn.execute(sa.select(sa.func.pg_notify(RUN_FINISHED_CHANNEL, loaded.run_id)))
    return outbox


def _set_timer(conn: Connection, run_id: str, fire_at: datetime | None) -> None:
    if fire_at is None:
        conn.execute(sa.delete(workflow_timer).where(workflow_timer.c.run_id == run_id))
        return
    insert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
    stmt = insert(workflow_timer).values(run_id=run_id, fire_at=fire_at, woken_at=None)
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[workflow_timer.c.run_id],
            set_={"fire_at": fire_at, "woken_at": None},
        )
    )


def delete_outbox(engine: Engine, ids: list[int]) -> None:
    if ids:
        with engine.begin() as conn:
            conn.execute(sa.delete(workflow_outbox).where(workflow_outbox.c.id.in_(ids)))


def run_status(engine: Engine, run_id: str) -> RunStatus | None:
    with engine.connect() as conn:
        value = conn.execute(
            sa.select(workflow_run.c.status).where(workflow_run.c.run_id == run_id)
        ).scalar_one_or_none()
    return RunStatus(value) if value is not None else None


def _insert_successor(
    conn: Connection, loaded: LoadedRun, payload: TickPayload, now: datetime
) -> list[OutboxRow]:
    """Continue-as-new: the successor run row, linked both ways, and its first wake-up."""
    successor = payload.successor
    assert successor is not None
    run = conn.execute(
        sa.select(
            workflow_run.c.workflow, workflow_run.c.version, workflow_run.c.parent_run_id
        ).where(workflow_run.c.run_id == loaded.run_id)
    ).one()
    conn.execute(
        sa.insert(workflow_run).values(
            run_id=successor.run_id,
            workflow_id=loaded.workflow_id,
            workflow=run.workflow,
            version=run.version,
            spec_hash=loaded.spec_hash,
            status=RunStatus.PENDING.value,
            state=successor.state.to_json(),
            input=successor.input,
            record_version=0,
            transition_count=0,
            parent_run_id=run.parent_run_id,
            continued_from=loaded.run_id,
            created_at=now,
            updated_at=now,
        )
    )
    row = conn.execute(
        sa.insert(workflow_outbox)
        .values(
            run_id=successor.run_id,
            kind="wakeup",
            task="ductor.tick",
            queue=None,
            payload={"run_id": successor.run_id},
            created_at=now,
        )
        .returning(workflow_outbox.c.id)
    ).one()
    return [
        OutboxRow(
            id=row.id,
            run_id=successor.run_id,
            kind="wakeup",
            task="ductor.tick",
            queue=None,
            payload={"run_id": successor.run_id},
        )
    ]


def _parked_outputs(conn: Connection, spec: WorkflowSpec, state: RunState) -> dict[str, Any]:
    """Outputs of finished parked nodes that pending nodes read: signal payloads or literals."""
    graph = spec.graph
    wanted: set[str] = set(graph.output_reads)
    for node_id, ns in state.nodes.items():
        if ns.status == NodeStatus.PENDING:
            wanted |= graph.reads.get(node_id, frozenset())
    outputs: dict[str, Any] = {}
    ids: dict[int, str] = {}
    sets: dict[str, dict[str, int]] = {}
    for node_id in wanted:
        found = state.nodes.get(node_id)
        if found is None or found.status != NodeStatus.SUCCEEDED or found.output_token:
            continue
        if found.output_signal is not None:
            ids[found.output_signal] = node_id
        elif found.output_signals:
            sets[node_id] = found.output_signals
        else:
            outputs[node_id] = found.output_value
    every = list(ids) + [i for events in sets.values() for i in events.values()]
    if not every:
        return outputs
    payloads = dict(
        conn.execute(
            sa.select(workflow_signal.c.id, workflow_signal.c.payload).where(
                workflow_signal.c.id.in_(every)
            )
        ).all()
    )
    for signal_id, node_id in ids.items():
        outputs[node_id] = payloads.get(signal_id)
    for node_id, events in sets.items():
        outputs[node_id] = {event: payloads.get(i) for event, i in events.items()}
    return outputs
