"""``RetryPolicy(on_exhausted="pause")``: a node out of attempts pauses its run, not fails it.

The node is ``failed`` with its error kept (what an operator reads to fix the code) and
marked ``awaiting_resume`` (its ``StepWork``), which keeps ``fail_run_on_fatal_node`` from
failing the run on it.
The run is ``paused``: attempts in flight elsewhere finish and are folded, nothing new starts.
A resume puts every such node back to ``pending`` with a fresh retry budget (its generation
kept, so its next attempt gets a new token), and the run carries on from there.
"""

from __future__ import annotations

from ..definition.spec import compensated_node
from .context import TickContext
from .state import NodeState, StepWork
from .status import NodeStatus, RunStatus


def pause_on_exhausted(t: TickContext, node: str) -> None:
    """The node has just failed on its last attempt: hold the run on it."""
    t.nodes[node].step.awaiting_resume = True
    reason = f"node {node!r} used every attempt (on_exhausted='pause'): paused until resumed"
    state = t.payload.state
    if state.status == RunStatus.PAUSED:
        t.record(None, state.status, state.status, reason)
    else:
        t.move_run(RunStatus.PAUSED, reason)


def rerun_exhausted(t: TickContext, reason: str, compensations_only: bool = False) -> None:
    """On resume: each node the run was paused on runs again, with a fresh retry budget.
    While a saga runs (``compensations_only``) only its compensations do: a regular node
    would never start again, as nothing but compensations moves until the run ends."""
    for node_id, ns in t.nodes.items():
        if compensations_only and compensated_node(node_id) is None:
            continue
        awaiting = isinstance(ns.work, StepWork) and ns.work.awaiting_resume
        if awaiting and ns.status == NodeStatus.FAILED:
            t.nodes[node_id] = NodeState(generation=ns.generation)
            t.record(node_id, ns.status, NodeStatus.PENDING, f"{reason}: fresh retry budget")
