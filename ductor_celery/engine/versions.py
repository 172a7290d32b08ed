"""``continue_as_new(t, version=...)``: the successor runs another registered definition.

A run keeps the definition it started with (it pins its hash) whatever is registered later.
Moving it to another version is a continue-as-new whose successor is inserted with that
definition's hash and version. The control carries the hash (the client resolved the version
and stored the definition first); ``continue_pending`` keeps it while attempts drain, and the
loader reads that definition into ``TickInputs.successor_spec``.

What the successor carries without ``input`` (``carried_into``): the context, and each
finished (or parked) node whose spec is the same in the new definition and all of whose
dependencies and read nodes are carried too. A node that is new, changed, or downstream of
one that is, starts again, so no output computed by old code feeds a node that changed.
With ``input`` the successor starts the new definition from the top.
"""

from __future__ import annotations

from typing import Any

from ..definition.spec import WorkflowSpec
from .inputs import ControlIn
from .kinds import ControlKind
from .state import NodeState, RunState


def successor_spec_hash(state: RunState, control: ControlIn | None) -> str | None:
    """The definition a tick of this run may continue into, for the loader to read."""
    if control is not None and control.kind == ControlKind.CONTINUE_AS_NEW and control.spec_hash:
        return control.spec_hash
    pending = state.continue_pending or {}
    found = pending.get("spec_hash")
    return found if isinstance(found, str) else None


def carried_into(
    old: WorkflowSpec,
    new: WorkflowSpec,
    candidates: dict[str, NodeState],
    context: dict[str, Any],
) -> RunState:
    """The successor's state on ``new``: the context, and each of ``candidates`` (the nodes
    the predecessor would carry) whose spec, and every spec upstream of it, is unchanged."""
    carried = RunState.initial(new.graph.order)
    carried.context = dict(context)
    kept: set[str] = set()
    for node_id in new.graph.order:
        ns = candidates.get(node_id)
        spec = new.graph.nodes[node_id]
        if ns is None or old.graph.nodes.get(node_id) != spec:
            continue
        upstream = set(spec.after) | new.graph.reads.get(node_id, frozenset())
        if upstream <= kept:
            carried.nodes[node_id] = ns
            kept.add(node_id)
    return carried
