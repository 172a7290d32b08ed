"""The production store behind the coordinator's port (``coordinator/port.py``): PostgreSQL
or SQLite through SQLAlchemy, one connection and one transaction per tick.

A thin adapter: the load is ``load.load_on``, the commit ``ticks.commit_on``, both on the
transaction's connection, which holds the run's row lock from the load to the commit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import datetime
from types import TracebackType
from typing import Any, TypeVar

from sqlalchemy.engine import Connection, Engine

from ..coordinator.port import Loaded, LoadedRun, OutboxRow, TickClaim
from ..definition.spec import WorkflowSpec
from ..engine import EngineConfig, TickPayload
from . import wakes
from .db import with_retry
from .load import load_on
from .ticks import commit_on, refresh_stale_timer, reject_control

T = TypeVar("T")

#: A pinned definition by its hash, read on the tick's connection when not cached.
SpecFor = Callable[[str, Connection], WorkflowSpec]


class SqlTickStore:
    """``TickStore`` over an SQLAlchemy engine."""

    __slots__ = ("engine", "spec_for", "config")

    def __init__(self, engine: Engine, spec_for: SpecFor, config: EngineConfig) -> None:
        self.engine = engine
        self.spec_for = spec_for
        self.config = config

    def transaction(self) -> SqlTickTransaction:
        return SqlTickTransaction(self)

    def retrying(self, fn: Callable[[], T], what: str) -> T:
        return with_retry(fn, what=what)

    def clear_wake(self, run_id: str) -> bool:
        return with_retry(
            functools.partial(wakes.clear_wake, self.engine, run_id), what="clear wake-up"
        )

    def reject_control(self, control_id: int, result: str) -> None:
        reject_control(self.engine, control_id, result)


class SqlTickTransaction:
    """One tick's transaction (``engine.begin()``); ``conn`` is its connection, which a
    step worker's prelude writes its outcome on."""

    __slots__ = ("_store", "_begin", "conn")

    def __init__(self, store: SqlTickStore) -> None:
        self._store = store
        self._begin: Any = None
        self.conn: Connection

    def __enter__(self) -> SqlTickTransaction:
        self._begin = self._store.engine.begin()
        self.conn = self._begin.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._begin.__exit__(exc_type, exc, tb)

    def load(self, run_id: str, *, wait_for_lock: bool) -> Loaded | None:
        store = self._store
        return load_on(self.conn, run_id, store.spec_for, store.config, wait_for_lock=wait_for_lock)

    def commit(
        self, loaded: LoadedRun, payload: TickPayload, claim: TickClaim | None
    ) -> list[OutboxRow]:
        return commit_on(self.conn, loaded, payload, claim)

    def refresh_stale_timer(self, loaded: LoadedRun, fire_at: datetime | None) -> bool:
        return refresh_stale_timer(self.conn, loaded, fire_at)
