"""What a tick reads, from the in-memory tables: ``store/load.py`` and ``store/composed.py``
over dicts instead of SQL, answering the same questions in the same order."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from ..coordinator.port import Loaded, LoadedRun
from ..coordinator.read_rows import attempt_result, child_snapshot
from ..definition.spec import ChildScatterNodeSpec, SubworkflowNodeSpec, WorkflowSpec
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
)
from ..engine.children import child_run_id, children_to_read, may_stop
from ..engine.inputs import ChildSnapshot
from ..engine.kinds import ControlKind
from ..engine.outputs import (
    OutputRef,
    checkpoint_of,
    output_ref,
    received_events,
    resolve_outputs,
)
from ..engine.redrive import reads_for
from ..engine.scatter import (
    BatchAttempt,
    assemble,
    assemble_batched,
    attempt_final,
    batch_attempt,
    child_final,
)
from ..engine.slots import slots
from ..engine.state import ScatterState
from ..engine.status import TERMINAL_RUN_STATUSES
from ..engine.tick import ACTIVE, read_nodes
from ..engine.versions import successor_spec_hash
from .tables import AttemptRow, RunRow, Tables


def load(
    tables: Tables, specs: dict[str, WorkflowSpec], run_id: str, now: datetime, config: EngineConfig
) -> Loaded | None:
    run = tables.runs.get(run_id)
    if run is None:
        return None
    state = RunState.from_json(run.state)
    loaded = LoadedRun(
        run_id=run.run_id,
        workflow_id=run.workflow_id,
        workflow=run.workflow,
        spec_hash=run.spec_hash,
        record_version=run.record_version,
        state=state,
        now=now,
        parent_run_id=run.parent_run_id,
        timer_at=tables.timers.get(run_id),
    )
    spec = specs.get(run.spec_hash)
    if spec is None:
        raise LookupError(f"workflow definition {run.spec_hash} is not in the store")
    results = _results(tables, run_id)
    control = _control(tables, run_id)
    if state.status in TERMINAL_RUN_STATUSES and control is None:
        return loaded, spec, TickInputs(run_id=run_id, results=results, config=config)
    inputs = TickInputs(
        run_id=run_id,
        input=run_input(tables, run),
        results=results,
        checks=_checks(tables, state, now),
        outputs=_outputs_for(tables, spec, state, reads_for(spec, control, state)),
        config=config,
        signals=tuple(
            SignalIn(id=s.id, name=s.name, payload=s.payload)
            for s in tables.signals
            if s.run_id == run_id and s.applied_at is None
        ),
        control=control,
        received=_received(tables, spec, state),
        gathered={
            node: gather_any(tables, spec, node, ns.scatter)
            for node, ns in state.nodes.items()
            if ns.status in ACTIVE and ns.scatter is not None and ns.scatter.gathering
        },
        children=_children_of(tables, spec, state, may_stop(state, control, now)),
        successor_spec=specs.get(successor_spec_hash(state, control) or ""),
    )
    return loaded, spec, inputs


def finish_order(a: AttemptRow) -> tuple[Any, ...]:
    return (a.finished_at, a.finished_seq, a.token)


def _results(tables: Tables, run_id: str) -> tuple[AttemptResult, ...]:
    """Finished attempts not folded yet, in the order they finished."""
    unfolded = [
        a
        for a in tables.attempts.values()
        if a.run_id == run_id and a.finished_at is not None and not a.folded
    ]
    unfolded.sort(key=finish_order)
    return tuple(
        attempt_result(
            a.token, a.node, a.outcome, a.output, a.error, a.retryable, a.patch, a.branch, a.tags
        )
        for a in unfolded
    )


def _control(tables: Tables, run_id: str) -> ControlIn | None:
    """The oldest control not handled yet: one per tick."""
    for c in tables.controls:
        if c.run_id == run_id and c.handled_at is None:
            return ControlIn(
                id=c.id,
                kind=ControlKind.parse(c.kind),
                reason=c.reason,
                input=c.input,
                has_input=c.has_input,
                node=c.node,
                spec_hash=c.spec_hash,
            )
    return None


def _checks(tables: Tables, state: RunState, now: datetime) -> dict[str, AttemptCheck]:
    """Claim status of in-flight attempts whose check time has come."""
    out: dict[str, AttemptCheck] = {}
    for ns in state.nodes.values():
        for _, slot in slots(ns):
            if slot.token is None or slot.check_at is None or slot.check_at > now:
                continue
            row = tables.attempts.get(slot.token)
            if row is not None:
                out[row.token] = AttemptCheck(
                    token=row.token,
                    claimed_at=row.claimed_at,
                    finished=row.finished_at is not None,
                    heartbeat_at=row.heartbeat_at,
                )
    return out


class _TableOutputs:
    """``OutputSource`` over the tables (``store/outputs.py:ConnectionOutputs`` over dicts)."""

    __slots__ = ("tables", "spec")

    def __init__(self, tables: Tables, spec: WorkflowSpec) -> None:
        self.tables = tables
        self.spec = spec

    def attempt_outputs(self, tokens: list[str]) -> Mapping[str, Any]:
        rows = self.tables.attempts
        return {t: rows[t].output for t in tokens if t in rows}

    def signal_payloads(self, ids: list[int]) -> Mapping[int, Any]:
        wanted = set(ids)
        return {s.id: s.payload for s in self.tables.signals if s.id in wanted}

    def gathered(self, node: str, scatter: ScatterState) -> Any:
        return gather_any(self.tables, self.spec, node, scatter)

    def child_output(self, node: str, child_run: str) -> Any:
        return child_output(self.tables, self.spec, node, child_run)


def _received(tables: Tables, spec: WorkflowSpec, state: RunState) -> dict[int, Any]:
    """Payloads of signals already applied to event sets that are still waiting."""
    ids = [
        i
        for ns in state.nodes.values()
        if ns.status == NodeStatus.WAITING
        for i in received_events(ns).values()
    ]
    return dict(_TableOutputs(tables, spec).signal_payloads(ids)) if ids else {}


def run_input(tables: Tables, run: RunRow) -> Any:
    """The run's input: a redrive's ``input=`` (in its control row) replaces the inserted one."""
    input_from = RunState.from_json(run.state).input_from
    if input_from is None:
        return run.input
    for c in tables.controls:
        if c.id == input_from:
            return c.input
    return None


def _outputs_for(
    tables: Tables, spec: WorkflowSpec, state: RunState, also: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Outputs of earlier-finished nodes that pending nodes (or the run output) read, and the
    nodes in ``also``."""
    refs: dict[str, OutputRef | None] = {}
    for node_id in read_nodes(spec, state) | also:
        ns = state.nodes.get(node_id)
        if ns is not None and ns.status == NodeStatus.SUCCEEDED:
            refs[node_id] = output_ref(ns)
    return resolve_outputs(refs, _TableOutputs(tables, spec))


def newest_of_chain(tables: Tables, run_id: str) -> RunRow | None:
    """The newest run of ``run_id``'s continue-as-new chain (None: no such run)."""
    row = tables.runs.get(run_id)
    for _ in range(100):
        if row is None or row.status != RunStatus.CONTINUED or not row.continued_to:
            return row
        row = tables.runs.get(row.continued_to)
    return row


def gather_any(tables: Tables, spec: WorkflowSpec, node: str, sc: ScatterState) -> list[Any]:
    if isinstance(spec.graph.nodes.get(node), ChildScatterNodeSpec):
        return _gather_children(tables, node, sc)
    if sc.batch > 1:
        return _gather_batched(tables, node, sc)
    last: dict[int, Any] = {}
    for a in _branch_attempts(tables, node, sc):
        assert a.branch is not None
        if a.branch not in last or a.generation > last[a.branch].generation:
            last[a.branch] = a
    finals = {b: attempt_final(a.outcome, a.output, a.error) for b, a in last.items()}
    return assemble(sc, finals)


def _branch_attempts(tables: Tables, node: str, sc: ScatterState) -> list[Any]:
    return [
        a
        for a in tables.attempts.values()
        if a.run_id == sc.run
        and a.node == node
        and a.generation > sc.base
        and a.branch is not None
        and a.finished_at is not None
    ]


def _gather_batched(tables: Tables, node: str, sc: ScatterState) -> list[Any]:
    attempts: dict[int, list[BatchAttempt]] = {}
    for a in sorted(_branch_attempts(tables, node, sc), key=lambda a: (a.branch, a.generation)):
        attempts.setdefault(a.branch, []).append(batch_attempt(a.outcome, a.output, a.error))
    return assemble_batched(sc, attempts)


def _gather_children(tables: Tables, node: str, sc: ScatterState) -> list[Any]:
    finals: dict[int, tuple[bool, Any]] = {}
    for index in range(sc.total):
        row = newest_of_chain(tables, child_run_id(sc.run, node, index, sc.base))
        if row is None:
            continue
        finals[index] = child_final(row.run_id, row.status, row.output, row.error)
    return assemble(sc, finals)


def child_output(tables: Tables, spec: WorkflowSpec, node: str, child: str) -> Any:
    node_spec = spec.graph.nodes.get(node)
    until = node_spec.until if isinstance(node_spec, SubworkflowNodeSpec) else None
    row = newest_of_chain(tables, child)
    if row is None:
        return None
    return row.output if until is None else checkpoint_of(row.state, until)[1]


def _children_of(
    tables: Tables, spec: WorkflowSpec, state: RunState, stopping: bool
) -> dict[str, ChildSnapshot]:
    return {
        child: child_snapshot(child, newest_of_chain(tables, child), until)
        for child, until in children_to_read(spec, state, stopping=stopping).items()
    }
