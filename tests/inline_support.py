"""What the inline-step tests share: a Ductor whose dispatcher records what it would publish,
and the first message of a run played by hand (``tests/integration/test_inline_steps.py``,
``test_held_branches.py``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from ductor_celery import Ductor, StepContext
from ductor_celery.definition import Workflow
from ductor_celery.runtime.dispatch import (
    Dispatcher,
    QuickBranches,
    carried_branches,
    held_header,
)
from ductor_celery.runtime.outbox_janitor import sent_outbox
from ductor_celery.runtime.steps import execute_attempt
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store.outbox import OutboxRow
from ductor_celery.store.schema import step_attempt, workflow_outbox, workflow_run

QUEUE = "ductor-steps"


@pytest.fixture(params=["postgresql", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database of each kind (a test module imports this fixture to use it)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'inline.sqlite3'}"
    return str(request.getfixturevalue("database_url"))


class RecordingDispatcher(Dispatcher):
    """What would have been published, instead of publishing it."""

    def __init__(self) -> None:
        self.rows: list[OutboxRow] = []
        #: The rows of each ``send`` (a tick's, or a hand-back), in order.
        self.sends: list[list[OutboxRow]] = []
        self.wakes: list[str] = []
        #: Runs just started, sent to the step workers for their first tick.
        self.first_ticks: list[str] = []
        #: Wake-ups sent with a hint of quick branches (``dispatch.QUICK_HEADER``).
        self.quick_wakes: list[tuple[str, QuickBranches]] = []

    def send(self, rows: list[OutboxRow]) -> None:
        self.rows.extend(rows)
        self.sends.append(list(rows))

    def wake(self, run_id: str, quick: QuickBranches | None = None) -> None:
        self.wakes.append(run_id)
        if quick is not None:
            self.quick_wakes.append((run_id, quick))

    def wake_many(self, run_ids: list[str]) -> None:
        self.wakes.extend(run_ids)

    def first_tick(self, run_id: str) -> None:
        self.first_ticks.append(run_id)

    def steps(self) -> list[str]:
        return [r.payload["node"] for r in self.rows if r.kind == "step"]


def make_ductor(url: str, **conf: Any) -> tuple[Ductor, RecordingDispatcher]:
    app = Celery("inline_steps", broker="memory://")
    app.conf.update({f"ductor_{k}": v for k, v in conf.items()})
    ductor = Ductor(app, database_url=url)
    recorder = RecordingDispatcher()
    ductor.runtime.dispatcher = recorder
    return ductor, recorder


def start_run(
    ductor: Ductor, workflow: str, recorder: RecordingDispatcher
) -> tuple[str, OutboxRow]:
    """Start a run and tick it on the coordinator's side: its first step message."""
    handle = ductor.start(workflow, input={})
    assert run_tick(ductor.runtime, handle.run_id) == "committed"
    [first] = [r for r in recorder.rows if r.kind == "step"]
    recorder.rows.clear()
    recorder.wakes.clear()
    return handle.run_id, first


def deliver(ductor: Ductor, row: OutboxRow, queue: str | None = QUEUE) -> str:
    """The Celery task's body for the message ``row`` would have been (its task id is the
    token, as the dispatcher sends it: the carrier of what it runs), with the attempts a
    bundled row carries read back from its header as the task reads them."""
    step = ductor.runtime.step_named(row.task)
    assert step is not None
    token = row.payload["token"]
    held = None
    if "held" in row.payload:
        held = carried_branches(held_header(row))
        assert held is not None and not isinstance(held, str), held
    return execute_attempt(
        ductor.runtime, step, token, "w1@host", queue=queue, carrier=token, held=held
    )


def run_row(ductor: Ductor, run_id: str) -> Any:
    with ductor.runtime.engine().connect() as conn:
        return conn.execute(sa.select(workflow_run).where(workflow_run.c.run_id == run_id)).one()


def attempt_rows(ductor: Ductor, run_id: str) -> list[Any]:
    with ductor.runtime.engine().connect() as conn:
        return list(
            conn.execute(
                sa.select(step_attempt)
                .where(step_attempt.c.run_id == run_id)
                .order_by(step_attempt.c.created_at, step_attempt.c.node)
            )
        )


def outbox_rows(ductor: Ductor) -> list[Any]:
    """The outbox rows left once the sent ones are deleted (the janitor's thread may be
    deleting a batch right now: give it a moment)."""
    deadline = time.monotonic() + 2.0
    while True:
        sent_outbox(ductor.runtime.engine()).flush()
        with ductor.runtime.engine().connect() as conn:
            rows = list(conn.execute(sa.select(workflow_outbox)))
        if not rows or time.monotonic() > deadline:
            return rows
        time.sleep(0.05)


def quick_scatter(
    ductor: Ductor,
    max_parallel: int,
    slow: frozenset[int] = frozenset(),
    interrupt: frozenset[int] = frozenset(),
) -> None:
    """``each``: item + 1 for every item; an item in ``slow`` takes 0.2 s, one in
    ``interrupt`` raises ``KeyboardInterrupt`` (the process is stopping)."""

    def bump(ctx: StepContext, item: int) -> int:
        if item in slow:
            time.sleep(0.2)
        if item in interrupt:
            raise KeyboardInterrupt
        return item + 1

    wf = Workflow("quick")
    wf.scatter(
        "each", ductor.step(name="held.bump")(bump), over="$.input.items", max_parallel=max_parallel
    )
    wf.output("$.nodes.each.output")
    ductor.register(wf)


def start_scatter(
    ductor: Ductor, recorder: RecordingDispatcher, items: int
) -> tuple[str, list[OutboxRow]]:
    handle = ductor.start("quick", input={"items": list(range(items))})
    assert run_tick(ductor.runtime, handle.run_id) == "committed"
    first = [r for r in recorder.rows if r.kind == "step"]
    recorder.rows.clear()
    return handle.run_id, first
