"""The shipped in-memory store (``fakes.InMemoryStore``) agrees with the SQL store.

The same workflows are driven, step for step, through the production tick loop
(``coordinator.Coordinator``) over each store, with the same scripted workers, signals and
controls; afterwards every row the ticks wrote is compared: the run (status, state, output,
error, version), the attempts, the transitions, the signals, the controls, and every outbox
row the dispatcher was handed, in order. Times are left out (the database's clock is not the
test's), and outbox ids (sequences are per store).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Protocol

import pytest
import sqlalchemy as sa
from support import sql_coordinator

from ductor_celery.coordinator import Coordinator
from ductor_celery.definition import RetryPolicy, Workflow, WorkflowSpec
from ductor_celery.engine import EngineConfig
from ductor_celery.engine.kinds import ControlKind, DispatchKind
from ductor_celery.engine.status import TERMINAL_RUN_STATUSES
from ductor_celery.fakes import InMemoryStore, RecordingDispatcher
from ductor_celery.store import attempts, external, history, runs
from ductor_celery.store.db import get_engine
from ductor_celery.store.done_nodes import full_state
from ductor_celery.store.migrate import upgrade
from ductor_celery.store.schema import (
    step_attempt,
    workflow_control,
    workflow_run,
    workflow_signal,
)

#: cancel_grace=0: a cancel closes what is in flight in its own tick (the cooperative cancel's
#: rows are compared in test_a_cooperative_cancel_marks_the_same_attempts_in_both_stores).
CONFIG = EngineConfig(resend_unclaimed_after=30.0, default_step_timeout=300.0, cancel_grace=0)
#: Retry backoff: short, since the SQL store's clock is the real one.
BACKOFF = 0.2
TIME_FIELDS = frozenset(
    {
        "check_at",
        "retry_at",
        "started_at",
        "finished_at",
        "claimed_at",
        "deadline",
        "resend_at",
        "grace_until",
        "deadline_at",
    }
)
TERMINAL = frozenset(s.value for s in TERMINAL_RUN_STATUSES)


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/agree.sqlite3"
        upgrade(url)
        return url
    found: str = request.getfixturevalue("database_url")
    return found


def _timeless(value: Any) -> Any:
    """A stored state without its times (each store has its own clock)."""
    if isinstance(value, dict):
        return {k: _timeless(v) for k, v in value.items() if k not in TIME_FIELDS}
    if isinstance(value, list):
        return [_timeless(v) for v in value]
    return value


class _World(Protocol):
    """One store, the tick loop over it, and the client and worker writes a test makes."""

    coordinator: Coordinator[Any]
    sent: RecordingDispatcher

    def start(self, spec: WorkflowSpec, run_id: str, input: Any) -> None: ...
    def claim_and_finish(self, token: str, output: Any, error: Any) -> None: ...
    def signal(self, run_id: str, name: str, payload: Any) -> None: ...
    def control(self, run_id: str, kind: ControlKind, **target: Any) -> None: ...
    def wait(self, seconds: float) -> None: ...
    def open_runs(self) -> list[str]: ...

    def asked_to_stop(self) -> list[str]: ...
    def rows(self) -> dict[str, Any]: ...


def test_a_cooperative_cancel_marks_the_same_attempts_in_both_stores(db_url: str) -> None:
    wf = Workflow("agree_coop")
    wf.scatter("each", "s.each", over="$.input.items", item_arg="item", max_parallel=3)
    spec = wf.build()
    graceful = dataclasses.replace(CONFIG, cancel_grace=30.0)
    worlds = [_Fake([spec], graceful), _Sql(db_url, [spec], graceful)]
    for world in worlds:
        world.start(spec, "agree-3", {"items": [1, 2, 3]})
        world.coordinator.tick("agree-3")
        first = world.sent.sent[0].payload["token"]
        world.claim_and_finish(first, "one", None)
        world.control("agree-3", ControlKind.CANCEL)
        world.coordinator.tick("agree-3")  # folds the first branch, asks the other two
        assert world.open_runs() == ["agree-3"]
        assert world.asked_to_stop() == ["agree-3:each:2", "agree-3:each:3"]
    fake_rows, sql_rows = (_strip_ids(w.rows()) for w in worlds)
    for table in ("runs", "attempts", "transitions", "controls"):
        assert fake_rows[table] == sql_rows[table], table
    assert _sent(worlds[0]) == _sent(worlds[1])


class _Fake:
    def __init__(self, specs: list[WorkflowSpec], config: EngineConfig = CONFIG) -> None:
        self.store = InMemoryStore(config=config)
        for spec in specs:
            self.store.add_definition(spec)
        self.sent = RecordingDispatcher(self.store)
        self.coordinator = Coordinator(self.store, self.sent)

    def start(self, spec: WorkflowSpec, run_id: str, input: Any) -> None:
        self.store.start(spec, input, run_id=run_id)

    def claim_and_finish(self, token: str, output: Any, error: Any) -> None:
        assert self.store.claim(token, "w")
        assert self.store.finish(token, output=output, error=error)

    def signal(self, run_id: str, name: str, payload: Any) -> None:
        self.store.signal(run_id, name, payload)

    def control(self, run_id: str, kind: ControlKind, **target: Any) -> None:
        self.store.control(run_id, kind, reason="test", **target)

    def wait(self, seconds: float) -> None:
        self.store.advance(seconds)

    def open_runs(self) -> list[str]:
        return sorted(r.run_id for r in self.store.tables.runs.values() if r.status not in TERMINAL)

    def asked_to_stop(self) -> list[str]:
        return sorted(a.token for a in self.store.tables.attempts.values() if a.cancel_requested_at)

    def rows(self) -> dict[str, Any]:
        t = self.store.tables
        return {
            "runs": sorted(
                (
                    r.run_id,
                    r.workflow_id,
                    r.status,
                    _timeless(r.state),
                    r.output,
                    r.error,
                    r.record_version,
                    r.transition_count,
                    r.parent_run_id,
                    r.parent_node,
                )
                for r in t.runs.values()
            ),
            "attempts": sorted(
                (
                    a.token,
                    a.node,
                    a.branch,
                    a.generation,
                    a.attempt,
                    a.step,
                    a.args,
                    a.outcome,
                    a.output,
                    a.error,
                    a.folded,
                    a.claimed_by,
                )
                for a in t.attempts.values()
            ),
            "transitions": sorted(
                (x.run_id, x.seq, x.node, x.from_status, x.to_status, x.reason)
                for x in t.transitions
            ),
            "signals": [(s.id, s.run_id, s.name, s.payload, s.applied_to) for s in t.signals],
            "controls": [(c.id, c.run_id, c.kind, c.result) for c in t.controls],
        }


class _Sql:
    def __init__(self, url: str, specs: list[WorkflowSpec], config: EngineConfig = CONFIG) -> None:
        self.engine = get_engine(url)
        by_hash = {s.spec_hash: s for s in specs}
        for spec in specs:
            runs.save_definition(self.engine, spec)
        self.coordinator, self.sent = sql_coordinator(self.engine, by_hash.__getitem__, config)

    def start(self, spec: WorkflowSpec, run_id: str, input: Any) -> None:
        runs.insert_run(self.engine, run_id=run_id, workflow_id=run_id, spec=spec, input=input)

    def claim_and_finish(self, token: str, output: Any, error: Any) -> None:
        assert attempts.claim(self.engine, token, "w") is not None
        outcome = "failed" if error is not None else "succeeded"
        assert attempts.finish(self.engine, token, outcome=outcome, output=output, error=error)[0]

    def signal(self, run_id: str, name: str, payload: Any) -> None:
        external.insert_signal(
            self.engine,
            run_id=run_id,
            workflow_id=run_id,
            name=name,
            payload=payload,
            idempotency_key=None,
        )

    def control(self, run_id: str, kind: ControlKind, **target: Any) -> None:
        external.insert_control(
            self.engine,
            run_id=run_id,
            kind=kind,
            reason="test",
            has_input="input" in target,
            **target,
        )

    def version_of(self, run_id: str) -> tuple[int, str]:
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(workflow_run.c.version, workflow_run.c.spec_hash).where(
                    workflow_run.c.run_id == run_id
                )
            ).one()
            return int(row.version), str(row.spec_hash)

    def wait(self, seconds: float) -> None:
        time.sleep(seconds)

    def asked_to_stop(self) -> list[str]:
        with self.engine.connect() as conn:
            found = conn.execute(
                sa.select(step_attempt.c.token).where(
                    step_attempt.c.cancel_requested_at.is_not(None)
                )
            )
            return sorted(found.scalars())

    def open_runs(self) -> list[str]:
        with self.engine.connect() as conn:
            found = conn.execute(
                sa.select(workflow_run.c.run_id).where(workflow_run.c.status.not_in(TERMINAL))
            )
            return sorted(found.scalars())

    def rows(self) -> dict[str, Any]:
        with self.engine.connect() as conn:

            def select(*columns: Any) -> list[Any]:
                return [tuple(r) for r in conn.execute(sa.select(*columns))]

            r, a, x = workflow_run.c, step_attempt.c, history.view.c
            s, c = workflow_signal.c, workflow_control.c
            run_rows = select(
                r.run_id,
                r.workflow_id,
                r.status,
                full_state(),  # the whole state: as every reader selects it
                r.output,
                r.error,
                r.record_version,
                r.transition_count,
                r.parent_run_id,
                r.parent_node,
            )
            return {
                "runs": sorted(
                    (row[0], row[1], row[2], _timeless(row[3]), *row[4:]) for row in run_rows
                ),
                "attempts": sorted(
                    select(
                        a.token,
                        a.node,
                        a.branch,
                        a.generation,
                        a.attempt,
                        a.step,
                        a.args,
                        a.outcome,
                        a.output,
                        a.error,
                        a.folded,
                        a.claimed_by,
                    )
                ),
                "transitions": sorted(
                    select(x.run_id, x.seq, x.node, x.from_status, x.to_status, x.reason)
                ),
                "signals": sorted(
                    select(s.id, s.run_id, s.name, s.payload, s.applied_to), key=lambda t: t[0]
                ),
                "controls": sorted(select(c.id, c.run_id, c.kind, c.result), key=lambda t: t[0]),
            }


def _strip_ids(rows: dict[str, Any]) -> dict[str, Any]:
    """Signals and controls in id order, without the ids (each store numbers its own)."""
    return rows | {table: [t[1:] for t in rows[table]] for table in ("signals", "controls")}


def _node_status(world: _World, run_id: str, node: str) -> str | None:
    for row in world.rows()["runs"]:
        if row[0] == run_id:
            return str(row[3]["nodes"][node].get("status", "pending"))
    return None


def _sent(world: _World) -> list[tuple[Any, ...]]:
    return [(r.run_id, str(r.kind), r.task, r.queue, r.payload) for r in world.sent.sent]


# -- the workflows and their scripted workers --------------------------------------------------


def _specs() -> tuple[WorkflowSpec, WorkflowSpec]:
    child = Workflow("agree_child")
    child.step("c", "s.child", args={"n": "$.input.n"})
    child.checkpoint("half", after=["c"])
    child.output({"doubled": "$.nodes.c.output"})
    child_spec = child.build()
    wf = Workflow("agree")
    retry = RetryPolicy(max_attempts=3, initial_interval=BACKOFF)
    wf.step("a", "s.a", args={"x": "$.input.x"}, retry=retry)
    wf.scatter(
        "each",
        "s.each",
        over="$.nodes.a.output.items",
        item_arg="item",
        max_parallel=2,
        after=["a"],
    )
    wf.wait_signal("go", signal="go", after=["each"])
    wf.subworkflow("sub", workflow="agree_child", input={"n": "$.input.x"}, after=["go"])
    wf.step(
        "b",
        "s.b",
        after=["sub", "each", "go"],
        args={
            "each": "$.nodes.each.output",
            "go": "$.nodes.go.output",
            "sub": "$.nodes.sub.output",
        },
    )
    wf.output({"a": "$.nodes.a.output", "b": "$.nodes.b.output"})
    return wf.build(None, {"agree_child": child_spec}.get), child_spec


def _work(world: _World, done: set[str]) -> bool:
    """Run every step message not run yet, in the order it was sent. The first attempt of
    ``a`` fails (retryable); the rest succeed with values of their arguments."""
    ran = False
    for row in world.sent.sent:
        if row.kind != DispatchKind.STEP or row.payload["token"] in done:
            continue
        token, node = row.payload["token"], row.payload["node"]
        done.add(token)
        ran = True
        if node == "a" and token.endswith(":1"):
            world.claim_and_finish(token, None, {"type": "Flaky", "message": "first time"})
        elif node == "a":
            world.claim_and_finish(token, {"items": [1, 2, 3]}, None)
        elif node == "each":
            world.claim_and_finish(token, f"item-{token.rsplit(':', 1)[1]}", None)
        elif node == "c":
            world.claim_and_finish(token, 2 * 7, None)
        else:
            world.claim_and_finish(token, {"saw": token}, None)
    return ran


def _drive(world: _World, spec: WorkflowSpec) -> None:
    world.start(spec, "agree-1", {"x": 7})
    done: set[str] = set()
    signalled = False
    for _ in range(40):
        for run_id in world.open_runs():
            world.coordinator.tick(run_id)
        if not world.open_runs():
            return
        if _work(world, done):
            continue
        if not signalled and _node_status(world, "agree-1", "go") == "waiting":
            world.signal("agree-1", "go", {"ok": True})
            signalled = True
            continue
        world.wait(BACKOFF * 1.5)  # a retry's backoff
    raise AssertionError(f"runs still open: {world.open_runs()}")


def test_one_workflow_driven_through_both_stores_leaves_the_same_rows(db_url: str) -> None:
    spec, child = _specs()
    fake, sql = _Fake([spec, child]), _Sql(db_url, [spec, child])
    _drive(fake, spec)
    _drive(sql, spec)
    fake_rows, sql_rows = _strip_ids(fake.rows()), _strip_ids(sql.rows())
    assert fake_rows["runs"][0][2] == "succeeded", fake_rows["runs"]
    for table in ("runs", "attempts", "transitions", "signals", "controls"):
        assert fake_rows[table] == sql_rows[table], table
    assert _sent(fake) == _sent(sql)
    assert len(fake_rows["attempts"]) == 7  # a twice, three branches, the child's c, b


def test_a_cancel_with_branches_in_flight_is_handled_alike_by_both_stores(db_url: str) -> None:
    wf = Workflow("agree_cancel")
    wf.scatter("each", "s.each", over="$.input.items", item_arg="item", max_parallel=3)
    spec = wf.build()
    worlds: list[_World] = [_Fake([spec]), _Sql(db_url, [spec])]
    for world in worlds:
        world.start(spec, "agree-2", {"items": [1, 2, 3]})
        world.coordinator.tick("agree-2")
        first = world.sent.sent[0].payload["token"]
        world.claim_and_finish(first, "one", None)
        world.control("agree-2", ControlKind.CANCEL)
        world.coordinator.tick("agree-2")  # the cancel closes the two branches in flight
        world.coordinator.tick("agree-2")
        assert world.open_runs() == []
    fake_rows, sql_rows = (_strip_ids(w.rows()) for w in worlds)
    assert fake_rows["runs"][0][2] == "cancelled"
    for table in ("runs", "attempts", "transitions", "controls"):
        assert fake_rows[table] == sql_rows[table], table
    assert _sent(worlds[0]) == _sent(worlds[1])


def _settle(world: _World, run_id: str, done: set[str]) -> None:
    """Tick and run steps until nothing moves (a parked or finished run)."""
    for _ in range(20):
        for open_run in world.open_runs() or [run_id]:
            world.coordinator.tick(open_run)
        if not _work(world, done):
            return
    raise AssertionError("the run never settled")


def test_a_redrive_from_a_node_with_input_and_a_move_to_another_version_agree(
    db_url: str,
) -> None:
    v1 = Workflow("agree_v", version=1)
    v1.step("p", "s.p", args={"x": "$.input.x"})
    v1.step("q", "s.q", after=["p"], args={"p": "$.nodes.p.output", "x": "$.input.x"})
    v1.wait_signal("hold", signal="go", after=["q"])
    v2 = Workflow("agree_v", version=2)
    v2.step("p", "s.p", args={"x": "$.input.x"})
    v2.step("q", "s.q", after=["p"], args={"p": "$.nodes.p.output", "x": "$.input.x"})
    v2.wait_signal("hold", signal="go", after=["q"])
    v2.step("r", "s.r", after=["hold"])
    spec1, spec2 = v1.build(), v2.build()
    fake, sql = _Fake([spec1, spec2]), _Sql(db_url, [spec1, spec2])
    for world in (fake, sql):
        done: set[str] = set()
        world.start(spec1, "agree-3", {"x": 1})
        _settle(world, "agree-3", done)
        world.control("agree-3", ControlKind.CANCEL)
        _settle(world, "agree-3", done)
        world.control("agree-3", ControlKind.REDRIVE, node="q", input={"x": 2})
        _settle(world, "agree-3", done)
        assert _node_status(world, "agree-3", "hold") == "waiting"
        world.control("agree-3", ControlKind.CONTINUE_AS_NEW, spec_hash=spec2.spec_hash)
        _settle(world, "agree-3", done)
        (successor,) = world.open_runs()
        world.signal(successor, "go", None)
        _settle(world, successor, done)
        assert world.open_runs() == []
    fake_rows, sql_rows = _strip_ids(fake.rows()), _strip_ids(sql.rows())
    for table in ("runs", "attempts", "transitions", "signals", "controls"):
        assert fake_rows[table] == sql_rows[table], table
    assert _sent(fake) == _sent(sql)
    by_run = {r[0]: r for r in sql_rows["runs"]}
    assert by_run["agree-3"][2] == "continued" and by_run["agree-3"][3]["input_from"] == 2
    q_args = [a[6] for a in sql_rows["attempts"] if a[1] == "q"]
    assert q_args == [{"p": {"saw": "agree-3:p:1"}, "x": 1}, {"p": {"saw": "agree-3:p:1"}, "x": 2}]
    (successor_id,) = set(by_run) - {"agree-3"}
    assert sql.version_of(successor_id) == (2, spec2.spec_hash)
    fake_successor = fake.store.tables.runs[successor_id]
    assert (fake_successor.version, fake_successor.spec_hash) == (2, spec2.spec_hash)
    assert by_run[successor_id][2] == "succeeded"
    # p and q were carried to version 2 (unchanged there): only r ran in the successor
    assert [a[1] for a in sql_rows["attempts"] if a[0].startswith(successor_id)] == ["r"]


def _saga_work(world: _World, done: set[str]) -> bool:
    """Run every step message not run yet: ``boom`` fails without retry, the rest succeed."""
    ran = False
    for row in world.sent.sent:
        if row.kind != DispatchKind.STEP or row.payload["token"] in done:
            continue
        token, node = row.payload["token"], row.payload["node"]
        done.add(token)
        ran = True
        if node == "boom":
            world.claim_and_finish(token, None, {"type": "Boom", "message": "no stock"})
        else:
            world.claim_and_finish(token, {"did": token}, None)
    return ran


def test_a_saga_and_its_redrive_leave_the_same_rows_in_both_stores(db_url: str) -> None:
    """docs/compensation.md: a failed run compensates in reverse order (the compensation's
    output read from the node's attempt row), is redriven (the undone nodes run again) and
    compensates again."""
    wf = Workflow("agree_saga")
    wf.step("p", "s.p", compensate="s.undo")
    wf.step("q", "s.q", after=["p"], compensate="s.undo")
    wf.step("boom", "s.boom", after=["q"], retry=RetryPolicy(max_attempts=1))
    spec = wf.build()
    worlds: list[_World] = [_Fake([spec]), _Sql(db_url, [spec])]
    for world in worlds:
        done: set[str] = set()
        world.start(spec, "agree-s", {"order": 1})
        for _ in range(20):
            world.coordinator.tick("agree-s")
            if not _saga_work(world, done) and not world.open_runs():
                break
        assert world.open_runs() == []
        world.control("agree-s", ControlKind.REDRIVE)
        for _ in range(20):
            world.coordinator.tick("agree-s")
            if not _saga_work(world, done) and not world.open_runs():
                break
        assert world.open_runs() == []
    fake_rows, sql_rows = (_strip_ids(w.rows()) for w in worlds)
    for table in ("runs", "attempts", "transitions", "controls"):
        assert fake_rows[table] == sql_rows[table], table
    assert _sent(worlds[0]) == _sent(worlds[1])
    assert fake_rows["runs"][0][2] == "failed"
    # Rows are listed by token; the order they ran in is checked in test_compensation.py.
    undo = [(a[0], a[6]) for a in sql_rows["attempts"] if a[1].endswith("~compensate")]
    assert undo == [
        ("agree-s:p~compensate:1", {"output": {"did": "agree-s:p:1"}, "input": {"order": 1}}),
        ("agree-s:p~compensate:2", {"output": {"did": "agree-s:p:2"}, "input": {"order": 1}}),
        ("agree-s:q~compensate:1", {"output": {"did": "agree-s:q:1"}, "input": {"order": 1}}),
        ("agree-s:q~compensate:2", {"output": {"did": "agree-s:q:2"}, "input": {"order": 1}}),
    ]
