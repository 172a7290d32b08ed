"""Outputs composed from many rows: a scatter's gathered list, and child-run snapshots.

Read by the tick's loader (``load.py``) and by views, through ``outputs.py``. Outputs are
immutable once written, so finished gathers and attempt outputs are cached in each process,
one cache per database: tokens and run ids are unique within one database only (a copy of a
database holds the same ids, and their values may differ from there on).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from ..coordinator.read_rows import child_snapshot
from ..definition.spec import ChildScatterNodeSpec, SubworkflowNodeSpec, WorkflowSpec
from ..engine import RunState, RunStatus
from ..engine.children import child_run_id, children_to_read
from ..engine.inputs import ChildSnapshot
from ..engine.outputs import checkpoint_of
from ..engine.scatter import (
    BatchAttempt,
    assemble,
    assemble_batched,
    attempt_final,
    batch_attempt,
    child_final,
)
from ..engine.state import ScatterState
from .done_nodes import full_state
from .schema import step_attempt, workflow_run


class ImmutableCache:
    """Values that never change once written (attempt outputs, finished gathers, run inputs):
    each process keeps the recent ones, least recently used out first."""

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


PerDatabase = weakref.WeakKeyDictionary[Engine, ImmutableCache]

_outputs_caches: PerDatabase = weakref.WeakKeyDictionary()


def cache_for(caches: PerDatabase, engine: Engine, size: int = 4096) -> ImmutableCache:
    """The cache of ``caches`` for one database (its engine), made on first use."""
    cache = caches.get(engine)
    if cache is None:
        cache = caches.setdefault(engine, ImmutableCache(size=size))
    return cache


def outputs_cache(engine: Engine) -> ImmutableCache:
    """Attempt outputs, finished gathers and child outputs of one database."""
    return cache_for(_outputs_caches, engine)


def gather_any(conn: Connection, spec: WorkflowSpec, node: str, sc: ScatterState) -> list[Any]:
    if isinstance(spec.graph.nodes.get(node), ChildScatterNodeSpec):
        return gather_children(conn, node, sc)
    return gather(conn, node, sc)


def children_of(
    conn: Connection, spec: WorkflowSpec, state: RunState, *, stopping: bool = False
) -> dict[str, ChildSnapshot]:
    """Snapshots of the child runs this run waits on (sub-workflows and child-run scatters),
    and with ``stopping`` of those past their checkpoint too (``engine.children``)."""
    wanted = children_to_read(spec, state, stopping=stopping)  # child run id -> checkpoint
    if not wanted:
        return {}
    newest = child_runs(conn, list(wanted), with_state=any(wanted.values()))
    return {
        child: child_snapshot(child, newest.get(child), until) for child, until in wanted.items()
    }


def child_runs(conn: Connection, ids: list[str], with_state: bool = False) -> dict[str, Any]:
    """For each run id, the newest run of its continue-as-new chain (a child that continued
    as new is followed to its successor). Missing ids are left out."""
    cols = [
        workflow_run.c.run_id,
        workflow_run.c.status,
        workflow_run.c.output,
        workflow_run.c.error,
        workflow_run.c.continued_to,
        (full_state() if with_state else sa.literal(None)).label("state"),
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
            if r.status == RunStatus.CONTINUED and r.continued_to:
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
        finals[index] = child_final(row.run_id, row.status, row.output, row.error)
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
    return checkpoint_of(row.state, until)[1]


def gather(conn: Connection, node: str, sc: ScatterState) -> list[Any]:
    """A scatter's outputs in item order: each branch's last attempt (the one that counted).

    One query over the node's attempt rows of this scatter (generations above ``base``);
    cached (``outputs_cache``), since a finished scatter's branches never change.
    """
    key = f"gather:{sc.run}:{node}:{sc.base}:{sc.total}"
    cache = outputs_cache(conn.engine)
    found, _ = cache.get_many([key])
    if key in found:
        return list(found[key])
    out = _gather_batched(conn, node, sc) if sc.batch > 1 else _gather_branches(conn, node, sc)
    if not sc.gathering:
        cache.put(key, out)
    return out


def _gather_branches(conn: Connection, node: str, sc: ScatterState) -> list[Any]:
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
        r.branch: attempt_final(r.outcome, r.output, r.error)
        for r in conn.execute(
            sa.select(ranked.c.branch, ranked.c.outcome, ranked.c.output, ranked.c.error).where(
                ranked.c.rank == 1
            )
        )
    }
    return assemble(sc, finals)


def _gather_batched(conn: Connection, node: str, sc: ScatterState) -> list[Any]:
    """Every finished attempt of each batch, oldest first: a batch that gave up still has
    outputs for the items its workers recorded (``scatter.assemble_batched``)."""
    attempts: dict[int, list[BatchAttempt]] = {}
    rows = conn.execute(
        sa.select(
            step_attempt.c.branch,
            step_attempt.c.outcome,
            step_attempt.c.output,
            step_attempt.c.error,
        )
        .where(
            step_attempt.c.run_id == sc.run,
            step_attempt.c.node == node,
            step_attempt.c.generation > sc.base,
            step_attempt.c.branch.is_not(None),
            step_attempt.c.finished_at.is_not(None),
        )
        .order_by(step_attempt.c.branch, step_attempt.c.generation)
    )
    for r in rows:
        attempts.setdefault(r.branch, []).append(batch_attempt(r.outcome, r.output, r.error))
    return assemble_batched(sc, attempts)
