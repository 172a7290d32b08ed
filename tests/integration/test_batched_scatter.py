"""Batched scatter through the real store and the real step task (``local_workers``), on the
embedded SQLite and on PostgreSQL: order, a failing item retried alone, tolerances counted in
items, context patches, and the attempt rows a batch leaves."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from ductor_celery import Ductor, NonRetryableError, RetryPolicy, RunStatus, StepContext, Workflow
from ductor_celery.store.schema import step_attempt


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/batch.sqlite3"
    url: str = request.getfixturevalue("database_url")
    return url


class _App:
    """A Ductor with one batched scatter workflow; ``calls`` counts (item, attempt)."""

    def __init__(self, url: str, *, batch_size: int, **scatter: Any) -> None:
        self.d = Ductor(Celery(f"batch{id(self)}", set_as_current=False), database_url=url)
        if url.startswith("sqlite"):
            self.d.migrate()
        self.calls: Counter[tuple[int, int]] = Counter()
        self.flaky: set[int] = set()  # fail on their first attempt
        self.broken: set[int] = set()  # fail for good
        lock = threading.Lock()

        @self.d.step(name="batch.score", retry=RetryPolicy(max_attempts=3, initial_interval=0.05))
        def score(ctx: StepContext, item: int, scale: int) -> dict[str, int]:
            with lock:
                self.calls[(item, ctx.attempt)] += 1
            assert ctx.branch == item  # each item's own context: its index in the scatter
            if item in self.broken:
                raise NonRetryableError(f"item {item} is broken")
            if item in self.flaky and ctx.attempt == 1:
                raise RuntimeError(f"item {item} flaked")
            ctx.patch({f"seen_{item}": ctx.attempt})
            return {"item": item, "score": item * scale}

        wf = Workflow("batched")
        wf.scatter(
            "score",
            score,
            over="$.input.items",
            item_arg="item",
            args={"scale": "$.input.scale"},
            batch_size=batch_size,
            **scatter,
        )
        wf.output("$.nodes.score.output")
        self.d.register(wf)

    def run(self, n: int) -> Any:
        with self.d.local_workers():
            handle = self.d.start("batched", input={"items": list(range(n)), "scale": 3})
            view = self.d.wait(handle.run_id, timeout=60)
        return handle, view

    def attempt_rows(self, run_id: str) -> list[Any]:
        with self.d.client.engine.connect() as conn:
            return list(
                conn.execute(
                    sa.select(step_attempt)
                    .where(step_attempt.c.run_id == run_id)
                    .order_by(step_attempt.c.generation)
                )
            )


def test_a_batched_scatter_gathers_every_item_in_order_one_attempt_per_batch(db_url: str) -> None:
    app = _App(db_url, batch_size=10, max_parallel=3)
    handle, view = app.run(95)
    assert view.status == RunStatus.SUCCEEDED, view.error
    assert view.output == [{"item": i, "score": 3 * i} for i in range(95)]
    assert app.calls == Counter({(i, 1): 1 for i in range(95)})
    rows = app.attempt_rows(handle.run_id)
    assert len(rows) == 10  # 9 batches of 10 and one of 5
    assert sorted(r.branch for r in rows) == list(range(10))
    assert all(r.outcome == "succeeded" and r.folded for r in rows)
    assert view.context == {f"seen_{i}": 1 for i in range(95)}
    assert view.nodes["score"].attempts == 10


def test_a_failing_item_is_retried_alone_and_keeps_its_place(db_url: str) -> None:
    app = _App(db_url, batch_size=5)
    app.flaky = {3, 7}
    handle, view = app.run(12)
    assert view.status == RunStatus.SUCCEEDED, view.error
    assert view.output == [{"item": i, "score": 3 * i} for i in range(12)]
    expected = {(i, 1): 1 for i in range(12)}
    expected.update({(3, 2): 1, (7, 2): 1})
    assert app.calls == Counter(expected)
    retries = [r for r in app.attempt_rows(handle.run_id) if r.attempt == 2]
    assert sorted(r.branch for r in retries) == [0, 1]
    first = [r for r in app.attempt_rows(handle.run_id) if r.attempt == 1 and r.branch == 0][0]
    assert first.outcome == "failed"
    assert first.output["done"] == {str(i): {"item": i, "score": 3 * i} for i in (0, 1, 2, 4)}
    assert view.context[f"seen_{3}"] == 2 and view.context["seen_0"] == 1


def test_tolerances_count_items_and_a_broken_item_is_not_retried(db_url: str) -> None:
    app = _App(db_url, batch_size=4, tolerated_failures=2)
    app.broken = {1, 6}
    app.flaky = {2}
    _, view = app.run(8)
    assert view.status == RunStatus.SUCCEEDED, view.error
    for i, part in enumerate(view.output):
        if i in app.broken:
            assert part["error"]["type"] == "NonRetryableError"
            assert f"item {i} is broken" in part["error"]["message"]
        else:
            assert part == {"item": i, "score": 3 * i}
    assert app.calls[(1, 1)] == 1 and app.calls[(1, 2)] == 0  # broken: never again
    assert app.calls[(2, 2)] == 1 and app.calls[(0, 2)] == 0  # flaky neighbour retried alone
    # The batch holding item 6 gave up with its other items done: their patches still apply.
    assert {"seen_4", "seen_5", "seen_7"} <= set(view.context)


def test_one_item_over_the_tolerance_fails_the_scatter_naming_the_batch(db_url: str) -> None:
    app = _App(db_url, batch_size=4, tolerated_failures=1)
    app.broken = {1, 6}
    _, view = app.run(8)
    assert view.status == RunStatus.FAILED
    error = view.nodes["score"].error
    assert error["type"] == "BranchFailed"
    assert "batch" in error["message"] and "items failed" in error["message"]
