"""The working set of one tick, shared by the phases: the state copy and the payload so far."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..definition.blobrefs import BlobValues
from ..definition.spec import AttemptNodeSpec, WorkflowSpec
from .inputs import TickInputs, TickPayload, Transition
from .state import NodeState
from .status import NODE_TRANSITIONS, TERMINAL_RUN_STATUSES, NodeStatus, RunStatus


def attempt_token(run_id: str, node: str, generation: int) -> str:
    """The token of a node's attempt: its run, its node, its generation (every attempt of one
    generation shares it; store/done_nodes.py rebuilds a first generation's from it)."""
    return f"{run_id}:{node}:{generation}"


@dataclass(slots=True)
class TickContext:
    spec: WorkflowSpec
    inputs: TickInputs
    now: datetime
    payload: TickPayload
    #: Outputs readable by paths this tick: loaded ones plus those folded in this tick.
    outputs: dict[str, Any] = field(default_factory=dict)
    #: Large values the load read; what paths needed beyond them (docs/large-values.md).
    blobs: BlobValues = field(default_factory=BlobValues)
    #: A scatter over an offloaded list stopped at the end of the page it read with room for
    #: more branches (some of the page's were refused): the run's next tick is due now, and
    #: this computation reads no further page for it (no extra read round). Its node ids.
    page_due: set[str] = field(default_factory=set)
    #: How many transitions the tick had recorded when ``start_ready_nodes`` last finished a
    #: walk over the nodes (-1: none yet); the same count at its next call means nothing it
    #: could start has become ready since (``schedule.start_ready_nodes``). That holds only
    #: while every status change goes through ``move_node``, which records one.
    ready_walked_at: int = -1
    #: The state's nodes, ``payload.state.nodes`` (the engine replaces neither): an attribute,
    #: not a property, since the phases look nodes up a hundred times and more per tick.
    nodes: dict[str, NodeState] = field(init=False)

    def __post_init__(self) -> None:
        self.nodes = self.payload.state.nodes

    def attempt_spec(self, node: str) -> AttemptNodeSpec:
        """The spec of a node that runs attempts (step and scatter nodes, and compensations)."""
        compensation = self.spec.graph.compensations.get(node)
        if compensation is not None:
            return compensation
        spec = self.spec.graph.nodes[node]
        assert isinstance(spec, AttemptNodeSpec), f"{node} is a {spec.kind} node, not a step"
        return spec

    def token_for(self, node: str, generation: int) -> str:
        return attempt_token(self.inputs.run_id, node, generation)

    def move_node(self, node: str, to: NodeStatus, reason: str) -> None:
        """Change a node's status along the allowed map and record the transition."""
        ns = self.nodes[node]
        if to not in NODE_TRANSITIONS[ns.status]:
            # A bug in a phase, never a data problem: keep the state and say so in history.
            self.record(node, ns.status, ns.status, f"refused transition to {to.value}: {reason}")
            return
        self.record(node, ns.status, to, reason)
        ns.status = to

    def move_run(self, to: RunStatus, reason: str) -> None:
        state = self.payload.state
        self.record(None, state.status, to, reason)
        state.status = to
        self.payload.finished = to in TERMINAL_RUN_STATUSES

    def record(self, node: str | None, old: str | None, new: str, reason: str) -> None:
        self.payload.transitions.append(
            Transition(node=node, from_status=old, to_status=new, reason=reason)
        )
        self.payload.changed = True
