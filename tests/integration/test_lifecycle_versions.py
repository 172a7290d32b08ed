"""Issue 14 items 6-8 through the real store and step task (``local_workers``), on the
embedded SQLite and on PostgreSQL: pause on exhaustion and resume, rerun from a node,
versions."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from ductor_celery import Ductor, NodeStatus, RetryPolicy, RunStatus, StepContext, Workflow


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/lifecycle.sqlite3"
    url: str = request.getfixturevalue("database_url")
    return url


def _ductor(url: str) -> Ductor:
    d = Ductor(Celery(f"lifecycle{time.monotonic_ns()}", set_as_current=False), database_url=url)
    if url.startswith("sqlite"):
        d.migrate()
    return d


def _until(d: Ductor, run_id: str, status: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while (view := d.get(run_id)).status != status:
        assert time.monotonic() < deadline, f"run is {view.status}, not {status}"
        time.sleep(0.05)
    return view


class _Shop:
    """reserve -> charge -> ship, with a bug in charge that the test can fix."""

    def __init__(self, url: str, on_exhausted: Any = "fail") -> None:
        self.d = _ductor(url)
        self.calls: dict[str, int] = {}
        self.bug = False

        def count(ctx: StepContext) -> None:
            self.calls[ctx.node] = self.calls.get(ctx.node, 0) + 1

        @self.d.step(name="shop.reserve")
        def reserve(ctx: StepContext, order: Any) -> dict[str, Any]:
            count(ctx)
            return {"reserved": order}

        @self.d.step(
            name="shop.charge",
            retry=RetryPolicy(max_attempts=2, initial_interval=0.01, on_exhausted=on_exhausted),
        )
        def charge(ctx: StepContext, total: int) -> dict[str, Any]:
            count(ctx)
            if self.bug:
                raise RuntimeError("charge bug")
            return {"charged": total}

        @self.d.step(name="shop.ship")
        def ship(ctx: StepContext, charged: Any) -> Any:
            count(ctx)
            return {"shipped": charged}

        wf = Workflow("shop")
        wf.step("reserve", reserve, args={"order": "$.input.id"})
        wf.step("charge", charge, after=["reserve"], args={"total": "$.input.total"})
        wf.step("ship", ship, after=["charge"], args={"charged": "$.nodes.charge.output"})
        wf.output({"ship": "$.nodes.ship.output", "reserve": "$.nodes.reserve.output"})
        self.d.register(wf)


def test_pause_on_exhaustion_then_resume_after_the_fix(db_url: str) -> None:
    shop = _Shop(db_url, on_exhausted="pause")
    shop.bug = True
    with shop.d.local_workers():
        handle = shop.d.start("shop", input={"id": 7, "total": 30})
        view = _until(shop.d, handle.run_id, RunStatus.PAUSED)
        assert view.nodes["charge"].status == NodeStatus.FAILED
        assert view.nodes["charge"].error["message"] == "charge bug"
        assert view.nodes["ship"].status == NodeStatus.PENDING
        assert shop.calls == {"reserve": 1, "charge": 2}
        shop.bug = False  # the fix is deployed
        shop.d.resume(handle.run_id)
        done = shop.d.wait(handle.run_id, timeout=30)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert done.output == {"ship": {"shipped": {"charged": 30}}, "reserve": {"reserved": 7}}
    assert shop.calls == {"reserve": 1, "charge": 3, "ship": 1}
    reasons = [t.reason for t in shop.d.client.history(handle.run_id)[1]]
    assert any("on_exhausted='pause'" in r for r in reasons)
    assert "resume: fresh retry budget" in reasons
