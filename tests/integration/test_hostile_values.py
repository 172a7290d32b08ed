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
from pydantic import BaseModel, model_validator

from ductor_celery import (
    Ductor,
    NodeStatus,
    PayloadNotSerializable,
    RunStatus,
    StepContext,
    Workflow,
)
from ductor_celery.cli import ductor as ductor_cli
from ductor_celery.store.schema import workflow_run

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
