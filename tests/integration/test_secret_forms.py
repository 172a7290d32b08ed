"""Issue 22, item 8, through real workers and the real store (SQLite and PostgreSQL): a
bad secret name fails the attempt once, naming the problem, and is refused at register."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from ductor_celery import (
    DefinitionError,
    Ductor,
    NodeStatus,
    RetryPolicy,
    RunStatus,
    StepContext,
    Workflow,
)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/secrets.sqlite3"
    url: str = request.getfixturevalue("database_url")
    return url


def _ductor(db_url: str, **conf: Any) -> Ductor:
    app = Celery(f"secrets{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(conf)
    d = Ductor(app, database_url=db_url)
    if db_url.startswith("sqlite"):
        d.migrate()
    return d


@pytest.mark.parametrize(
    "name",
    ["", "ß", "\ud800", "a-b", "x" * 101],
    ids=["empty", "sharp-s", "surrogate", "dash", "101-chars"],
)
def test_a_bad_secret_name_fails_the_attempt_once_naming_the_problem(
    db_url: str, name: str
) -> None:
    asked: list[str] = []

    def provider(n: str) -> str:
        asked.append(n)
        return "never-returned-value"

    d = _ductor(db_url, ductor_secret_provider=provider)

    @d.step(name="secrets.bad_name")
    def bad_name(ctx: StepContext) -> str:
        return ctx.secret(name)

    wf = Workflow("bad_name")
    wf.step("bad", bad_name, retry=RetryPolicy(max_attempts=3, initial_interval=0.01))
    d.register(wf)
    with d.local_workers():
        view = d.wait(d.start("bad_name").run_id, timeout=30)
    node = view.nodes["bad"]
    assert view.status == RunStatus.FAILED and node.status == NodeStatus.FAILED
    assert node.attempts == 1 and asked == []
    assert "secret name" in node.error["message"]
    assert "never-returned-value" not in json.dumps(node.error)


def test_a_bad_secret_name_in_a_definition_is_refused_at_register(db_url: str) -> None:
    d = _ductor(db_url)

    @d.step(name="secrets.uses")
    def uses(ctx: StepContext, key: str) -> None:
        pass

    wf = Workflow("bad_ref")
    wf.step("uses", uses, args={"key": "$.secret.ß"})
    with pytest.raises(DefinitionError, match="secret name 'ß'"):
        d.register(wf)
