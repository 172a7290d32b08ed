"""A start stores its definition once per process (``runs.save_definition`` remembers what it
found stored): later starts send no statement for it, and one deleted by hand meanwhile is
stored again by the start that finds it gone (the run row's foreign key), not lost."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
from celery import Celery
from support import record_psycopg_statements

from ductor_celery import Ductor, Workflow
from ductor_celery.store.db import get_engine
from ductor_celery.store.schema import workflow_definition, workflow_run


@pytest.fixture
def ductor(database_url: str, tmp_path: Path) -> Ductor:
    app = Celery(f"defs{tmp_path.name}", set_as_current=False)
    app.conf.broker_url = "memory://"
    d = Ductor(app, database_url=database_url)
    d.runtime.dispatcher.first_tick = lambda run_id: None  # type: ignore[method-assign]
    d.runtime.dispatcher.wake = lambda run_id: None  # type: ignore[method-assign]
    d.step(name="defs.noop")(lambda ctx: None)
    wf = Workflow("defs")
    wf.step("a", "defs.noop")
    d.register(wf)
    kid = Workflow("defs_kid")
    kid.step("k", "defs.noop")
    d.register(kid)
    parent = Workflow("defs_parent")
    parent.subworkflow("sub", workflow="defs_kid")
    d.register(parent)
    return d


@pytest.fixture
def statements(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Every statement psycopg sends from now on."""
    return record_psycopg_statements(monkeypatch)


def _definition_statements(sent: list[tuple[str, bool]]) -> list[str]:
    return [s for s, _ in sent if "eec_workflow_definition" in s]


def test_a_second_start_sends_nothing_for_its_definition(
    ductor: Ductor, statements: list[str]
) -> None:
    ductor.start("defs")
    assert _definition_statements(statements), "the first start stores or finds it"
    statements.clear()
    for _ in range(3):
        ductor.start("defs")
    assert _definition_statements(statements) == []
    assert sum("INSERT INTO eec_workflow_run" in s for s, _ in statements) == 3


def test_a_definition_deleted_by_hand_is_stored_again_by_the_next_start(
    ductor: Ductor, database_url: str
) -> None:
    first = ductor.start("defs").run_id
    engine = get_engine(database_url)
    with engine.begin() as conn:
        conn.execute(sa.delete(workflow_run).where(workflow_run.c.run_id == first))
        deleted = conn.execute(
            sa.delete(workflow_definition).where(workflow_definition.c.name == "defs")
        ).rowcount
    assert deleted == 1

    run_id = ductor.start("defs").run_id

    with engine.connect() as conn:
        stored = conn.execute(
            sa.select(workflow_definition.c.spec_hash).where(workflow_definition.c.name == "defs")
        ).scalar_one()
        pinned = conn.execute(
            sa.select(workflow_run.c.spec_hash).where(workflow_run.c.run_id == run_id)
        ).scalar_one()
    assert pinned == stored
    assert ductor.get(run_id).status == "pending"


def test_the_definitions_a_run_s_children_pin_are_looked_up_at_every_start(
    ductor: Ductor, database_url: str, statements: list[str]
) -> None:
    """Only a run's own definition is remembered (its insert's foreign key would find it
    gone): one its children pin, deleted by hand, is stored again by the next start."""
    ductor.start("defs_parent")
    engine = get_engine(database_url)
    with engine.begin() as conn:
        conn.execute(sa.delete(workflow_definition).where(workflow_definition.c.name == "defs_kid"))
    statements.clear()

    ductor.start("defs_parent")

    assert len(_definition_statements(statements)) >= 2, "the child's looked up and stored"
    with engine.connect() as conn:
        stored = conn.execute(
            sa.select(sa.func.count()).where(workflow_definition.c.name == "defs_kid")
        ).scalar_one()
    assert stored == 1
