"""Issue 9, row 2: a bare number round-trips exactly, on the embedded SQLite as on PostgreSQL.

SQLite gives a column declared JSON NUMERIC affinity, which converted ``2**64 + 1`` to a REAL,
``1.0`` to ``1`` and ``-0.0`` to ``0`` before migration 0005 made those columns TEXT.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from ductor_celery import Ductor, RunStatus, StepContext, Workflow

VALUES = [2**64 + 1, -(2**70), 1.0, -0.0, 0.1, 1e16, 1e300, -2.5e20, "1e+16", [1.0, 1e17]]


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/exact.sqlite3"
    url: str = request.getfixturevalue("database_url")
    return url


def _same(a: Any, b: Any, signed_zero: bool) -> bool:
    """Equal and of the same type; with ``signed_zero``, zeros keep their sign too."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and signed_zero:
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y, signed_zero) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_bare_numbers_round_trip_exactly_through_input_output_and_signals(db_url: str) -> None:
    app = Celery(f"exact{id(db_url)}", set_as_current=False)
    d = Ductor(app, database_url=db_url)
    if db_url.startswith("sqlite"):
        d.migrate()
    seen: list[Any] = []
    # jsonb numbers have no negative zero: PostgreSQL gives -0.0 back as 0.0 (still a float,
    # still equal). SQLite keeps the text, sign included.
    signed_zero = db_url.startswith("sqlite")

    def same(a: Any, b: Any) -> bool:
        return _same(a, b, signed_zero)

    @d.step(name="exact.echo")
    def echo(ctx: StepContext, value: Any) -> Any:
        seen.append(value)
        ctx.patch({"value": value})
        return value

    wf = Workflow("exact")
    wf.step("echo", echo, args={"value": "$.input"})
    wf.wait_signal("sig", signal="number", after=["echo"])
    wf.output({"echo": "$.nodes.echo.output", "sig": "$.nodes.sig.output"})
    d.register(wf)

    with d.local_workers():
        for value in VALUES:
            handle = d.start("exact", input=value)
            d.signal(handle.run_id, "number", value)
            view = d.wait(handle.run_id, timeout=30)
            assert view.status == RunStatus.SUCCEEDED, view.error
            assert same(view.input, value), (value, view.input)
            assert same(seen[-1], value), (value, seen[-1])
            assert same(view.context["value"], value), (value, view.context)
            assert same(view.nodes["echo"].output, value), (value, view.nodes["echo"].output)
            assert same(view.nodes["sig"].output, value), (value, view.nodes["sig"].output)
            assert same(view.output["echo"], value) and same(view.output["sig"], value)
