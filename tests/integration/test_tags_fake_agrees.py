"""The shipped in-memory store agrees with the SQL store on run tags (docs/tags.md): the same
start tags, the same step tags written with an outcome (one attempt failing, one succeeding,
one past the 20-tag limit), the same continue-as-new, driven through the production tick loop
over each store; afterwards the run states and every ``eec_run_tag`` row are compared."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from support import sql_coordinator

from ductor_celery.coordinator import Coordinator
from ductor_celery.definition import RetryPolicy, Workflow
from ductor_celery.engine import EngineConfig
from ductor_celery.engine.kinds import ControlKind, DispatchKind
from ductor_celery.fakes import InMemoryStore, RecordingDispatcher
from ductor_celery.store import attempts, external, runs
from ductor_celery.store.db import get_engine
from ductor_celery.store.migrate import upgrade
from ductor_celery.store.schema import run_tag, workflow_run

CONFIG = EngineConfig(resend_unclaimed_after=30.0, default_step_timeout=300.0, cancel_grace=0)
SPEC = (
    Workflow("agree_tags")
    .step("a", "s.a", retry=RetryPolicy(max_attempts=2, initial_interval=0))
    .step("b", "s.b", after=["a"])
    .wait_signal("hold", signal="go", after=["b"])
    .build()
)
START_TAGS = {f"s{i:02}": "v" for i in range(18)}


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/agree.sqlite3"
        upgrade(url)
        return url
    found: str = request.getfixturevalue("database_url")
    return found


class _Fake:
    def __init__(self) -> None:
        self.store = InMemoryStore(config=CONFIG)
        self.store.add_definition(SPEC)
        self.sent = RecordingDispatcher(self.store)
        self.coordinator: Coordinator[Any] = Coordinator(self.store, self.sent)

    def start(self, run_id: str) -> None:
        self.store.start(SPEC, {}, run_id=run_id, tags=START_TAGS)

    def finish(self, token: str, error: Any, tags: dict[str, str]) -> None:
        assert self.store.claim(token, "w")
        assert self.store.finish(token, output=1, error=error, tags=_pairs(tags))

    def continue_as_new(self, run_id: str) -> None:
        self.store.control(run_id, ControlKind.CONTINUE_AS_NEW, reason="test")

    def rows(self) -> tuple[Any, Any]:
        t = self.store.tables
        states = sorted((r.run_id, r.status, r.state.get("tags")) for r in t.runs.values())
        tags = sorted((run, k, v) for run, pairs in t.tags.items() for k, v in pairs.items())
        return states, tags


class _Sql:
    def __init__(self, url: str) -> None:
        self.engine = get_engine(url)
        runs.save_definition(self.engine, SPEC)
        self.coordinator, self.sent = sql_coordinator(
            self.engine, {SPEC.spec_hash: SPEC}.__getitem__, CONFIG
        )

    def start(self, run_id: str) -> None:
        runs.insert_run(
            self.engine, run_id=run_id, workflow_id=run_id, spec=SPEC, input={}, tags=START_TAGS
        )

    def finish(self, token: str, error: Any, tags: dict[str, str]) -> None:
        assert attempts.claim(self.engine, token, "w") is not None
        outcome = "failed" if error is not None else "succeeded"
        written, _ = attempts.finish(
            self.engine, token, outcome=outcome, output=1, error=error, tags=_pairs(tags)
        )
        assert written

    def continue_as_new(self, run_id: str) -> None:
        external.insert_control(
            self.engine, run_id=run_id, kind=ControlKind.CONTINUE_AS_NEW, reason="test"
        )

    def rows(self) -> tuple[Any, Any]:
        with self.engine.connect() as conn:
            r = workflow_run.c
            found = conn.execute(sa.select(r.run_id, r.status, r.state)).all()
            states = sorted((run_id, status, state.get("tags")) for run_id, status, state in found)
            tags = sorted(tuple(row) for row in conn.execute(sa.select(run_tag)).all())
        return states, tags


def _pairs(tags: dict[str, str]) -> list[list[str]]:
    """As a worker writes them (``ctx.tags_value``): in the order they were set."""
    return [[k, v] for k, v in tags.items()]


def _steps(world: Any) -> list[str]:
    return [r.payload["token"] for r in world.sent.sent if r.kind == DispatchKind.STEP]


def test_tags_written_by_start_ticks_and_a_successor_agree(db_url: str) -> None:
    worlds: list[Any] = [_Fake(), _Sql(db_url)]
    for world in worlds:
        world.start("agree-t")
        world.coordinator.tick("agree-t")
        # Attempt 1 of a fails: its tags are dropped; attempt 2 succeeds: its tags apply.
        world.finish(_steps(world)[-1], {"type": "E", "message": "no"}, {"lost": "yes"})
        world.coordinator.tick("agree-t")
        world.coordinator.tick("agree-t")  # the retry, due at once
        world.finish(_steps(world)[-1], None, {"s00": "changed", "kept": "yes"})
        world.coordinator.tick("agree-t")
        # b sets two new keys where one fits (18 + kept = 19): the first it set, though jsonb
        # would order "zz-first" after "a-second" in an object.
        world.finish(_steps(world)[-1], None, {"zz-first": "fits", "a-second": "dropped"})
        world.coordinator.tick("agree-t")
        world.continue_as_new("agree-t")
        world.coordinator.tick("agree-t")
    fake, sql = (w.rows() for w in worlds)
    assert fake == sql
    states, tags = sql
    expected = {**START_TAGS, "s00": "changed", "kept": "yes", "zz-first": "fits"}
    assert [s[2] for s in states] == [expected, expected]  # the run and its successor
    assert len(tags) == 2 * 20
