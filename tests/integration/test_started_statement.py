"""A start's run row and audit entry, written by the statement compiled once per set of
columns and sent to psycopg's cursor (``runs._insert_started``), are the rows SQLAlchemy's
own INSERT writes for the same values; its key conflicts are SQLAlchemy's
``IntegrityError`` (PostgreSQL)."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from support import FakeStep

from ductor_celery.definition import Workflow
from ductor_celery.definition.spec import WorkflowSpec
from ductor_celery.store import audit, runs
from ductor_celery.store.db import autocommit, get_engine
from ductor_celery.store.schema import audit as audit_table
from ductor_celery.store.schema import workflow_run

VALUES: list[Any] = [
    None,
    {},
    {"value": 0},
    {"n": 2**70, "f": 1e16, "small": 1.5e-7, "neg": -0.0, "text": "é ☃ \u2028", "list": [1, None]},
    "a plain string",
    [1, 2, 3],
]


def saved_spec(engine: sa.engine.Engine) -> WorkflowSpec:
    workflow = Workflow("started")
    workflow.step("a", FakeStep())
    spec = workflow.build()
    runs.save_definition(engine, spec)
    return spec


def _rows(engine: sa.engine.Engine, run_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    with engine.connect() as conn:
        run = dict(
            conn.execute(sa.select(workflow_run).where(workflow_run.c.run_id == run_id))
            .mappings()
            .one()
        )
        entry = dict(
            conn.execute(sa.select(audit_table).where(audit_table.c.run_id == run_id))
            .mappings()
            .one()
        )
    for row in (run, entry):
        for column in ("run_id", "workflow_id", "created_at", "updated_at", "at", "id"):
            row.pop(column, None)
    return run, entry


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_the_rows_are_sqlalchemys_for_the_same_values(database_url: str, value: Any) -> None:
    engine = get_engine(database_url)
    spec = saved_spec(engine)
    who = audit.Who(actor="alice", source=audit.AuditSource.API)
    written = {}
    for path, run_id in (("driver", "r-driver"), ("sqlalchemy", "r-sqlalchemy")):
        row = runs.started_run_values(
            run_id=run_id, workflow_id=run_id, spec=spec, input=value, trace_context="00-x"
        )
        entry = runs.start_values(who, run_id, run_id, spec)
        with autocommit(engine) as conn:
            if path == "driver":
                runs._insert_started(conn, row, entry)
            else:
                conn.execute(
                    sa.insert(audit_table)
                    .values(entry)
                    .add_cte(sa.insert(workflow_run).values(row).cte("started_run"))
                )
        written[path] = _rows(engine, run_id)
    assert written["driver"] == written["sqlalchemy"]
    # JSON null, not SQL NULL, for a None input, on both paths alike.
    with engine.connect() as conn:
        kinds = conn.execute(
            sa.text(
                "SELECT run_id, jsonb_typeof(input) FROM eec_workflow_run"
                " WHERE run_id IN ('r-driver', 'r-sqlalchemy')"
            )
        ).all()
    assert len({kind for _, kind in kinds}) == 1 and None not in {kind for _, kind in kinds}
    run, entry = written["driver"]
    assert run["input"] == value and run["status"] == "pending"
    assert entry["actor"] == "alice" and entry["detail"]["workflow"] == spec.name


def test_a_key_conflict_is_sqlalchemys_integrity_error(database_url: str) -> None:
    engine = get_engine(database_url)
    spec = saved_spec(engine)
    who = audit.Who()
    row = runs.started_run_values(run_id="r-1", workflow_id="wf", spec=spec, input=None)
    entry = runs.start_values(who, "r-1", "wf", spec)
    with autocommit(engine) as conn:
        runs._insert_started(conn, row, entry)
    with pytest.raises(sa.exc.IntegrityError) as raised, autocommit(engine) as conn:
        runs._insert_started(conn, row, entry)
    assert raised.value.orig.diag.constraint_name == "eec_workflow_run_pkey"
    # Nothing of the failed statement was written: one run, one entry.
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(workflow_run)).scalar() == 1
        assert conn.execute(sa.select(sa.func.count()).select_from(audit_table)).scalar() == 1
