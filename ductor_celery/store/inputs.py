"""A run's input as its nodes see it: the inserted one, or the one a redrive replaced it with.

``eec_workflow_run.input`` is never updated (processes cache it). A redrive with ``input=``
leaves its input in its control row and the run's state names that row (``input_from``,
engine/redrive.py): a control row is never updated either, so it is cached the same way.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from ..engine.state import RunState
from . import blobs
from .composed import ImmutableCache
from .done_nodes import full_state
from .schema import workflow_control, workflow_run


def _control_input(conn: Connection, control_id: int) -> Any:
    return conn.execute(
        sa.select(workflow_control.c.input).where(workflow_control.c.id == control_id)
    ).scalar_one_or_none()


def redriven_input(conn: Connection, cache: ImmutableCache, run_id: str, control_id: int) -> Any:
    """The input a redrive gave the run (cached: the row never changes)."""
    key = f"{run_id}#redrive:{control_id}"
    found, _ = cache.get_many([key])
    if key in found:
        return found[key]
    value = _control_input(conn, control_id)
    cache.put(key, value)
    return value


def effective_input(conn: Connection, state: RunState, inserted: Any) -> Any:
    """What the run's nodes read as ``$.input``: a redrive's input, or the inserted one."""
    if state.input_from is None:
        return inserted
    return _control_input(conn, state.input_from)


def input_for_view(engine: Engine, state: RunState, inserted: Any) -> Any:
    """``RunView.input``: the input the run's nodes see."""
    if state.input_from is None:
        return inserted
    with engine.connect() as conn:
        return effective_input(conn, state, inserted)


def current_input(engine: Engine, run_id: str) -> Any:
    """``ctx.input``: the run's input as its nodes see it now (read only when a step asks)."""
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(workflow_run.c.input, full_state().label("state")).where(
                workflow_run.c.run_id == run_id
            )
        ).one_or_none()
        if row is None:
            return None
        value = effective_input(conn, RunState.from_json(row.state), row.input)
        return blobs.resolved(conn, value, f"the input of run {run_id}")
