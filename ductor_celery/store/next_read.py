"""A chain's next read, returned by its commit (docs/next-read-from-commit.md).

A commit alone that claims the chain's next attempt for this worker returns, in the same
statement, what the run's next read would find (``pg_commit.NextRead``). This thread
keeps it (``keep``) for the next tick of the same run in the same thread, which takes it
(``take``) instead of reading the run row again, when it is still fresh. The next commit is
conditional on the run being as the kept read describes it (its version and its timer row,
``pg_commit.RUN_AS_READ``), exactly as on a read: a tick that committed in between makes it
busy.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from ..coordinator.port import LoadedRun
from .pg_commit import NextRead

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


class _Kept(NamedTuple):
    engine: Any
    loaded: LoadedRun
    timer_at: datetime | None
    read: NextRead
    at: float


_local = threading.local()


def keep(engine: Any, loaded: LoadedRun, timer_at: datetime | None, read: NextRead) -> None:
    """Keep what the commit of ``loaded``'s run returned (``Committed.next_read``), with the
    timer row as the commit left it."""
    _local.kept = _Kept(engine, loaded, timer_at, read, time.monotonic())


def take(engine: Any, run_id: str) -> RunRow | None:
    """The kept read of ``run_id`` if this thread's last commit kept one on ``engine``, fresh
    and with nothing else to apply; always forgets it (it is good for one tick at most)."""
    kept: _Kept | None = getattr(_local, "kept", None)
    if kept is None:
        return None
    _local.kept = None
    elapsed = time.monotonic() - kept.at
    loaded = kept.loaded
    if kept.engine is not engine or loaded.run_id != run_id or elapsed > NEXT_READ_FRESH_FOR_S:
        return None
    read = kept.read
    if read.has_results or read.has_control or read.has_signals or read.state is None:
        return None
    return RunRow(
        run_id=loaded.run_id,
        workflow_id=loaded.workflow_id,
        workflow=loaded.workflow,
        spec_hash=loaded.spec_hash,
        record_version=loaded.record_version + 1,
        state=read.state,
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
    )


def forget() -> None:
    """Drop this thread's kept read (a chain's end: nothing holds on to its run and engine)."""
    _local.kept = None


# A forked child starts with its parent's memory: it never takes the parent's read.
os.register_at_fork(after_in_child=forget)
