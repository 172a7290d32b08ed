"""A step's dispatch and success transitions kept by its attempt row (docs/history-in-attempt-
rows.md): the history a run's readers see is exactly the transitions its ticks made, each
once, whether the commit wrote it as a row or as the attempt row's ``dispatch_seq`` or
``success_seq``; and an inline chain writes two transition rows a run, not two a step.

Runs here go through production's code in this thread (first tick, inline steps, eager
ticks, wake-ups) on the test's PostgreSQL: the one-statement commit is a PostgreSQL path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from support import recording_ductor, run_to_end

from ductor_celery import RetryPolicy, Workflow
from ductor_celery.store import exports, history, migrate, runs, ticks
from ductor_celery.store.db import get_engine
from ductor_celery.store.schema import ATTEMPT_PREDICATES, step_attempt, workflow_transition

ROW = ("run_id", "seq", "node", "from_status", "to_status", "reason", "at")


class _Made:
    """Every transition the ticks made, as the commits were given them (the last making of a
    seq wins: a commit that lost a race is computed again)."""

    def __init__(self) -> None:
        self.by_run: dict[str, dict[int, tuple[Any, ...]]] = {}
        self.reworded: dict[str, str] = {}

    def record(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for row in rows:
            row["reason"] = self.reworded.get(row["reason"], row["reason"])
            self.by_run.setdefault(row["run_id"], {})[row["seq"]] = tuple(row[k] for k in ROW)
        return rows

    def of(self, run_id: str) -> list[tuple[Any, ...]]:
        made = self.by_run[run_id]
        return [made[seq] for seq in sorted(made)]


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> _Made:
    found = _Made()
    making = ticks.transition_rows
    monkeypatch.setattr(ticks, "transition_rows", lambda *args: found.record(making(*args)))
    return found


@pytest.fixture
def ductor(database_url: str, tmp_path: Path) -> Any:
    d = recording_ductor(database_url, f"hist{tmp_path.name}")
    failures: dict[str, int] = {}

    @d.step(name="hist.ok")
    def ok(ctx: Any, value: Any = None) -> dict[str, int]:
        return {"ok": 1}

    @d.step(name="hist.flaky", retry=RetryPolicy(max_attempts=3, initial_interval=0.0))
    def flaky(ctx: Any) -> str:
        failures[ctx.run_id] = failures.get(ctx.run_id, 0) + 1
        if failures[ctx.run_id] < 2:
            raise RuntimeError("first attempt fails")
        return "second"

    @d.step(name="hist.broken", retry=RetryPolicy(max_attempts=1))
    def broken(ctx: Any) -> None:
        raise ValueError("never works")

    chain = Workflow("hist_chain")
    for i in range(4):
        chain.step(f"s{i}", "hist.ok", after=[f"s{i - 1}"] if i else [])
    d.register(chain)
    diamond = Workflow("hist_diamond")
    diamond.step("a", "hist.ok")
    diamond.step("b", "hist.ok", after=["a"])
    diamond.step("c", "hist.ok", after=["a"])
    diamond.step("d", "hist.ok", after=["b", "c"])
    d.register(diamond)
    retried = Workflow("hist_retried")
    retried.step("first", "hist.ok")
    retried.step("flaky", "hist.flaky", after=["first"])
    retried.step("last", "hist.ok", after=["flaky"])
    d.register(retried)
    scattered = Workflow("hist_scatter")
    scattered.step("items", "hist.ok")
    scattered.scatter("each", "hist.ok", over="$.input.items", item_arg="value", after=["items"])
    scattered.step("after", "hist.ok", after=["each"])
    d.register(scattered)
    failing = Workflow("hist_failing")
    failing.step("first", "hist.ok")
    failing.step("broken", "hist.broken", after=["first"])
    d.register(failing)
    return d


def _run(d: Any, workflow: str) -> str:
    return run_to_end(d, workflow, {"items": [1, 2, 3]})


def _history(d: Any, run_id: str) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in runs.transitions_of(d.runtime.engine(), run_id, 10_000)]


def _count(d: Any, query: Any) -> int:
    with d.runtime.engine().connect() as conn:
        return int(conn.execute(query).scalar_one())


def _rows_of(run_id: str) -> Any:
    return sa.select(sa.func.count()).where(workflow_transition.c.run_id == run_id)


def _kept_by_attempts(run_id: str) -> Any:
    a = step_attempt.c
    return sa.select(sa.func.count(a.dispatch_seq) + sa.func.count(a.success_seq)).where(
        a.run_id == run_id
    )


@pytest.mark.parametrize(
    ("workflow", "status"),
    [
        ("hist_chain", "succeeded"),
        ("hist_diamond", "succeeded"),
        ("hist_retried", "succeeded"),
        ("hist_scatter", "succeeded"),
        ("hist_failing", "failed"),
    ],
)
def test_history_is_every_transition_the_ticks_made_once(
    ductor: Any, made: _Made, workflow: str, status: str
) -> None:
    run_id = _run(ductor, workflow)
    assert ductor.get(run_id).status == status
    assert _history(ductor, run_id) == made.of(run_id)
    # The attempt rows did keep some: this is the path under test.
    assert _count(ductor, _kept_by_attempts(run_id)) > 0


def test_an_inline_chain_writes_two_transition_rows_a_run(ductor: Any, made: _Made) -> None:
    run_id = _run(ductor, "hist_chain")
    assert len(made.of(run_id)) == 10  # started, 4 x (dispatched, succeeded), finished
    assert _count(ductor, _rows_of(run_id)) == 2
    assert _count(ductor, _kept_by_attempts(run_id)) == 8


def test_a_retried_steps_attempt_keeps_its_own_number(ductor: Any, made: _Made) -> None:
    run_id = _run(ductor, "hist_retried")
    reasons = [(row[2], row[5]) for row in _history(ductor, run_id)]
    assert ("flaky", "attempt 2 succeeded") in reasons
    assert ("flaky", "attempt 1 succeeded") not in reasons


def test_a_reason_the_row_would_not_read_back_stays_a_row(ductor: Any, made: _Made) -> None:
    """The success's reason is checked by the statement against the row it updates, the
    dispatch's by the commit against the attempt it inserts: worded otherwise, both are rows,
    and the history still reads exactly what was made."""
    made.reworded = {
        "attempt 1 succeeded": "attempt 1 succeeded (worded otherwise)",
        "attempt 1 dispatched": "attempt 1 dispatched (worded otherwise)",
    }
    run_id = _run(ductor, "hist_chain")
    assert _history(ductor, run_id) == made.of(run_id)
    assert _count(ductor, _kept_by_attempts(run_id)) == 0
    assert _count(ductor, _rows_of(run_id)) == 10


def test_an_export_holds_the_whole_history_as_rows(ductor: Any, made: _Made) -> None:
    run_id = _run(ductor, "hist_diamond")
    rows = exports.read_rows(ductor.runtime.engine(), run_id)
    assert rows is not None
    assert [
        (run_id, *(t[k] for k in exports.TRANSITION_COLUMNS)) for t in rows.transitions
    ] == made.of(run_id)
    assert all("dispatch_seq" not in a and "success_seq" not in a for a in rows.attempts)


def test_the_downgrade_writes_kept_transitions_back_as_rows(
    ductor: Any, made: _Made, database_url: str
) -> None:
    run_id = _run(ductor, "hist_chain")
    before = _history(ductor, run_id)
    migrate.downgrade(database_url, "0017")
    try:
        with ductor.runtime.engine().connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT run_id, seq, node, from_status, to_status, reason, at "
                    "FROM eec_workflow_transition WHERE run_id = :r ORDER BY seq"
                ),
                {"r": run_id},
            ).all()
        assert [tuple(r) for r in rows] == before == made.of(run_id)
    finally:
        migrate.upgrade(database_url)
    # Upgraded again: the rows are the history, nothing is read twice.
    assert _history(ductor, run_id) == before


def test_the_view_has_a_transition_rows_columns(ductor: Any) -> None:
    with ductor.runtime.engine().connect() as conn:
        found = conn.execute(sa.text("SELECT * FROM eec_workflow_history LIMIT 0")).keys()
    assert tuple(found) == tuple(history.view.c.keys()) == ROW


def test_a_later_migration_can_rebuild_both_tables_around_the_view(tmp_path: Path) -> None:
    """What migration 0018 tells a later one to do: drop the view, rebuild a table it reads
    (SQLite's batch mode, which refuses while the view is there), create the view again
    from ``history.CREATE_VIEW``; the history reads as before. The attempt table is rebuilt
    as migration 0019 says (its generated columns dropped and added in the batch); they and
    their indexes are as before."""
    from alembic.migration import MigrationContext
    from alembic.operations import Operations

    url = f"sqlite:///{tmp_path}/ductor.sqlite3"
    migrate.upgrade(url)
    engine = get_engine(url)
    with engine.begin() as conn:
        conn.execute(
            sa.insert(workflow_transition).values(
                run_id="r",
                seq=0,
                node=None,
                from_status="pending",
                to_status="running",
                reason="started",
                at=sa.func.current_timestamp(),
            )
        )
        conn.execute(
            sa.insert(step_attempt).values(
                token="r:a:1",
                run_id="r",
                node="a",
                generation=1,
                attempt=1,
                step="s",
                args={},
                timeout=60.0,
                dispatch_seq=1,
            )
        )
    before = _history_at(engine)
    assert [row[1:6] for row in before] == [
        (0, None, "pending", "running", "started"),
        (1, "a", "pending", "running", "attempt 1 dispatched"),
    ]
    with engine.begin() as conn:
        ops = Operations(MigrationContext.configure(conn, opts={"render_as_batch": True}))
        with pytest.raises(sa.exc.OperationalError, match="eec_workflow_history"):
            with conn.begin_nested():
                _rebuild_attempt_table(ops)
        with pytest.raises(sa.exc.OperationalError, match="eec_workflow_history"):
            with (
                conn.begin_nested(),
                ops.batch_alter_table("eec_workflow_transition", recreate="always"),
            ):
                pass
        conn.exec_driver_sql("DROP VIEW eec_workflow_history")
        _rebuild_attempt_table(ops)
        with ops.batch_alter_table("eec_workflow_transition", recreate="always"):
            pass
        conn.exec_driver_sql(history.CREATE_VIEW)
    assert _history_at(engine) == before
    with engine.connect() as conn:
        assert conn.execute(
            sa.select(step_attempt.c.unfolded, step_attempt.c.lease_waiting)
        ).all() == [(False, False)]
        indexes = {i["name"]: i for i in sa.inspect(conn).get_indexes(step_attempt.name)}
        sql = dict(
            conn.exec_driver_sql(
                "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
            ).all()
        )
    assert "eec_workflow_step_attempt_unfolded" in indexes
    assert sql["eec_workflow_step_attempt_unfolded"].endswith("WHERE unfolded = 1")


def _rebuild_attempt_table(ops: Any) -> None:
    """Migration 0019's recipe for a rebuild of the attempt table on SQLite: alembic's batch
    copy would insert into its generated columns (which SQLite refuses), so the batch drops
    them and adds them again (their values computed anew), with their indexes dropped before
    and created after."""
    for index in _partial_indexes():
        ops.drop_index(index.name, table_name=step_attempt.name)
    with ops.batch_alter_table(step_attempt.name, recreate="always") as batch:
        for name in ATTEMPT_PREDICATES:
            batch.drop_column(name)
        for name, expression in ATTEMPT_PREDICATES.items():
            batch.add_column(sa.Column(name, sa.Boolean, sa.Computed(expression, persisted=True)))
    for index in _partial_indexes():
        index.create(ops.get_bind())


def _partial_indexes() -> list[sa.Index]:
    return [i for i in step_attempt.indexes if i.dialect_options["sqlite"]["where"] is not None]


def _history_at(engine: Any) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in runs.transitions_of(engine, "r")]
