"""Redrive: reopen a finished run so the nodes that did not succeed (and, from a node, that node
and everything after it) run again.

A plain redrive (``redrive(t)``, a failed, cancelled or terminated run) puts ``failed`` and
``cancelled`` nodes back to ``pending``. A redrive from a node (``redrive(t, from_node=n)``,
any finished run but a continued one, a succeeded one too) also puts ``n`` and every node
downstream of it back to ``pending``, whatever their status: they run again with what is
upstream of them, whose outputs are kept. A node put back keeps its generation (its next
attempt, child run or approval episode gets a new id) and nothing else: a fresh retry budget,
no output. The context is kept as it is: nodes that run again apply their patches on top.

``input=`` replaces the input the reopened run's nodes see. The run row's input column is
never updated (each process caches it, ``store/load.py``): the control row that carried the new
input keeps it, and ``RunState.input_from`` names that row; every reader of a run's input
(the tick's load, ``ctx.input``, ``RunView.input``) reads it from there.
"""

from __future__ import annotations

import dataclasses

from ..definition.spec import WorkflowSpec
from .compensation import undone_nodes
from .context import TickContext
from .inputs import ControlIn
from .kinds import ControlKind
from .state import NodeState, RunState
from .status import NodeStatus, RunStatus

#: Node statuses every redrive puts back to pending.
_RERUN = frozenset({NodeStatus.FAILED, NodeStatus.CANCELLED})


def downstream(t: TickContext, node: str) -> set[str]:
    """``node`` and every node after it: its dependants, and readers of their outputs."""
    graph = t.spec.graph
    found = {node}
    todo = [node]
    while todo:
        current = todo.pop()
        after = set(graph.dependants.get(current, ()))
        after |= {n for n, reads in graph.reads.items() if current in reads}
        for nxt in after - found:
            found.add(nxt)
            todo.append(nxt)
    return found


def from_node_problem(t: TickContext, node: str | None) -> str | None:
    """Why a redrive from ``node`` cannot be applied to this run's definition."""
    if node is not None and node not in t.spec.graph.nodes:
        return f"no node {node!r} in workflow {t.spec.name!r} version {t.spec.version}"
    return None


def redrive(t: TickContext, control: ControlIn, reason: str) -> None:
    """Reopen the run (the caller checked the control is allowed).

    After a saga (docs/compensation.md), each node whose compensation succeeded runs again,
    and everything after it, as a redrive from that node would: its effect was undone. Nodes
    whose compensation did not succeed keep their outputs (their effect stands)."""
    again = downstream(t, control.node) if control.node is not None else set()
    for node_id in undone_nodes(t.payload.state):
        again |= downstream(t, node_id)
    t.payload.state.compensation = None
    for node_id in t.spec.graph.order:
        ns = t.nodes[node_id]
        if ns.status in _RERUN or (node_id in again and ns.status != NodeStatus.PENDING):
            t.nodes[node_id] = NodeState(generation=ns.generation)
            t.record(node_id, ns.status, NodeStatus.PENDING, reason)
    if control.has_input:
        t.payload.state.input_from = control.id
        # The rest of this tick reads the new input too (the next ones load it).
        t.inputs = dataclasses.replace(t.inputs, input=control.input)
    t.payload.reopened = True
    t.payload.error = None
    t.payload.state.continue_pending = None
    t.move_run(RunStatus.RUNNING, reason)


def reads_for(
    definition: WorkflowSpec, control: ControlIn | None, state: RunState | None = None
) -> frozenset[str]:
    """Nodes whose outputs a tick applying ``control`` may resolve beyond those that
    ``read_nodes`` names: a redrive from a node (or of a compensated run, whose undone nodes
    run again) puts succeeded nodes back to pending in the tick itself, and they start at
    once with what they read upstream."""
    if control is None or control.kind != ControlKind.REDRIVE:
        return frozenset()
    if control.node is None and (state is None or not undone_nodes(state)):
        return frozenset()
    graph = definition.graph
    return graph.output_reads.union(*graph.reads.values())
