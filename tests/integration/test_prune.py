"""Issue 14 item 9: prune deletes finished runs (and their rows) in short batches, never a
child of a parent that stays; 100,000 runs go while new runs keep flowing."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from ductor_celery import Ductor, RunStatus, StepContext, Workflow
from ductor_celery.engine.state import RunState
from ductor_celery.engine.status import TERMINAL_RUN_STATUSES
from ductor_celery.runtime.sweeper import Sweeper
from ductor_celery.store import retention
from ductor_celery.store.db import db_now
from ductor_celery.store.migrate import upgrade
from ductor_celery.store.runs import pending_run
from ductor_celery.store.schema import (
    step_attempt,
    workflow_control,
    workflow_run,
    workflow_signal,
    workflow_transition,
)


def _make(url: str, **conf: Any) -> Ductor:
    app = Celery(f"prune{time.monotonic_ns()}", broker="memory://", set_as_current=False)
    app.conf.ductor_sweep_interval = 0.2
    for key, value in conf.items():
        app.conf[key] = value
    d = Ductor(app, database_url=url)

    @d.step(name="prune.echo")
    def echo(ctx: StepContext, value: Any = None) -> Any:
        return value

    wf = Workflow("tiny")
    wf.step("a", echo, args={"value": "$.input"})
    wf.output("$.nodes.a.output")
    d.register(wf)
    return d


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        found = f"sqlite:///{tmp_path}/prune.sqlite3"
        upgrade(found)
        return found
    value: str = request.getfixturevalue("database_url")
    return value


def _spec_hash(d: Ductor) -> str:
    spec = d.client.find_definition("tiny")
    from ductor_celery.store.runs import save_definition

    save_definition(d.runtime.engine(), spec)
    return spec.spec_hash


def _insert(
    d: Ductor, run_id: str, status: str, finished_days_ago: float | None, **links: Any
) -> None:
    """A run row with one attempt, one transition, one signal and one control."""
    now = db_now(d.runtime.engine())
    finished = None if finished_days_ago is None else now - timedelta(days=finished_days_ago)
    values = pending_run(
        run_id=run_id,
        workflow_id=run_id,
        workflow="tiny",
        version=1,
        spec_hash=_spec_hash(d),
        state=RunState(status=RunStatus(status)),
        input=None,
        **links,
    )
    values.update(status=status, finished_at=finished, created_at=finished or now)
    with d.runtime.engine().begin() as conn:
        conn.execute(sa.insert(workflow_run).values(values))
        conn.execute(
            sa.insert(step_attempt).values(
                token=f"{run_id}:a:1",
                run_id=run_id,
                node="a",
                generation=1,
                attempt=1,
                step="prune.echo",
                args={},
                timeout=300.0,
                finished_at=finished,
                outcome="succeeded",
                folded=True,
            )
        )
        conn.execute(
            sa.insert(workflow_transition).values(
                run_id=run_id, seq=0, to_status=status, reason="made by the test", at=now
            )
        )
        conn.execute(sa.insert(workflow_signal).values(run_id=run_id, workflow_id=run_id, name="s"))
        conn.execute(sa.insert(workflow_control).values(run_id=run_id, kind="cancel"))


def _ids(d: Ductor, table: sa.Table) -> set[str]:
    with d.runtime.engine().connect() as conn:
        return set(conn.execute(sa.select(table.c.run_id).distinct()).scalars())


def test_prune_deletes_old_finished_runs_and_their_rows_only(url: str) -> None:
    d = _make(url)
    _insert(d, "old-ok", "succeeded", 40)
    _insert(d, "old-failed", "failed", 40)
    _insert(d, "new-ok", "succeeded", 1)
    _insert(d, "open", "running", None)
    _insert(d, "child-of-open", "succeeded", 40, parent_run_id="open")
    _insert(d, "young-parent", "succeeded", 1)
    _insert(d, "child-of-young", "succeeded", 40, parent_run_id="young-parent")
    _insert(d, "old-parent", "succeeded", 35)
    _insert(d, "child-of-old", "succeeded", 40, parent_run_id="old-parent")
    _insert(d, "successor", "running", None, continued_from="continued")
    _insert(d, "continued", "continued", 40, continued_to="successor")
    everything = _ids(d, workflow_run)

    assert d.prune(older_than=timedelta(days=30), dry_run=True) == 4
    assert _ids(d, workflow_run) == everything, "a dry run deletes nothing"
    assert d.prune(older_than=timedelta(days=30), statuses=["failed"]) == 1
    assert d.prune(older_than=timedelta(days=30)) == 3
    gone = {"old-ok", "old-failed", "old-parent", "child-of-old"}
    for table in (workflow_run, step_attempt, workflow_transition, workflow_signal):
        assert _ids(d, table) == everything - gone, table.name
    assert _ids(d, workflow_control) == everything - gone
    assert d.prune(older_than=timedelta(days=30)) == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"older_than": timedelta(days=-1)}, ValueError, "older_than"),
        ({"older_than": "30d"}, TypeError, "timedelta"),
        ({"older_than": timedelta(days=1), "statuses": ["running"]}, ValueError, "only finished"),
        ({"older_than": timedelta(days=1), "statuses": ["pending"]}, ValueError, "only finished"),
        ({"older_than": timedelta(days=1), "statuses": ["gone"]}, ValueError, "unknown run status"),
        ({"older_than": timedelta(days=1), "statuses": []}, ValueError, "empty"),
        ({"older_than": timedelta(days=1), "dry_run": "yes"}, TypeError, "dry_run"),
    ],
)
def test_bad_prune_arguments_delete_nothing(
    url: str, kwargs: dict[str, Any], error: type[Exception], words: str
) -> None:
    d = _make(url)
    _insert(d, "old-ok", "succeeded", 40)
    with pytest.raises(error, match=words):
        d.prune(**kwargs)
    assert _ids(d, workflow_run) == {"old-ok"}


def test_the_sweeper_prunes_with_retention_days(url: str) -> None:
    d = _make(url, ductor_retention_days=30)
    assert d.settings.retention_days == 30
    _insert(d, "old-ok", "succeeded", 40)
    _insert(d, "new-ok", "succeeded", 10)
    assert Sweeper(d.runtime).sweep_once()["pruned"] == 1
    assert _ids(d, workflow_run) == {"new-ok"}
    kept = _make(url)  # default: keep everything
    assert kept.settings.retention_days is None
    _insert(kept, "old-again", "succeeded", 400)
    assert Sweeper(kept.runtime).sweep_once()["pruned"] == 0


@pytest.mark.parametrize("bad", [0, -1, "soon", float("nan"), True])
def test_a_bad_retention_days_setting_is_one_clear_error(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match="ductor_retention_days"):
        _make(f"sqlite:///{tmp_path}/x.sqlite3", ductor_retention_days=bad)


def _succeeded(d: Ductor, run_ids: list[str]) -> int:
    with d.runtime.engine().connect() as conn:
        return int(
            conn.execute(
                sa.select(sa.func.count())
                .select_from(workflow_run)
                .where(workflow_run.c.run_id.in_(run_ids), workflow_run.c.status == "succeeded")
            ).scalar_one()
        )


OLD_RUNS = 100_000
#: New runs started while the prune runs, at most.
FLOWING_MAX = 1000


@pytest.mark.slow
def test_prune_100000_finished_runs_in_batches_while_new_runs_flow(database_url: str) -> None:
    d = _make(database_url)
    engine = d.runtime.engine()
    spec_hash = _spec_hash(d)
    _insert(d, "open-parent", "running", None)
    _insert(d, "child-of-open", "succeeded", 40, parent_run_id="open-parent")
    # Set-based: 100,000 runs finished 40 days ago, each with an attempt and two transitions.
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                """
                INSERT INTO eec_workflow_run (run_id, workflow_id, workflow, version, spec_hash,
                    status, state, input, record_version, transition_count, created_at,
                    updated_at, finished_at)
                SELECT 'old-' || i, 'old-' || i, 'tiny', 1, :spec, 'succeeded',
                    '{"status": "succeeded", "nodes": {}, "context": {}}'::jsonb, 'null'::jsonb,
                    2, 2, now() - interval '41 days', now() - interval '40 days',
                    now() - interval '40 days' - (i || ' seconds')::interval
                FROM generate_series(1, :n) AS i
                """
            ),
            {"spec": spec_hash, "n": OLD_RUNS},
        )
        conn.execute(
            sa.text(
                """
                INSERT INTO eec_workflow_step_attempt (token, run_id, node, generation, attempt,
                    step, args, timeout, finished_at, outcome, output, folded)
                SELECT 'old-' || i || ':a:1', 'old-' || i, 'a', 1, 1, 'prune.echo',
                    '{}'::jsonb, 300, now() - interval '40 days', 'succeeded', '1'::jsonb, true
                FROM generate_series(1, :n) AS i
                """
            ),
            {"n": OLD_RUNS},
        )
        conn.execute(
            sa.text(
                """
                INSERT INTO eec_workflow_transition (run_id, seq, node, from_status, to_status,
                    reason, at)
                SELECT 'old-' || i, s, NULL, 'pending', 'running', 'made by the test',
                    now() - interval '40 days'
                FROM generate_series(1, :n) AS i, generate_series(0, 1) AS s
                """
            ),
            {"n": OLD_RUNS},
        )
    assert d.prune(older_than=timedelta(days=30), dry_run=True) == OLD_RUNS

    flowing: list[str] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def keep_starting() -> None:
        try:
            # A steady trickle (about 5 a second), not a flood: the point is that starts,
            # ticks and steps carry on between and during the batches.
            while not stop.wait(0.2) and len(flowing) < FLOWING_MAX:
                flowing.append(d.start("tiny", input=len(flowing)).run_id)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    batches: list[tuple[int, float]] = []
    with d.local_workers():
        starter = threading.Thread(target=keep_starting)
        starter.start()
        try:
            time.sleep(0.3)
            cutoff = db_now(engine) - timedelta(days=30)
            deleted = retention.prune(
                engine,
                cutoff=cutoff,
                statuses=TERMINAL_RUN_STATUSES,
                on_batch=lambda n, seconds: batches.append((n, seconds)),
            )
            done_meanwhile = _succeeded(d, list(flowing))
        finally:
            stop.set()
            starter.join()
        assert not errors, errors
        finished = [d.wait(run_id, timeout=60) for run_id in flowing]
    assert deleted == OLD_RUNS
    assert len(batches) >= OLD_RUNS // retention.DEFAULT_BATCH_SIZE
    assert max(n for n, _ in batches) <= retention.DEFAULT_BATCH_SIZE
    slowest = max(seconds for _, seconds in batches)
    assert slowest < 5.0, f"a batch held its locks for {slowest:.2f}s"
    assert len(flowing) >= 5, "runs kept starting while the prune ran"
    assert done_meanwhile >= 1, "and kept finishing"
    assert all(v.status == RunStatus.SUCCEEDED for v in finished)
    with engine.connect() as conn:
        left = conn.execute(
            sa.select(sa.func.count())
            .select_from(workflow_run)
            .where(workflow_run.c.run_id.like("old-%"))
        ).scalar_one()
        attempts = conn.execute(
            sa.select(sa.func.count())
            .select_from(step_attempt)
            .where(step_attempt.c.run_id.like("old-%"))
        ).scalar_one()
        transitions = conn.execute(
            sa.select(sa.func.count())
            .select_from(workflow_transition)
            .where(workflow_transition.c.run_id.like("old-%"))
        ).scalar_one()
    assert (left, attempts, transitions) == (0, 0, 0)
    survivors = _ids(d, workflow_run)
    assert {"open-parent", "child-of-open"} <= survivors, "a child of an open parent stays"
    assert set(flowing) <= survivors
    assert d.prune(older_than=timedelta(days=30)) == 0
