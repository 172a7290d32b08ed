"""Client writes of external input against PostgreSQL, without workers."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from support import tick_once

from ductor_celery import InvalidOperation
from ductor_celery.client import Client
from ductor_celery.definition import Workflow
from ductor_celery.engine import NodeStatus, RunStatus
from ductor_celery.settings import Settings
from ductor_celery.store import external, runs
from ductor_celery.store.db import get_engine


def _spec() -> Any:
    wf = Workflow("review")
    wf.approval("ok")
    wf.wait_signal("go", signal="go", after=["ok"])
    return wf.build()


@pytest.fixture
def setup(database_url: str) -> tuple[Client, Any, Any, list[str]]:
    spec = _spec()
    woken: list[str] = []
    client = Client(
        Settings(database_url=database_url),
        wake=woken.append,
        find_spec=lambda name: spec if name == spec.name else None,
    )
    return client, get_engine(database_url), spec, woken


def _tick(engine: Any, spec: Any, run_id: str) -> None:
    tick_once(engine, run_id, lambda _h: spec)


def test_two_decisions_for_one_wait_the_second_is_refused(setup: Any) -> None:
    client, engine, spec, _ = setup
    handle = client.start("review", workflow_id="rev-1")
    _tick(engine, spec, handle.run_id)
    assert runs.find_run(engine, handle.run_id).state.nodes["ok"].status == NodeStatus.WAITING
    client.decide("rev-1", "ok", approved=True, by="alice", comment=None)
    with pytest.raises(InvalidOperation):
        client.decide("rev-1", "ok", approved=False, by="bob", comment=None)
    with engine.connect() as conn:
        count = conn.execute(
            sa.text("SELECT count(*) FROM eec_workflow_signal WHERE run_id = :r"),
            {"r": handle.run_id},
        ).scalar_one()
    assert count == 1


def test_a_signal_to_a_continued_run_goes_to_its_successor(setup: Any) -> None:
    client, engine, spec, woken = setup
    handle = client.start("review", workflow_id="rev-2")
    _tick(engine, spec, handle.run_id)
    external.insert_signal(
        engine,
        run_id=handle.run_id,
        workflow_id="rev-2",
        name="go",
        payload=1,
        idempotency_key="early",
    )
    client.control(handle.run_id, "continue_as_new")
    _tick(engine, spec, handle.run_id)
    old = runs.find_run(engine, handle.run_id)
    assert old is not None and old.status == RunStatus.CONTINUED and old.continued_to
    with engine.connect() as conn:
        moved = conn.execute(
            sa.text("SELECT run_id FROM eec_workflow_signal WHERE idempotency_key = 'early'")
        ).scalar_one()
    assert moved == old.continued_to  # the unapplied signal was handed over
    # A client that still holds the old run id: the signal follows the chain.
    signal_id, created, target = external.insert_signal(
        engine,
        run_id=handle.run_id,
        workflow_id="rev-2",
        name="go",
        payload=2,
        idempotency_key=None,
    )
    assert created and target == old.continued_to
    woken.clear()
    client.signal(handle.run_id, "go", 3)
    assert woken == [old.continued_to]


def test_a_finished_run_refuses_signals_inside_the_insert(setup: Any) -> None:
    client, engine, spec, _ = setup
    handle = client.start("review")
    client.control(handle.run_id, "cancel")
    _tick(engine, spec, handle.run_id)
    with pytest.raises(InvalidOperation, match="cancelled"):
        external.insert_signal(
            engine,
            run_id=handle.run_id,
            workflow_id=handle.workflow_id,
            name="go",
            payload=None,
            idempotency_key=None,
        )
