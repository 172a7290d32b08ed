"""The client's side of the store: definitions, inserting runs, reading run views.

Clients insert a run's first row and then only read; the coordinator owns every update.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from ..definition.spec import WorkflowSpec
from ..engine.state import RunState
from ..engine.status import OPEN_RUN_STATUSES, RunStatus
from .db import aware
from .schema import step_attempt, workflow_definition, workflow_run, workflow_transition

RUN_COLUMNS = (
    workflow_run.c.run_id,
    workflow_run.c.workflow_id,
    workflow_run.c.workflow,
    workflow_run.c.version,
    workflow_run.c.spec_hash,
    workflow_run.c.status,
    workflow_run.c.state,
    workflow_run.c.input,
    workflow_run.c.output,
    workflow_run.c.error,
    workflow_run.c.record_version,
    workflow_run.c.parent_run_id,
    workflow_run.c.continued_from,
    workflow_run.c.continued_to,
    workflow_run.c.created_at,
    workflow_run.c.finished_at,
)


@dataclass(frozen=True, slots=True)
class RunRow:
    run_id: str
    workflow_id: str
    workflow: str
    version: int
    spec_hash: str
    status: RunStatus
    state: RunState
    input: Any
    output: Any
    error: Any
    record_version: int
    parent_run_id: str | None
    continued_from: str | None
    continued_to: str | None
    created_at: datetime
    finished_at: datetime | None

    @classmethod
    def from_row(cls, row: Any) -> RunRow:
        created = aware(row.created_at)
        assert created is not None
        return cls(
            run_id=row.run_id,
            workflow_id=row.workflow_id,
            workflow=row.workflow,
            version=row.version,
            spec_hash=row.spec_hash,
            status=RunStatus(row.status),
            state=RunState.from_json(row.state),
            input=row.input,
            output=row.output,
            error=row.error,
            record_version=row.record_version,
            parent_run_id=row.parent_run_id,
            continued_from=row.continued_from,
            continued_to=row.continued_to,
            created_at=created,
            finished_at=aware(row.finished_at),
        )


def save_definition(engine: Engine, spec: WorkflowSpec) -> None:
    """Store a spec under its hash; a second save of the same spec is a no-op."""
    with engine.begin() as conn:
        exists = conn.execute(
            sa.select(workflow_definition.c.spec_hash).where(
                workflow_definition.c.spec_hash == spec.spec_hash
            )
        ).first()
        if exists:
            return
        try:
            with conn.begin_nested():
                conn.execute(
                    sa.insert(workflow_definition).values(
                        spec_hash=spec.spec_hash,
                        name=spec.name,
                        version=spec.version,
                        spec=spec.model_dump(mode="json"),
                    )
                )
        except IntegrityError:
            pass  # saved concurrently by another client: same hash, same spec


def load_definition(engine: Engine | Connection, spec_hash: str) -> WorkflowSpec | None:
    query = sa.select(workflow_definition.c.spec).where(
        workflow_definition.c.spec_hash == spec_hash
    )
    if isinstance(engine, Connection):
        spec = engine.execute(query).scalar_one_or_none()
    else:
        with engine.connect() as conn:
            spec = conn.execute(query).scalar_one_or_none()
    return WorkflowSpec.model_validate(spec) if spec is not None else None


def latest_definition(engine: Engine, name: str) -> WorkflowSpec | None:
    with engine.connect() as conn:
        spec = conn.execute(
            sa.select(workflow_definition.c.spec)
            .where(workflow_definition.c.name == name)
            .order_by(workflow_definition.c.version.desc(), workflow_definition.c.created_at.desc())
            .limit(1)
        ).scalar_one_or_none()
    return WorkflowSpec.model_validate(spec) if spec is not None else None


def pending_run(
    *,
    run_id: str,
    workflow_id: str,
    workflow: str,
    version: int,
    spec_hash: str,
    state: RunState,
    input: Any,
    **links: Any,
) -> dict[str, Any]:
    """The values of a new run row (a client's start, a successor, a child): pending, version 0.
    ``links``: parent_run_id, parent_node, continued_from, created_at, updated_at."""
    return {
        "run_id": run_id,
        "workflow_id": workflow_id,
        "workflow": workflow,
        "version": version,
        "spec_hash": spec_hash,
        "status": RunStatus.PENDING.value,
        "state": state.to_json(),
        "input": input,
        "record_version": 0,
        "transition_count": 0,
        **links,
    }


def insert_run(
    engine: Engine,
    *,
    run_id: str,
    workflow_id: str,
    spec: WorkflowSpec,
    input: Any,
    parent_run_id: str | None = None,
) -> tuple[str, bool]:
    """Insert a pending run. Returns (run_id, created); an open run of the same workflow id wins."""
    state = RunState.initial(spec.graph.order)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.insert(workflow_run).values(
                    pending_run(
                        run_id=run_id,
                        workflow_id=workflow_id,
                        workflow=spec.name,
                        version=spec.version,
                        spec_hash=spec.spec_hash,
                        state=state,
                        input=input,
                        parent_run_id=parent_run_id,
                    )
                )
            )
        return run_id, True
    except IntegrityError:
        with engine.connect() as conn:
            ours = run_exists(conn, run_id)
        if ours:
            return run_id, True  # our own insert: it committed, but its answer was lost
        existing = open_run_id(engine, workflow_id)
        if existing is None:
            raise
        return existing, False


def run_exists(conn: Connection, run_id: str) -> bool:
    return (
        conn.execute(
            sa.select(workflow_run.c.run_id).where(workflow_run.c.run_id == run_id)
        ).first()
        is not None
    )


def open_run_id(engine: Engine, workflow_id: str) -> str | None:
    with engine.connect() as conn:
        return conn.execute(
            sa.select(workflow_run.c.run_id).where(
                workflow_run.c.workflow_id == workflow_id,
                workflow_run.c.status.in_([s.value for s in OPEN_RUN_STATUSES]),
            )
        ).scalar_one_or_none()


def find_run(engine: Engine, target: str) -> RunRow | None:
    """A run by run id, else the newest run of that workflow id."""
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(*RUN_COLUMNS).where(workflow_run.c.run_id == target)
        ).one_or_none()
        if row is None:
            row = conn.execute(
                sa.select(*RUN_COLUMNS)
                .where(workflow_run.c.workflow_id == target)
                .order_by(workflow_run.c.created_at.desc(), workflow_run.c.run_id.desc())
                .limit(1)
            ).one_or_none()
    return RunRow.from_row(row) if row is not None else None


def list_runs(
    engine: Engine, *, status: str | None = None, workflow: str | None = None, limit: int = 50
) -> list[RunRow]:
    query = sa.select(*RUN_COLUMNS)
    if status is not None:
        query = query.where(workflow_run.c.status == status)
    if workflow is not None:
        query = query.where(workflow_run.c.workflow == workflow)
    query = query.order_by(workflow_run.c.created_at.desc(), workflow_run.c.run_id.desc())
    with engine.connect() as conn:
        rows = conn.execute(query.limit(limit)).all()
    return [RunRow.from_row(r) for r in rows]


def attempt_outputs(engine: Engine, tokens: list[str]) -> dict[str, Any]:
    if not tokens:
        return {}
    with engine.connect() as conn:
        return dict(
            conn.execute(
                sa.select(step_attempt.c.token, step_attempt.c.output).where(
                    step_attempt.c.token.in_(tokens)
                )
            ).all()
        )


def attempts_of(engine: Engine, run_id: str) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.select(step_attempt)
                .where(step_attempt.c.run_id == run_id)
                .order_by(step_attempt.c.created_at, step_attempt.c.token)
            ).all()
        )


def transitions_of(engine: Engine, run_id: str, limit: int = 200) -> list[Any]:
    """The run's most recent transitions, oldest first."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(workflow_transition)
            .where(workflow_transition.c.run_id == run_id)
            .order_by(workflow_transition.c.seq.desc())
            .limit(limit)
        ).all()
    return list(reversed(rows))
