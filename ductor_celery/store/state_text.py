"""The run state's stored JSON text, each node's part encoded once while the node is unchanged.

Every commit rewrites the run's whole state, and encoding it was the part of a tick that grew
with the workflow: every node's ``to_json`` (its datetimes' ISO texts) and JSON encoding,
while a step of a chain changes one or two nodes. A thread keeps the text it made for each
node of the last run it committed, with the very values the text was made from (``_made_of``:
immutable objects only). A node of the next commit whose values are those same objects, by
identity, has that same text: ``NodeState.to_json`` is a function of them alone. Any other
node is encoded anew: a node copied from the last commit unchanged is found, one read from
the database or changed is not. Identity, not equality: equal datetimes with other offsets,
``True`` and ``1``, have other texts.

A node holding a value a step supplied (an error, a literal output, an event set's, a
scatter's) is always encoded: those are dicts, which can change in place.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from ..engine.state import (
    AttemptOutput,
    ChildWork,
    NodeState,
    ParkedWork,
    RunState,
    SignalOutput,
    StepWork,
)
from .schema import dumps_json

_NODE = operator.attrgetter(
    "status", "generation", "output", "started_at", "finished_at", "work.__class__"
)
#: The outputs a kept node may hold: references, immutable.
_KEPT_OUTPUTS = frozenset({AttemptOutput, SignalOutput})


def _values_of(cls: type) -> Callable[[Any], tuple[Any, ...]]:
    """A function returning the values of ``cls``'s fields, as a tuple."""
    get = operator.attrgetter(*(f.name for f in fields(cls)))
    return get if len(fields(cls)) > 1 else lambda work: (get(work),)


#: The values of each kind of work a node's text is made of (a scatter's is never kept).
_WORK: dict[type, Callable[[Any], tuple[Any, ...]]] = {
    cls: _values_of(cls) for cls in (StepWork, ParkedWork, ChildWork)
}

_local = threading.local()


def state_text(run_id: str, state: RunState) -> str:
    """``dumps_json(state.to_json())``, as the same JSON value (keys in another order: the
    ``jsonb`` column orders them itself), reusing this thread's texts of the nodes of
    ``run_id``'s last commit that are unchanged since."""
    kept = getattr(_local, "kept", None)
    before: dict[str, tuple[tuple[Any, ...], str]] = (
        kept[1] if kept is not None and kept[0] == run_id else {}
    )
    now: dict[str, tuple[tuple[Any, ...], str]] = {}
    parts = []
    is_ = operator.is_
    for name, node in state.nodes.items():
        made_of = _made_of(node)
        if made_of is None:
            parts.append(_node_text(name, node))
            continue
        found = before.get(name)
        if found is not None and len(found[0]) == len(made_of) and all(map(is_, found[0], made_of)):
            now[name] = found  # its tuple holds the very same objects
            parts.append(found[1])
        else:
            text = _node_text(name, node)
            now[name] = (made_of, text)
            parts.append(text)
    _local.kept = (run_id, now)
    rest = dumps_json(state.to_json_but_nodes())
    return '{"nodes":{' + ",".join(parts) + "}," + rest[1:]


def _node_text(name: str, node: NodeState) -> str:
    """The node's member of the ``nodes`` object: ``"name":{...}``."""
    return dumps_json({name: node.to_json()})[1:-1]


def _made_of(node: NodeState) -> tuple[Any, ...] | None:
    """The values ``node``'s text is made of, all immutable; None when it holds one that is
    not (an error, a literal or event set's output, a scatter)."""
    output = node.output
    if node.error is not None or not (output is None or type(output) in _KEPT_OUTPUTS):
        return None
    work = node.work
    if work is None:
        return _NODE(node)
    of_work = _WORK.get(type(work))
    if of_work is None:
        return None
    return _NODE(node) + of_work(work)


def forget() -> None:
    """Drop this thread's texts (tests)."""
    _local.kept = None
