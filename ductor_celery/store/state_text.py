"""The run state's stored JSON text, each node's part encoded once while the node is unchanged.

Every commit rewrites the run's whole state, and encoding it was the part of a tick that grew
with the workflow: every node's ``to_json`` (its datetimes' ISO texts) and JSON encoding,
while a step of a chain changes one or two nodes. A thread keeps the text it made for each
node of the last run it committed, with the very values the text was made from (``_VALUES``:
immutable objects only, held, so no other object can take their identity). A node of the
next commit whose values are those same objects, by identity, has that same text:
``NodeState.to_json`` is a function of them alone. Identity decides, not where the node came
from: a node the tick copied from the last commit and left alone is found, and so is a
pending node read from the database (its values are singletons); a changed one is not.
Identity, not equality: equal datetimes with other offsets, ``True`` and ``1``, have other
texts.

A node holding a value a step supplied (``holds_step_values``: an error, a literal output,
an event set's) or a scatter is always encoded: those are mutable objects.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from ..engine.state import (
    DONE_KEY,
    OPEN_KEY,
    UNSTARTED_KEY,
    AttemptOutput,
    ChildWork,
    NodeState,
    ParkedWork,
    RunState,
    SignalOutput,
    StepWork,
)
from .done_nodes import NODE_NAME
from .schema import dumps_json

_OF_NODE = ("status", "generation", "output", "started_at", "finished_at", "work.__class__")

#: For each kind of work a node's text may be kept with (none, a step's, a timer's, a child
#: run's; never a scatter's), one getter of every value the text is made of. The work's class
#: is among them (sixth): tuples whose values are the same objects are of one kind and length.
_VALUES: dict[type, Callable[[NodeState], tuple[Any, ...]]] = {
    cls: operator.attrgetter(
        *_OF_NODE,
        *(f"work.{f.name}" for f in fields(cls)),
    )
    for cls in (StepWork, ParkedWork, ChildWork)
}
_VALUES[type(None)] = operator.attrgetter(*_OF_NODE)

#: A node's kept text, by node name: the values it was made of, and the text.
_Texts = dict[str, tuple[tuple[Any, ...], str]]

_local = threading.local()

#: A node that never started: stored as its name in the ``unstarted`` list.
_UNSTARTED = NodeState()


def state_text(run_id: str, state: RunState, done: frozenset[str] = frozenset()) -> str:
    """``dumps_json(state.to_json())``, as the same JSON value (keys in another order: the
    ``jsonb`` column orders them itself), reusing this thread's texts of the nodes of
    ``run_id``'s last commit that are unchanged since. ``done``: nodes left to their attempt
    rows, named in the ``done`` list instead; a node that never started is named in the
    ``unstarted`` list (store/done_nodes.py)."""
    kept = getattr(_local, "kept", None)
    before: _Texts = kept[1] if kept is not None and kept[0] == run_id else {}
    now: _Texts = {}
    parts = []
    is_ = operator.is_
    unstarted = []
    for name, node in state.nodes.items():
        if name in done:
            continue
        if node == _UNSTARTED and NODE_NAME.fullmatch(name):
            unstarted.append(name)
            continue
        values_of = None if holds_step_values(node) else _VALUES.get(type(node.work))
        if values_of is None:
            parts.append(_node_text(name, node))
            continue
        values = values_of(node)
        found = before.get(name)
        if found is not None and all(map(is_, found[0], values)):
            now[name] = found  # its tuple holds the very same objects
            parts.append(found[1])
        else:
            text = _node_text(name, node)
            now[name] = (values, text)
            parts.append(text)
    _local.kept = (run_id, now)
    rest = dumps_json(state.to_json_but_nodes())  # never "{}": it has status and context
    # Each list as one string, the names joined by commas (a node id has none): ``jsonb``
    # spends a few bytes on a string, more on each element of an array.
    held = ",".join(parts)
    if not (done or unstarted):
        return '{"nodes":{' + held + "}," + rest[1:]
    # The nodes it holds under "open", and "nodes" null: a reader from before 0.3.18 fails on
    # it (a rolling upgrade's old process), where "nodes" without the named ones would have
    # passed for a run whose succeeded steps are pending.
    named = f'"{DONE_KEY}":"{",".join(sorted(done))}",' if done else ""
    if unstarted:
        named += f'"{UNSTARTED_KEY}":"{",".join(unstarted)}",'
    return '{"nodes":null,"' + OPEN_KEY + '":{' + held + "}," + named + rest[1:]


def holds_step_values(node: NodeState) -> bool:
    """Whether ``node`` holds a value a step (or a signal's sender) supplied: an error, or an
    output that is not a reference (a literal, an event set's). Those are mutable, and come
    back from ``jsonb`` in its order of keys (store/next_read.py)."""
    output = node.output
    return node.error is not None or not (
        output is None or isinstance(output, AttemptOutput | SignalOutput)
    )


def _node_text(name: str, node: NodeState) -> str:
    """The node's member of the ``nodes`` object: ``"name":{...}``."""
    return dumps_json({name: node.to_json()})[1:-1]


def forget() -> None:
    """Drop this thread's texts (tests)."""
    _local.kept = None
