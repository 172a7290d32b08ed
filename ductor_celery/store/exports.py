"""A run's rows out of the store, and back into another one (docs/replay.md).

``read_rows`` reads everything one run is made of, in one read transaction, as plain values:
JSON columns as stored (ductor's tagged encoding, secrets as references), times as aware
datetimes. ``restore_rows`` inserts such rows into an empty database (the test harness's), in
one transaction: the run exactly as it was, ids, versions and folded marks included.

The rows' wire form (times as ISO text, the format version) is ``store/export_format.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from ..engine.tags import tags_problem
from ..errors import ExportError
from . import blobs, history
from . import tags as run_tags
from .db import aware
from .dialect import dialect_of
from .done_nodes import full_state
from .schema import (
    step_attempt,
    workflow_control,
    workflow_definition,
    workflow_run,
    workflow_signal,
    workflow_timer,
    workflow_transition,
)

#: The columns of each table an export carries (and a restore writes back), in the file's order.
RUN_COLUMNS = (
    "run_id",
    "workflow_id",
    "workflow",
    "version",
    "spec_hash",
    "status",
    "state",
    "input",
    "output",
    "error",
    "record_version",
    "transition_count",
    "parent_run_id",
    "parent_node",
    "continued_from",
    "continued_to",
    "priority",
    "created_at",
    "updated_at",
    "finished_at",
)
DEFINITION_COLUMNS = ("spec_hash", "name", "version", "spec")
#: Not the lease and rate-limit columns: a restored attempt never waits for either.
ATTEMPT_COLUMNS = (
    "token",
    "node",
    "branch",
    "generation",
    "attempt",
    "step",
    "queue",
    "args",
    "timeout",
    "created_at",
    "claimed_at",
    "claimed_by",
    "heartbeat_at",
    "heartbeat_details",
    "cancel_requested_at",
    "finished_at",
    "outcome",
    "output",
    "error",
    "retryable",
    "patch",
    "folded",
    "tags",
)
#: Columns format 1 gained after its first release (additions keep the format): an export
#: written before lacks them, and they read as null (an attempt's ``tags``: none set).
LATER_COLUMNS = frozenset({"tags"})
SIGNAL_COLUMNS = (
    "id",
    "name",
    "payload",
    "idempotency_key",
    "created_at",
    "applied_at",
    "applied_to",
    "applied_version",
)
CONTROL_COLUMNS = (
    "id",
    "kind",
    "reason",
    "requested_by",
    "source",
    "input",
    "has_input",
    "node",
    "spec_hash",
    "created_at",
    "handled_at",
    "result",
)
TRANSITION_COLUMNS = ("seq", "node", "from_status", "to_status", "reason", "at")

#: Columns holding times, by name, across the tables above.
TIME_COLUMNS = frozenset(
    {
        "created_at",
        "updated_at",
        "finished_at",
        "claimed_at",
        "heartbeat_at",
        "cancel_requested_at",
        "applied_at",
        "handled_at",
        "at",
    }
)


@dataclass(frozen=True, slots=True)
class RunRows:
    """Every row of one run, each a dict of the columns above."""

    run: dict[str, Any]
    definition: dict[str, Any]
    attempts: list[dict[str, Any]]
    signals: list[dict[str, Any]]
    controls: list[dict[str, Any]]
    transitions: list[dict[str, Any]]
    timer: datetime | None


def _plain(row: Any, columns: tuple[str, ...]) -> dict[str, Any]:
    mapping = row._mapping
    out: dict[str, Any] = {}
    for name in columns:
        value = mapping[name]
        out[name] = aware(value) if name in TIME_COLUMNS else value
    return out


def _select(table: sa.Table, columns: tuple[str, ...]) -> sa.Select[Any]:
    """The columns by name; a run's state whole (its done nodes given back: an export holds
    whole states, which every version reads)."""
    return sa.select(
        *(
            full_state().label(name) if table is workflow_run and name == "state" else table.c[name]
            for name in columns
        )
    )


def read_rows(engine: Engine, run_id: str) -> RunRows | None:
    """The run's rows (None: no such run), read in one transaction so they agree (on
    PostgreSQL a repeatable-read one: every statement sees the same snapshot, so a tick
    committing meanwhile cannot leave the run row older than its attempts)."""
    options = dialect_of(engine).snapshot_options
    with engine.connect().execution_options(**options) as conn, conn.begin():
        run = conn.execute(
            _select(workflow_run, RUN_COLUMNS).where(workflow_run.c.run_id == run_id)
        ).one_or_none()
        if run is None:
            return None
        definition = conn.execute(
            _select(workflow_definition, DEFINITION_COLUMNS).where(
                workflow_definition.c.spec_hash == run.spec_hash
            )
        ).one()
        # Large values are exported as values (docs/large-values.md): an export stands on
        # its own, and replay and the harness's store hold every value inline.
        return RunRows(
            run=_resolved(conn, [_plain(run, RUN_COLUMNS)], "the run")[0],
            definition=_plain(definition, DEFINITION_COLUMNS),
            attempts=_resolved(conn, _attempts(conn, run_id), "attempt"),
            signals=_resolved(
                conn,
                _all(conn, workflow_signal, SIGNAL_COLUMNS, run_id, workflow_signal.c.id),
                "signal",
            ),
            controls=_resolved(
                conn,
                _all(conn, workflow_control, CONTROL_COLUMNS, run_id, workflow_control.c.id),
                "control",
            ),
            # The whole history, rows and what attempt rows keep alike (store/history.py):
            # an export writes each transition as a row.
            transitions=_all(conn, history.view, TRANSITION_COLUMNS, run_id, history.view.c.seq),
            timer=aware(
                conn.execute(
                    sa.select(workflow_timer.c.fire_at).where(workflow_timer.c.run_id == run_id)
                ).scalar_one_or_none()
            ),
        )


def _resolved(conn: Connection, rows: list[dict[str, Any]], what: str) -> list[dict[str, Any]]:
    """``rows`` with every blob reference in their values replaced by the value (no query for
    rows that hold none)."""
    return [
        {name: blobs.resolved(conn, value, f"{what}'s {name}") for name, value in row.items()}
        for row in rows
    ]


def _attempts(conn: Connection, run_id: str) -> list[dict[str, Any]]:
    # Creation order; a scatter creates many in one commit (one created_at), so then by node,
    # generation and branch, the order the tick created them in.
    c = step_attempt.c
    rows = conn.execute(
        _select(step_attempt, ATTEMPT_COLUMNS)
        .where(c.run_id == run_id)
        .order_by(c.created_at, c.node, c.generation, c.branch, c.token)
    )
    return [_plain(r, ATTEMPT_COLUMNS) for r in rows]


def _all(
    conn: Connection, table: sa.Table, columns: tuple[str, ...], run_id: str, order: Any
) -> list[dict[str, Any]]:
    rows = conn.execute(_select(table, columns).where(table.c.run_id == run_id).order_by(order))
    return [_plain(r, columns) for r in rows]


def restore_rows(engine: Engine, rows: RunRows, source: str) -> None:
    """Insert the run's rows as they were, in one transaction, into a database that does not
    hold the run. Rows the tables refuse (a duplicate token, a NULL where a column needs a
    value: a hand-edited export) are one ``ExportError`` naming ``source``; nothing is
    written. So are tags in the run state that no run could have (docs/tags.md)."""
    problem = tags_problem(_state_tags(rows.run["state"]), "the run state's tags")
    if problem is not None:
        raise ExportError(f"{source} does not load: {problem}")
    try:
        _insert(engine, rows)
    except sa.exc.SQLAlchemyError as exc:
        cause = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        raise ExportError(
            f"{source} does not load: its rows are refused by the database "
            f"({cause[0] if cause else type(exc).__name__})"
        ) from None


def _insert(engine: Engine, rows: RunRows) -> None:
    run_id = rows.run["run_id"]
    workflow_id = rows.run["workflow_id"]
    with engine.begin() as conn:
        exists = conn.execute(
            sa.select(workflow_definition.c.spec_hash).where(
                workflow_definition.c.spec_hash == rows.definition["spec_hash"]
            )
        ).first()
        if exists is None:
            conn.execute(sa.insert(workflow_definition).values(**rows.definition))
        conn.execute(sa.insert(workflow_run).values(**rows.run))
        # The tags' index rows from the run state, which holds the same pairs (docs/tags.md).
        tag_rows = run_tags.tags_insert(run_id, _state_tags(rows.run["state"]))
        if tag_rows is not None:
            conn.execute(tag_rows)
        if rows.attempts:
            conn.execute(sa.insert(step_attempt), [{**a, "run_id": run_id} for a in rows.attempts])
        if rows.signals:
            conn.execute(
                sa.insert(workflow_signal),
                [{**s, "run_id": run_id, "workflow_id": workflow_id} for s in rows.signals],
            )
        if rows.controls:
            conn.execute(
                sa.insert(workflow_control), [{**c, "run_id": run_id} for c in rows.controls]
            )
        if rows.transitions:
            conn.execute(
                sa.insert(workflow_transition),
                [{**t, "run_id": run_id} for t in rows.transitions],
            )
        if rows.timer is not None:
            conn.execute(sa.insert(workflow_timer).values(run_id=run_id, fire_at=rows.timer))


def _state_tags(state: Any) -> dict[str, str]:
    """The tags a stored run state holds (none when it has no ``tags`` key)."""
    tags = state.get("tags") if isinstance(state, dict) else None
    return dict(tags or {})
