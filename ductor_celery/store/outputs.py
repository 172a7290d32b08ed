"""The rows output references point at (``engine/outputs.py``), read from the database.

Two sources for the one resolver, ``engine.outputs.resolve_outputs``: ``ConnectionOutputs`` on
a tick's connection (the loader), ``EngineOutputs`` for readers outside a tick (the client's
run views), each read wrapped as the caller wants (``read``: the client rides out a dropped
connection).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from ..definition.spec import WorkflowSpec
from ..engine.state import ScatterState
from .composed import child_output, gather_any, outputs_cache
from .schema import step_attempt, workflow_signal

T = TypeVar("T")


def attempt_outputs(conn: Connection, tokens: list[str]) -> dict[str, Any]:
    """Attempt outputs by token; cached once the attempt finished (an output never changes
    once written, but an open attempt's has not been written yet)."""
    cache = outputs_cache(conn.engine)
    found, missing = cache.get_many(tokens)
    if missing:
        rows = conn.execute(
            sa.select(
                step_attempt.c.token, step_attempt.c.output, step_attempt.c.finished_at
            ).where(step_attempt.c.token.in_(missing))
        )
        for r in rows:
            if r.finished_at is not None:  # an open attempt's NULL is not its output yet
                cache.put(r.token, r.output)
            found[r.token] = r.output
    return found


def signal_payloads(conn: Connection, ids: list[int]) -> dict[int, Any]:
    if not ids:
        return {}
    rows = conn.execute(
        sa.select(workflow_signal.c.id, workflow_signal.c.payload).where(
            workflow_signal.c.id.in_(ids)
        )
    )
    return {r.id: r.payload for r in rows}


class ConnectionOutputs:
    """``OutputSource`` on one connection (a tick's, inside its transaction)."""

    __slots__ = ("conn", "spec")

    def __init__(self, conn: Connection, spec: WorkflowSpec) -> None:
        self.conn = conn
        self.spec = spec

    def attempt_outputs(self, tokens: list[str]) -> Mapping[str, Any]:
        return attempt_outputs(self.conn, tokens)

    def signal_payloads(self, ids: list[int]) -> Mapping[int, Any]:
        return signal_payloads(self.conn, ids)

    def gathered(self, node: str, scatter: ScatterState) -> Any:
        return gather_any(self.conn, self.spec, node, scatter)

    def child_output(self, node: str, child_run: str) -> Any:
        return child_output(self.conn, self.spec, node, child_run)


Read = Callable[[Callable[[], Any], str], Any]


class EngineOutputs:
    """``OutputSource`` on an engine: each read on a connection of its own, through ``read``
    (``read(fn, what)`` runs ``fn``); the definition is fetched only if a scatter or a
    sub-workflow needs it."""

    __slots__ = ("engine", "spec_of", "read")

    def __init__(self, engine: Engine, spec_of: Callable[[], WorkflowSpec], read: Read) -> None:
        self.engine = engine
        self.spec_of = spec_of
        self.read = read

    def _on_connection(self, fn: Callable[[Connection], T], what: str) -> T:
        def once() -> T:
            with self.engine.connect() as conn:
                return fn(conn)

        result: T = self.read(once, what)
        return result

    def attempt_outputs(self, tokens: list[str]) -> Mapping[str, Any]:
        return self._on_connection(lambda conn: attempt_outputs(conn, tokens), "attempt outputs")

    def signal_payloads(self, ids: list[int]) -> Mapping[int, Any]:
        return self._on_connection(lambda conn: signal_payloads(conn, ids), "signal payloads")

    def gathered(self, node: str, scatter: ScatterState) -> Any:
        spec = self.spec_of()
        return self._on_connection(lambda conn: gather_any(conn, spec, node, scatter), "gather")

    def child_output(self, node: str, child_run: str) -> Any:
        spec = self.spec_of()
        return self._on_connection(
            lambda conn: child_output(conn, spec, node, child_run), "child output"
        )
