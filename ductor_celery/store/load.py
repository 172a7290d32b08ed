"""Load one run for a tick: the run row and the inbox (results, control, signals, checks).

A single first query returns the run row, the database clock and whether each inbox holds
anything, so a redundant wake-up costs one indexed read and no more.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from ..definition.spec import ChildScatterNodeSpec, SubworkflowNodeSpec, WorkflowSpec
from ..engine import (
    AttemptCheck,
    AttemptResult,
    ControlIn,
    EngineConfig,
    NodeStatus,
    RunState,
    SignalIn,
    TickInputs,
    needed_outputs,
)
from ..engine.advance import slots
from ..engine.children import child_run_id
from ..engine.inputs import ChildSnapshot
from ..engine.scatter import assemble
from ..engine.state import ScatterState
from ..engine.status import TERMINAL_RUN_STATUSES
from ..engine.tick import ACTIVE, read_nodes
from .db import aware, is_postgres
from .leases import holds_lease
from .schema import step_attempt, workflow_control, workflow_run, workflow_signal


@dataclass(slots=True)
class LoadedRun:
    run_id: str
    workflow_id: str
    workflow: str
    spec_hash: str
    record_version: int
    state: RunState
    now: datetime
    parent_run_id: str | None = None


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


def _exists(table: sa.Table, *where: Any) -> Any:
    return sa.exists(sa.select(sa.literal(1)).select_from(table).where(*where))


def load_tick(
    engine: Engine,
    run_id: str,
    spec_for: Callable[[str], WorkflowSpec],
    config: EngineConfig,
) -> tuple[LoadedRun, WorkflowSpec, TickInputs] | None:
    """Read everything one tick needs on a connection of its own. None: no such run."""
    with engine.connect() as conn:
        return load_on(conn, run_id, lambda spec_hash, _conn: spec_for(spec_hash), config)


def load_on(
    conn: Connection,
    run_id: str,
    spec_for: Callable[[str, Connection], WorkflowSpec],
    config: EngineConfig,
) -> tuple[LoadedRun, WorkflowSpec, TickInputs] | None:
    """Read everything one tick needs, on ``conn`` (the coordinator's commit transaction).

    ``spec_for`` gets the connection too: a definition missing from the process cache is read
    on it, never on a second connection (on SQLite that one would wait for this one's lock).
    """
    row = _run_row(conn, run_id)
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
        parent_run_id=row.parent_run_id,
    )
    spec = spec_for(row.spec_hash, conn)
    results = _results(conn, run_id) if row.has_results else ()
    control = _control(conn, run_id) if row.has_control else None
    if state.status in TERMINAL_RUN_STATUSES and control is None:
        return loaded, spec, TickInputs(run_id=run_id, results=results, config=config)
    inputs = TickInputs(
        run_id=run_id,
        input=row.input,
        results=results,
        checks=_checks(conn, state, now),
        outputs=_outputs_for(conn, spec, state),
        config=config,
        signals=_signals(conn, run_id) if row.has_signals else (),
        control=control,
        received=_received(conn, state),
        gathered={
            node: _gather_any(conn, spec, node, ns.scatter)
            for node, ns in state.nodes.items()
            if ns.status in ACTIVE and ns.scatter is not None and ns.scatter.gathering
        },
        children=_children(conn, spec, state),
    )
    return loaded, spec, inputs


def _run_row(conn: Connection, run_id: str) -> Any:
    now_col = sa.func.now() if is_postgres(conn.engine) else sa.literal(None)
    return conn.execute(
        sa.select(
            workflow_run.c.run_id,
            workflow_run.c.workflow_id,
            workflow_run.c.workflow,
            workflow_run.c.spec_hash,
            workflow_run.c.record_version,
            workflow_run.c.state,
            workflow_run.c.input,
            workflow_run.c.parent_run_id,
            now_col.label("now"),
            _exists(
                step_attempt,
                step_attempt.c.run_id == run_id,
                step_attempt.c.finished_at.is_not(None),
                sa.not_(step_attempt.c.folded),
            ).label("has_results"),
            _exists(
                workflow_control,
                workflow_control.c.run_id == run_id,
                workflow_control.c.handled_at.is_(None),
            ).label("has_control"),
            _exists(
                workflow_signal,
                workflow_signal.c.run_id == run_id,
                workflow_signal.c.applied_at.is_(None),
            ).label("has_signals"),
        ).where(workflow_run.c.run_id == run_id)
    ).one_or_none()


def _results(conn: Connection, run_id: str) -> tuple[AttemptResult, ...]:
    """Finished attempts not folded yet, in the order they finished."""
    rows = conn.execute(
        sa.select(
            step_attempt.c.token,
            step_attempt.c.node,
            step_attempt.c.outcome,
            step_attempt.c.output,
            step_attempt.c.error,
            step_attempt.c.retryable,
            step_attempt.c.patch,
            step_attempt.c.branch,
        )
        .where(
            step_attempt.c.run_id == run_id,
            step_attempt.c.finished_at.is_not(None),
            sa.not_(step_attempt.c.folded),
        )
        .order_by(step_attempt.c.finished_at, step_attempt.c.token)
    )
    return tuple(
        AttemptResult(
            token=r.token,
            node=r.node,
            outcome=r.outcome or "failed",
            output=r.output,
            error=r.error,
            retryable=bool(r.retryable) if r.retryable is not None else True,
            patch=r.patch,
            branch=r.branch,
        )
        for r in rows
    )


def _control(conn: Connection, run_id: str) -> ControlIn | None:
    """The oldest control not handled yet: one per tick."""
    row = conn.execute(
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
    if row is None:
        return None
    return ControlIn(
        id=row.id,
        kind=row.kind,
        reason=row.reason,
        input=row.input,
        has_input=bool(row.has_input),
    )


def _signals(conn: Connection, run_id: str) -> tuple[SignalIn, ...]:
    """Signals not applied yet, in the order they were accepted."""
    rows = conn.execute(
        sa.select(workflow_signal.c.id, workflow_signal.c.name, workflow_signal.c.payload)
        .where(workflow_signal.c.run_id == run_id, workflow_signal.c.applied_at.is_(None))
        .order_by(workflow_signal.c.id)
    )
    return tuple(SignalIn(id=r.id, name=r.name, payload=r.payload) for r in rows)


def _checks(conn: Connection, state: RunState, now: datetime) -> dict[str, AttemptCheck]:
    """Claim status of in-flight attempts whose check time has come."""
    due = [
        slot.token
        for ns in state.nodes.values()
        for _, slot in slots(ns)
        if slot.token is not None and slot.check_at is not None and slot.check_at <= now
    ]
    if not due:
        return {}
    rows = conn.execute(
        sa.select(
            step_attempt.c.token,
            step_attempt.c.claimed_at,
            step_attempt.c.finished_at,
            step_attempt.c.heartbeat_at,
            sa.and_(step_attempt.c.lease_key.is_not(None), ~holds_lease()).label("waiting"),
        ).where(step_attempt.c.token.in_(due))
    )
    return {
        r.token: AttemptCheck(
            token=r.token,
            claimed_at=aware(r.claimed_at),
            finished=r.finished_at is not None,
            heartbeat_at=aware(r.heartbeat_at),
            lease_waiting=bool(r.waiting),
        )
        for r in rows
    }


def _outputs_for(conn: Connection, spec: WorkflowSpec, state: RunState) -> dict[str, Any]:
    """Outputs of earlier-finished nodes that pending nodes (or the run output) read."""
    outputs = _parked_outputs(conn, spec, state)
    for node_id in read_nodes(spec, state):
        found = state.nodes.get(node_id)
        if found is None or found.status != NodeStatus.SUCCEEDED:
            continue
        if found.scatter:
            outputs[node_id] = _gather_any(conn, spec, node_id, found.scatter)
        elif found.child_run:
            outputs[node_id] = child_output(conn, spec, node_id, found.child_run)
    wanted = needed_outputs(spec, state)
    if not wanted:
        return outputs
    cached, missing = _outputs.get_many(list(wanted.values()))
    if missing:
        for r in conn.execute(
            sa.select(step_attempt.c.token, step_attempt.c.output).where(
                step_attempt.c.token.in_(missing)
            )
        ):
            _outputs.put(r.token, r.output)
            cached[r.token] = r.output
    outputs.update({node: cached.get(token) for node, token in wanted.items()})
    return outputs


def _gather_any(conn: Connection, spec: WorkflowSpec, node: str, sc: ScatterState) -> list[Any]:
    if isinstance(spec.graph.nodes.get(node), ChildScatterNodeSpec):
        return gather_children(conn, node, sc)
    return gather(conn, node, sc)


def _children(conn: Connection, spec: WorkflowSpec, state: RunState) -> dict[str, ChildSnapshot]:
    """Snapshots of the child runs this run waits on (sub-workflows and child-run scatters)."""
    wanted: dict[str, str | None] = {}  # child run id -> checkpoint awaited
    for node_id, ns in state.nodes.items():
        if ns.status != NodeStatus.WAITING:
            continue
        node = spec.graph.nodes.get(node_id)
        if isinstance(node, SubworkflowNodeSpec) and ns.child_run:
            wanted[ns.child_run] = node.until
        elif isinstance(node, ChildScatterNodeSpec) and ns.scatter is not None:
            wanted.update({b.token: None for b in ns.scatter.branches.values() if b.token})
    if not wanted:
        return {}
    newest = child_runs(conn, list(wanted), with_state=any(wanted.values()))
    out: dict[str, ChildSnapshot] = {}
    for child, until in wanted.items():
        row = newest.get(child)
        if row is None:
            out[child] = ChildSnapshot(run_id=child, status="missing")
            continue
        reached: dict[str, Any] = {}
        if until is not None and row.state is not None:
            mark = (row.state.get("nodes") or {}).get(until) or {}
            if mark.get("status") == NodeStatus.SUCCEEDED.value:
                reached[until] = mark.get("output_value")
        out[child] = ChildSnapshot(
            run_id=row.run_id,
            status=row.status,
            output=row.output if row.status == "succeeded" else None,
            error=row.error,
            checkpoints=reached,
        )
    return out


def child_runs(conn: Connection, ids: list[str], with_state: bool = False) -> dict[str, Any]:
    """For each run id, the newest run of its continue-as-new chain (a child that continued
    as new is followed to its successor). Missing ids are left out."""
    cols = [
        workflow_run.c.run_id,
        workflow_run.c.status,
        workflow_run.c.output,
        workflow_run.c.error,
        workflow_run.c.continued_to,
        (workflow_run.c.state if with_state else sa.literal(None)).label("state"),
    ]
    out: dict[str, Any] = {}
    pending = {i: i for i in ids}  # id to read -> the id the caller asked for
    for _ in range(100):  # a chain longer than that is not followed further
        if not pending:
            break
        rows = conn.execute(sa.select(*cols).where(workflow_run.c.run_id.in_(list(pending))))
        follow: dict[str, str] = {}
        for r in rows:
            origin = pending[r.run_id]
            if r.status == "continued" and r.continued_to:
                follow[r.continued_to] = origin
            else:
                out[origin] = r
        pending = follow
    return out


def gather_children(conn: Connection, node: str, sc: ScatterState) -> list[Any]:
    """A child-run scatter's outputs in item order, read from the child runs."""
    ids = {child_run_id(sc.run, node, i, sc.base): i for i in range(sc.total)}
    rows = child_runs(conn, list(ids))
    finals: dict[int, tuple[bool, Any]] = {}
    for child, index in ids.items():
        row = rows.get(child)
        if row is None:
            continue
        if row.status == "succeeded":
            finals[index] = (True, row.output)
        else:
            finals[index] = (
                False,
                {
                    "type": "ChildRunFailed",
                    "message": f"child run {row.run_id} {row.status}",
                    "child_error": row.error,
                },
            )
    return assemble(sc, finals)


def child_output(conn: Connection, spec: WorkflowSpec, node: str, child: str) -> Any:
    """A finished sub-workflow node's output: the child's output, or with ``until`` the
    child's context at that checkpoint."""
    node_spec = spec.graph.nodes.get(node)
    until = node_spec.until if isinstance(node_spec, SubworkflowNodeSpec) else None
    row = child_runs(conn, [child], with_state=until is not None).get(child)
    if row is None:
        return None
    if until is None:
        return row.output
    return ((row.state or {}).get("nodes", {}).get(until) or {}).get("output_value")


def gather(conn: Connection, node: str, sc: ScatterState) -> list[Any]:
    """A scatter's outputs in item order: each branch's last attempt (the one that counted).

    One query over the node's attempt rows of this scatter (generations above ``base``);
    cached per process, since a finished scatter's branches never change.
    """
    key = f"gather:{sc.run}:{node}:{sc.base}:{sc.total}"
    found, _ = _outputs.get_many([key])
    if key in found:
        return list(found[key])
    ranked = (
        sa.select(
            step_attempt.c.branch,
            step_attempt.c.outcome,
            step_attempt.c.output,
            step_attempt.c.error,
            sa.func.row_number()
            .over(partition_by=step_attempt.c.branch, order_by=step_attempt.c.generation.desc())
            .label("rank"),
        )
        .where(
            step_attempt.c.run_id == sc.run,
            step_attempt.c.node == node,
            step_attempt.c.generation > sc.base,
            step_attempt.c.branch.is_not(None),
            step_attempt.c.finished_at.is_not(None),
        )
        .subquery()
    )
    finals = {
        r.branch: (r.outcome == "succeeded", r.output if r.outcome == "succeeded" else r.error)
        for r in conn.execute(
            sa.select(ranked.c.branch, ranked.c.outcome, ranked.c.output, ranked.c.error).where(
                ranked.c.rank == 1
            )
        )
    }
    out = assemble(sc, finals)
    if not sc.gathering:
        _outputs.put(key, out)
    return out


def _payloads(conn: Connection, ids: list[int]) -> dict[int, Any]:
    if not ids:
        return {}
    return dict(
        conn.execute(
            sa.select(workflow_signal.c.id, workflow_signal.c.payload).where(
                workflow_signal.c.id.in_(ids)
            )
        ).all()
    )


def _received(conn: Connection, state: RunState) -> dict[int, Any]:
    """Payloads of signals already applied to event sets that are still waiting."""
    return _payloads(
        conn,
        [
            i
            for ns in state.nodes.values()
            if ns.status == NodeStatus.WAITING and ns.output_signals
            for i in ns.output_signals.values()
        ],
    )


def _parked_outputs(conn: Connection, spec: WorkflowSpec, state: RunState) -> dict[str, Any]:
    """Outputs of finished parked nodes that pending nodes read: signal payloads or literals."""
    outputs: dict[str, Any] = {}
    ids: dict[int, str] = {}
    sets: dict[str, dict[str, int]] = {}
    for node_id in read_nodes(spec, state):
        found = state.nodes.get(node_id)
        if (
            found is None
            or found.status != NodeStatus.SUCCEEDED
            or found.output_token
            or found.scatter
            or found.child_run
        ):
            continue
        if found.output_signal is not None:
            ids[found.output_signal] = node_id
        elif found.output_signals:
            sets[node_id] = found.output_signals
        else:
            outputs[node_id] = found.output_value
    payloads = _payloads(conn, list(ids) + [i for ev in sets.values() for i in ev.values()])
    for signal_id, node_id in ids.items():
        outputs[node_id] = payloads.get(signal_id)
    for node_id, events in sets.items():
        outputs[node_id] = {event: payloads.get(i) for event, i in events.items()}
    return outputs
