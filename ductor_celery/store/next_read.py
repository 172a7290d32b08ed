"""A chain's next read, returned by its commit (docs/next-read-from-commit.md).

A commit alone that claims the chain's next attempt for this worker returns, in the same
statement, what the run's next read would find (``pg_commit.NextRead``). This thread
keeps it (``keep``) for the next tick of the same run in the same thread, which takes it
(``take``) instead of reading the run row again, when it is still fresh. The next commit is
conditional on the run being as the kept read describes it (its version,
``pg_commit.RUN_AS_READ``), exactly as on a read: a tick that committed in between makes it
busy.

The state's nodes are not sent back by PostgreSQL: they are the nodes the tick committed,
as a read would decode them (``nodes_as_read``), which spares the next tick the decoding of
every node (docs/next-read-from-commit.md, "The nodes kept").
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from ..coordinator.port import LoadedRun
from ..engine.state import (
    ChildWork,
    NodeState,
    ParkedWork,
    RunState,
    StepWork,
)
from .pg_commit import NextRead
from .schema import dumps_json
from .state_text import holds_step_values

#: A kept read older than this is dropped and the tick reads: a control, a signal or an
#: outcome written alone after the commit is then left to the wake-up it sends for at most
#: this long longer than if the tick had read (the window a tick's own read-to-commit has).
NEXT_READ_FRESH_FOR_S = 0.010


class RunRow(NamedTuple):
    """The kept read, in the shape of the tick's run-row read (``load._run_row``)."""

    run_id: str
    workflow_id: str
    workflow: str
    spec_hash: str
    record_version: int
    state: Any
    input: Any
    parent_run_id: str | None
    created_at: datetime | None
    trace_context: str | None
    priority: int
    now: datetime
    timer_at: datetime | None
    results: Any
    has_control: bool
    has_signals: bool
    #: The nodes the stored state left to their attempt rows (store/done_nodes.py).
    done: Any = None


class _Kept(NamedTuple):
    engine: Any
    loaded: LoadedRun
    timer_at: datetime | None
    read: NextRead
    nodes: dict[str, NodeState]
    at: float
    done: frozenset[str]
    #: How old its snapshot was when the statement returned (it waited for the run's lock).
    age: float


_local = threading.local()


def keep(
    engine: Any,
    loaded: LoadedRun,
    timer_at: datetime | None,
    read: NextRead,
    nodes: dict[str, NodeState],
    done: frozenset[str] = frozenset(),
) -> None:
    """Keep what the commit of ``loaded``'s run returned (``Committed.next_read``), with the
    timer row as the commit left it and the nodes it stored (the tick's state's: nothing
    changes them after the commit, and the next tick's computation copies them first;
    ``done``: those it left to their attempt rows)."""
    age = 0.0 if read.db_began is None else (read.db_now - read.db_began).total_seconds()
    _local.kept = _Kept(engine, loaded, timer_at, read, nodes, time.monotonic(), done, age)


def take(engine: Any, run_id: str) -> RunRow | None:
    """The kept read of ``run_id`` if this thread's last commit kept one on ``engine``, fresh
    and with nothing else to apply; always forgets it (it is good for one tick at most)."""
    kept: _Kept | None = getattr(_local, "kept", None)
    if kept is None:
        return None
    _local.kept = None
    elapsed = time.monotonic() - kept.at
    loaded = kept.loaded
    # Fresh as its snapshot is: the flags below are as of the statement's start.
    stale = elapsed + kept.age > NEXT_READ_FRESH_FOR_S
    if kept.engine is not engine or loaded.run_id != run_id or stale:
        return None
    read = kept.read
    if read.has_results or read.has_control or read.has_signals or read.state is None:
        return None
    state = RunState.from_json(read.state)
    state.nodes = nodes_as_read(kept.nodes)
    return RunRow(
        run_id=loaded.run_id,
        workflow_id=loaded.workflow_id,
        workflow=loaded.workflow,
        spec_hash=loaded.spec_hash,
        record_version=loaded.record_version + 1,
        state=state,
        input=None,
        parent_run_id=loaded.parent_run_id,
        created_at=loaded.created_at,
        trace_context=loaded.trace_context,
        priority=loaded.priority,
        # The database's clock as the commit's statement ended, moved on by this process's
        # monotonic one from when the statement returned: behind the database's, never ahead.
        now=read.db_now + timedelta(seconds=elapsed),
        timer_at=kept.timer_at,
        results=None,
        has_control=False,
        has_signals=False,
        done=kept.done,
    )


def nodes_as_read(nodes: Mapping[str, NodeState]) -> dict[str, NodeState]:
    """The nodes a tick committed, as the run's next read would decode them from the
    ``jsonb`` PostgreSQL stored: in ``jsonb``'s order of keys (shorter first, then by
    bytes), and a node holding values a step could see (an error, a literal output, an
    event set's, a scatter's errors) decoded again from what a read returns for it. Every
    other node holds only the engine's own fields, which the ``jsonb`` keeps as they are:
    it is taken as it is, not copied (``compute_tick`` copies its input before changing it).
    """
    return {name: _node_as_read(nodes[name]) for name in _in_jsonb_order(tuple(nodes))}


@functools.lru_cache(maxsize=256)
def _in_jsonb_order(names: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` in ``jsonb``'s order, once per set of node names (a run's are its workflow's:
    sorting them again at every tick was about 1% of a 40-node run's step CPU)."""
    return tuple(sorted(names, key=_jsonb_key_order))


def _jsonb_key_order(key: str) -> tuple[int, bytes]:
    """``jsonb``'s order of an object's keys: by length in bytes, then bytewise."""
    encoded = key.encode()
    return len(encoded), encoded


#: A step's and a timer's bookkeeping with every field unset: stored as nothing, read as no
#: work at all.
_UNSET_STEP, _UNSET_PARKED = StepWork(), ParkedWork()


def _node_as_read(node: NodeState) -> NodeState:
    if _reads_back_as_itself(node):
        return node
    return NodeState.from_json(_as_jsonb(json.loads(dumps_json(node.to_json()))))


def _reads_back_as_itself(node: NodeState) -> bool:
    """Whether a read would decode ``node`` as this very object, field for field and variant
    for variant: no value a step supplied (those come back in ``jsonb``'s order), and work
    that is stored as what it is. Its datetimes come back with a fixed offset where the
    tick's may carry the session's zone: equal instants, the same text, and the engine only
    compares and stores them (its arithmetic starts from the tick's ``now``)."""
    if holds_step_values(node):
        return False
    work = node.work
    if work is None:
        return True
    if isinstance(work, StepWork):  # every step node's; ``attempt`` is set once it started
        return bool(work.attempt) or work != _UNSET_STEP
    if isinstance(work, ParkedWork):
        return work.deadline is not None
    if isinstance(work, ChildWork):  # without its child run it reads back as a timer, or none
        return work.child_run is not None
    return False  # a scatter: its branches' and items' errors


def _as_jsonb(value: Any) -> Any:
    """A decoded JSON value as ``jsonb`` gives it back: objects' keys in its order, and no
    negative zero (a ``numeric`` zero has no sign)."""
    if isinstance(value, dict):
        return {k: _as_jsonb(value[k]) for k in sorted(value, key=_jsonb_key_order)}
    if isinstance(value, list):
        return [_as_jsonb(v) for v in value]
    if isinstance(value, float) and value == 0.0:
        return 0.0
    return value


def forget() -> None:
    """Drop this thread's kept read (a chain's end: nothing holds on to its run and engine)."""
    _local.kept = None


# A forked child starts with its parent's memory: it never takes the parent's read.
os.register_at_fork(after_in_child=forget)
