"""Dispatch and control kinds are enums in the code and the same plain strings in the database;
a row holding a kind this version does not know (written by a newer ductor) is logged or
rejected, never a crash."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from support import tick_once

from ductor_celery.definition import Workflow
from ductor_celery.engine.kinds import ControlKind, DispatchKind, rejection_of
from ductor_celery.store import external, runs, sweep
from ductor_celery.store.db import get_engine
from ductor_celery.store.outbox import OutboxRow


@pytest.fixture
def engine(database_url: str) -> Any:
    return get_engine(database_url)


def _start(engine: Any, run_id: str = "r1") -> Any:
    wf = Workflow("one")
    wf.step("a", "s.a")
    spec = wf.build()
    runs.save_definition(engine, spec)
    runs.insert_run(engine, run_id=run_id, workflow_id=run_id, spec=spec, input=None)
    return spec


def test_kinds_are_written_as_their_strings_and_read_back_as_members(engine: Any) -> None:
    spec = _start(engine)
    [step] = tick_once(engine, "r1", lambda _h: spec)
    assert step.kind is DispatchKind.STEP
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT kind FROM eec_workflow_outbox")).scalars().all() == [
            "step"
        ]
    sent: list[OutboxRow] = []
    assert sweep.relay_stale_outbox(engine, sent.extend, older_than=0) == 1
    assert [r.kind for r in sent] == [DispatchKind.STEP]
    assert isinstance(sent[0].kind, DispatchKind)

    external.insert_control(engine, run_id="r1", kind=ControlKind.CANCEL, reason="test")
    with engine.connect() as conn:
        stored = conn.execute(sa.text("SELECT kind FROM eec_workflow_control")).scalar_one()
    assert type(stored) is str and stored == "cancel"


def test_an_outbox_row_of_an_unknown_kind_is_relayed_as_its_text(engine: Any) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO eec_workflow_outbox (run_id, kind, task, payload, created_at) "
                "VALUES ('r9', 'teleport', 'x', '{}', now())"
            )
        )
    sent: list[OutboxRow] = []
    assert sweep.relay_stale_outbox(engine, sent.extend, older_than=0) == 1
    [row] = sent
    assert row.kind == "teleport" and not isinstance(row.kind, DispatchKind)


def test_a_control_of_an_unknown_kind_is_rejected_by_name(engine: Any) -> None:
    spec = _start(engine)
    tick_once(engine, "r1", lambda _h: spec)
    external.insert_control(engine, run_id="r1", kind="explode")  # type: ignore[arg-type]
    tick_once(engine, "r1", lambda _h: spec)
    with engine.connect() as conn:
        result = conn.execute(sa.text("SELECT result FROM eec_workflow_control")).scalar_one()
    assert rejection_of(result) == "unknown control 'explode'"
    row = runs.find_run(engine, "r1")
    assert row is not None and row.status == "running"
