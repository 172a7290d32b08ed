"""A succeeded step node kept by its attempt row, not by the run row (PostgreSQL).

Every commit rewrites the run row, and PostgreSQL logs the row's new version whole: with
every node of the run in its state, the run row was most of a step's WAL (benchmarks/README.md,
eighteenth round). A step node that succeeded at its first attempt has nothing the attempt
row that ran it does not hold already:

    {"status": "succeeded", "generation": 1, "attempt": 1, "output_token": "<run>:<node>:1",
     "started_at": <the attempt's created_at>, "finished_at": <the attempt's finished_at>}

So the one-statement commit (store/pg_commit.py) leaves such nodes out of ``nodes`` and
names them in the state's ``done`` list instead, and PostgreSQL gives them back wherever a
state is read: ``eec_run_state(state, run_id)`` (migration 0020), which every reader selects
through ``full_state()`` (on SQLite, which never writes ``done``, the column itself).

A node goes into ``done`` only when its attempt row is known to give it back exactly:
- the carried outcome of the commit that writes it: the commit finishes the attempt at its
  own ``now`` (the node's ``finished_at``), and only if the row's ``created_at`` is the node's
  ``started_at`` (``pg_commit``'s ``carried_done``: else the carried outcome writes nothing
  and takes the ordinary path, which keeps the node in ``nodes``);
- or a node the tick read from ``done`` and left alone (the very time objects it read).
Anything else is written whole, as before; a state without ``done`` reads as it always did.
``RunState.from_json`` refuses a state that still names ``done``: a reader that forgot to
select ``full_state()`` fails loudly, never reads succeeded nodes as pending.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import GenericFunction

from ..engine.context import attempt_token
from ..engine.state import AttemptOutput, NodeState, StepWork
from ..engine.status import NodeStatus
from .schema import Json, workflow_run

#: A name the ``done`` and ``unstarted`` lists may hold (a node id: ``definition/validate.py``):
#: each list is one string, the names joined by commas.
NODE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")

#: The only step bookkeeping such a node has left.
_DONE_WORK = StepWork(attempt=1)


def shaped_done(run_id: str, name: str, node: NodeState) -> bool:
    """Whether ``node`` is a succeeded step node its first attempt row can give back."""
    output = node.output
    return (
        NODE_NAME.fullmatch(name) is not None
        and node.status == NodeStatus.SUCCEEDED
        and node.generation == 1
        and node.error is None
        and isinstance(output, AttemptOutput)
        and output.token == attempt_token(run_id, name, 1)
        and node.work == _DONE_WORK
        and node.started_at is not None
        and node.finished_at is not None
    )


def done_nodes(
    run_id: str,
    nodes: Mapping[str, NodeState],
    read_done: Iterable[str],
    read_nodes: Mapping[str, NodeState],
    carried_node: str | None,
    now: datetime,
) -> frozenset[str]:
    """The nodes a commit of ``nodes`` leaves to their attempt rows: the carried outcome's
    node (finished at ``now`` by this commit), and those read from ``done`` (``read_done``,
    as ``read_nodes`` held them) with the very times read."""
    found: set[str] = set()
    if carried_node is not None:
        node = nodes.get(carried_node)
        if node is not None and node.finished_at == now and shaped_done(run_id, carried_node, node):
            found.add(carried_node)
    for name in read_done:
        node, read = nodes.get(name), read_nodes.get(name)
        if (
            node is not None
            and read is not None
            and node.started_at is read.started_at
            and node.finished_at is read.finished_at
            and shaped_done(run_id, name, node)
        ):
            found.add(name)
    return frozenset(found)


class full_state(GenericFunction[Any]):  # noqa: N801 - a SQL function's name
    """The run's whole state, its ``done`` nodes given back by their attempt rows: select
    this, never ``eec_workflow_run.state`` itself, wherever a state is read."""

    type = Json
    inherit_cache = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not args:
            args = (workflow_run.c.state, workflow_run.c.run_id)
        super().__init__(*args, **kwargs)


@compiles(full_state)
def _full_state_sqlite(element: full_state, compiler: SQLCompiler, **kw: Any) -> str:
    # SQLite never writes ``done`` (only PostgreSQL's one-statement commit does).
    state, _run_id = element.clauses
    return str(compiler.process(state, **kw))


@compiles(full_state, "postgresql")
def _full_state_postgresql(element: full_state, compiler: SQLCompiler, **kw: Any) -> str:
    return f"eec_run_state({compiler.process(element.clauses, **kw)})"


def read_done(stored: str | frozenset[str] | None) -> frozenset[str]:
    """The names of a stored state's ``done`` value (joined by commas), or the names
    themselves (a kept read's: store/next_read.py)."""
    if isinstance(stored, frozenset):
        return stored
    return frozenset(stored.split(",")) if stored else frozenset()
