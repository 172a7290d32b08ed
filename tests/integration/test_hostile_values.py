"""Issue 22, item 1 through the real store and tick, on the embedded SQLite as on PostgreSQL:
envelopes that name classes, sent as a run's input, a signal's payload and a step's result,
reach steps, views, the CLI and the console as the plain dicts they were sent as; nothing is
imported; a declared class that refuses its data fails the attempt at once, naming the
argument."""

from __future__ import annotations

import json
import sys
import uuid
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from click.testing import CliRunner
from hostile_json import HOSTILE_MODULES, HOSTILE_PATHS, assert_only_plain_or_declared, hostile_json
from hypothesis import HealthCheck, given, settings
from pydantic import BaseModel, model_validator
from starlette.testclient import TestClient

from ductor_celery import (
    Ductor,
    NodeStatus,
    PayloadNotSerializable,
    RunStatus,
    StepContext,
    Workflow,
    testing,
)
from ductor_celery.cli import ductor as ductor_cli
from ductor_celery.store.schema import workflow_run
from ductor_celery.web import create_app

#: Imported by nothing here; lib2to3.__main__ raises SystemExit when imported.
EXITS = {"__type__": "dataclass", "__value__": {"class": "lib2to3.__main__:X", "fields": {}}}
#: A real class of ductor's own, imported in this process: still never rebuilt from data.
FILTER = {
    "__type__": "dataclass",
    "__value__": {"class": "ductor_celery.store.runs:RunFilter", "fields": {"workflow": "x"}},
}
LIAR = {"__type__": "base64", "__value__": "!!!"}


class Guarded(BaseModel):
    """Declared by a step's annotation; its validator ends the process on a poisoned value."""

    n: int

    @model_validator(mode="after")
    def _refuse(self) -> Guarded:
        if self.n == 13:
            raise SystemExit(3)
        return self


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/hostile.sqlite3"
    url: str = request.getfixturevalue("database_url")
    return url


def _ductor(db_url: str) -> Ductor:
    app = Celery(f"hostile{uuid.uuid4().hex[:6]}", set_as_current=False)
    d = Ductor(app, database_url=db_url)
    if db_url.startswith("sqlite"):
        d.migrate()
    return d


def test_envelopes_from_outside_reach_steps_and_views_as_plain_dicts(db_url: str) -> None:
    assert "lib2to3.__main__" not in sys.modules
    d = _ductor(db_url)
    seen: dict[str, Any] = {}

    @d.step(name="hostile.take")
    def take(ctx: StepContext, value: Any, filt: Any, liar: Any, signalled: Any) -> Any:
        seen.update(value=value, filt=filt, liar=liar, signalled=signalled, input=ctx.input)
        return {"echo": EXITS, "also": FILTER}

    wf = Workflow("hostile")
    wf.wait_signal("sig", signal="go")
    wf.step(
        "take",
        take,
        after=["sig"],
        args={
            "value": "$.input.value",
            "filt": "$.input.filt",
            "liar": "$.input.liar",
            "signalled": "$.nodes.sig.output",
        },
    )
    wf.output({"out": "$.nodes.take.output"})
    d.register(wf)

    sent = {"value": EXITS, "filt": FILTER, "liar": LIAR}
    with d.local_workers():
        handle = d.start("hostile", input=sent)
        d.signal(handle.run_id, "go", {"inner": EXITS})
        view = d.wait(handle.run_id, timeout=30)

    assert view.status == RunStatus.SUCCEEDED, view.error
    assert seen == {
        "value": EXITS,
        "filt": FILTER,
        "liar": LIAR,
        "signalled": {"inner": EXITS},
        "input": sent,
    }
    assert all(type(v) is dict for v in seen.values())
    assert view.input == sent
    assert view.nodes["sig"].output == {"inner": EXITS}
    assert view.output == {"out": {"echo": EXITS, "also": FILTER}}
    assert "lib2to3.__main__" not in sys.modules

    # The CLI shows the run (it exited with another program's usage text before).
    shown = CliRunner().invoke(
        ductor_cli, ["show", handle.run_id, "--json"], obj=SimpleNamespace(app=d.app)
    )
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["input"] == sent
    listed = CliRunner().invoke(ductor_cli, ["runs", "--json"], obj=SimpleNamespace(app=d.app))
    assert listed.exit_code == 0 and handle.run_id in listed.output

    # So does the console (every page answered 500 before).
    with TestClient(create_app(d, allowed_hosts=["testserver"])) as console:
        for path in ("/", f"/runs/{handle.run_id}", f"/runs/{handle.run_id}/panels"):
            assert console.get(path).status_code == 200, path
        assert console.get(f"/api/runs/{handle.run_id}").json()["input"] == sent
    assert "lib2to3.__main__" not in sys.modules


def test_a_declared_class_that_refuses_its_data_fails_the_attempt_once_naming_it(
    db_url: str,
) -> None:
    d = _ductor(db_url)
    calls: list[Any] = []

    @d.step(name="hostile.guarded")
    def guarded(ctx: StepContext, g: Guarded) -> None:
        calls.append(g)

    wf = Workflow("guarded")
    wf.step("guarded", guarded, args={"g": "$.input.g"})
    d.register(wf)
    poisoned = {
        "__type__": "pydantic",
        "__value__": {"class": f"{__name__}:Guarded", "data": {"n": 13}},
    }
    with d.local_workers():
        view = d.wait(d.start("guarded", input={"g": poisoned}).run_id, timeout=30)

    assert view.status == RunStatus.FAILED
    node = view.nodes["guarded"]
    assert node.status == NodeStatus.FAILED and node.attempts == 1 and calls == []
    assert node.error["type"] == "InvalidArgument"
    message = node.error["message"]
    assert "step 'hostile.guarded' parameter 'g'" in message and "SystemExit" in message
    assert view.input == {"g": poisoned}  # the view still shows it, as its JSON


def test_a_decimal_past_the_bounds_is_refused_at_start_and_nothing_is_written(
    db_url: str,
) -> None:
    d = _ductor(db_url)
    wf = Workflow("numbers")
    wf.wait_signal("hold", signal="go")
    d.register(wf)
    for value in (Decimal("1e999999999"), {"__type__": "decimal", "__value__": "1e999999999"}):
        with pytest.raises(PayloadNotSerializable, match=r"exponent 999999999.*at \$\.n"):
            d.start("numbers", input={"n": value})
    with d.runtime.engine().connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(workflow_run)).scalar() == 0


class Declared(BaseModel):
    n: int = 0


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    sent=hostile_json([*HOSTILE_PATHS, f"{__name__}:Declared"]),
    signalled=hostile_json([*HOSTILE_PATHS, f"{__name__}:Declared"]),
)
def test_arbitrary_json_through_a_run_builds_nothing_data_names(sent: Any, signalled: Any) -> None:
    """Start input, signal payload and step output (the step returns what it was handed),
    through the real store and tick (the testing harness, SQLite): every value a step or a view
    gets is plain JSON, a typed scalar or the one declared class, and nothing is imported."""
    _through_a_run(1, 1)  # what a first run imports (SQLite, Celery's fixups) is imported now
    before = set(sys.modules)
    handed, views = _through_a_run(sent, signalled)
    for value in [*handed, *views]:
        assert_only_plain_or_declared(value, (Declared,))
    assert set(sys.modules) == before
    assert not [m for m in HOSTILE_MODULES if m in sys.modules]


def _through_a_run(sent: Any, signalled: Any) -> tuple[list[Any], list[Any]]:
    """What the step was handed, and what the views show, of a run started with ``sent`` and
    signalled ``signalled`` (nothing when the door refuses either)."""
    d = Ductor(Celery(f"prop{uuid.uuid4().hex[:6]}", set_as_current=False))
    d.register_type(Declared)
    handed: list[Any] = []

    @d.step(name="hostile.echo")
    def echo(ctx: StepContext, value: Any, signalled: Any) -> Any:
        handed.extend([value, signalled, ctx.input, dict(ctx.context)])
        return {"value": value, "signalled": signalled}

    wf = Workflow("echo")
    wf.wait_signal("sig", signal="go")
    wf.step(
        "echo", echo, after=["sig"], args={"value": "$.input", "signalled": "$.nodes.sig.output"}
    )
    wf.output("$.nodes.echo.output")
    d.register(wf)

    with testing.harness(d) as h:
        try:
            handle = h.start("echo", input=sent)
        except PayloadNotSerializable:
            return [], []  # a Decimal past the bounds, refused at the door
        try:
            h.signal(handle.run_id, "go", signalled)
        except PayloadNotSerializable:
            return [], []
        view = h.run(handle)

    if view.status == RunStatus.FAILED:
        # Only a declared class whose data does not rebuild it (a refused argument, no retry).
        assert view.nodes["echo"].error["type"] == "InvalidArgument", view.nodes["echo"].error
        assert view.nodes["echo"].attempts == 1
    else:
        assert view.status == RunStatus.SUCCEEDED, view.error
    return handed, [view.input, view.output, view.context, view.nodes["sig"].output]
