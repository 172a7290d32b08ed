"""The common tick commit in one statement (store/pg_commit.py) writes exactly what the
statement-by-statement commit writes, and nothing when it loses a version race."""

from __future__ import annotations

import contextlib
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from celery import Celery
from support import attempts_scanned, grow_attempts

from ductor_celery import Ductor, RetryPolicy, RunStatus, StepContext, Workflow
from ductor_celery.store import pg_commit
from ductor_celery.store.db import get_engine, psycopg_connect_args
from ductor_celery.store.finishes import RUN_FINISHED_CHANNEL


def _app(url: str, tmp_path: Path) -> Ductor:
    d = Ductor(Celery(f"pgc{tmp_path.name}{id(url)}", set_as_current=False), database_url=url)
    tries: dict[str, int] = {}

    @d.step(name="pgc.work", retry=RetryPolicy(max_attempts=3, initial_interval=0.01))
    def work(ctx: StepContext, value: Any) -> Any:
        key = f"{ctx.node}:{ctx.branch}"
        tries[key] = tries.get(key, 0) + 1
        if value == "flaky" and tries[key] == 1:
            raise RuntimeError("once")
        ctx.patch({key: value})
        return {"v": value, "é": "ünïcode ✓", "n": [1.0, 2**64 + 1, None]}

    wf = Workflow("pgc")
    wf.step("a", work, args={"value": "$.input.a"})
    wf.step("b", work, args={"value": "flaky"}, after=["a"])
    wf.step("c", work, args={"value": 3}, after=["a"], when="$.input.c")
    # One attempt at a time: the same history in both runs, whatever the timing.
    wf.scatter("s", work, over="$.input.items", item_arg="value", after=["b"], max_parallel=1)
    wf.step("z", work, args={"value": "$.nodes.s.output"}, after=["s", "c"])
    wf.output({"z": "$.nodes.z.output", "s": "$.nodes.s.output"})
    d.register(wf)
    return d


def _rows(url: str, run_id: str) -> dict[str, Any]:
    """What a run wrote, without ids and times (they differ between two runs)."""
    with get_engine(url).connect() as conn:

        def q(sql: str) -> list[tuple[Any, ...]]:
            return [tuple(r) for r in conn.execute(sa.text(sql), {"r": run_id})]

        return {
            "run": q(
                # Not record_version: how many ticks a run takes depends on timing.
                "SELECT status, output, error, transition_count, "
                "state->'context' FROM eec_workflow_run WHERE run_id = :r"
            ),
            "attempts": q(
                "SELECT replace(token, run_id, ''), node, branch, generation, attempt, step, "
                "queue, args, timeout, outcome, output, folded, lease_key FROM "
                "eec_workflow_step_attempt WHERE run_id = :r ORDER BY generation, node"
            ),
            "transitions": q(
                "SELECT seq, node, from_status, to_status, replace(reason, :r, '') "
                "FROM eec_workflow_history WHERE run_id = :r ORDER BY seq"
            ),
        }


def _run(d: Ductor, url: str) -> dict[str, Any]:
    with d.local_workers():
        handle = d.start("pgc", input={"a": "x", "c": False, "items": ["i0", "flaky", "i2"]})
        view = d.wait(handle.run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED, view.error
    return _rows(url, handle.run_id)


def test_the_one_statement_commit_writes_what_the_statement_by_statement_commit_writes(
    database_url: str, pg_server: Any, template_db: str, tmp_path: Path, monkeypatch: Any
) -> None:
    used: list[bool] = []
    real = pg_commit.commit

    def counting(*args: Any, **kwargs: Any) -> Any:
        used.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(pg_commit, "commit", counting)
    fast = _run(_app(database_url, tmp_path), database_url)
    assert used, "the one-statement commit was used"
    monkeypatch.setattr(pg_commit, "eligible", lambda payload: False)
    other = f"t_slow_{tmp_path.name[-8:]}".lower()
    pg_server.create_database(other, template=template_db)
    slow_url = pg_server.url(other)
    used.clear()
    slow = _run(_app(slow_url, tmp_path), slow_url)
    assert not used
    assert fast == slow


def test_a_lost_version_race_writes_nothing(database_url: str, tmp_path: Path) -> None:
    from ductor_celery.engine import RunState, TickInputs, compute_tick

    d = _app(database_url, tmp_path)
    run_id = d.start("pgc", input={"a": 1, "c": False, "items": []}).run_id
    spec = d.client.find_definition("pgc")
    payload = compute_tick(spec, RunState(), TickInputs(run_id=run_id, input={"a": 1}), _now())
    assert payload.new_attempts and pg_commit.eligible(payload)
    engine = get_engine(database_url)
    before = _rows(database_url, run_id)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO eec_workflow_timer (run_id, fire_at) VALUES (:r, now()) "
                "ON CONFLICT (run_id) DO NOTHING"
            ),
            {"r": run_id},
        )
    listener = psycopg.connect(**psycopg_connect_args(database_url), autocommit=True)
    listener.execute(f"LISTEN {RUN_FINISHED_CHANNEL}")
    with engine.begin() as conn:
        done = pg_commit.commit(
            conn,
            run_id=run_id,
            version=7,  # the row is at version 0
            run_values={"status": "running", "record_version": 8},
            payload=payload,
            transitions=[
                {"seq": 0, "node": None, "from_status": None, "to_status": "running", "reason": "r"}
            ],
            outbox=[
                {
                    "run_id": run_id,
                    "kind": "step",
                    "task": "pgc.work",
                    "queue": None,
                    "payload": {"token": "t"},
                }
            ],
            now=_now(),
            notify=RUN_FINISHED_CHANNEL,
            timer=("delete", None),
        )
    assert done == (True, True, False, [], None)
    assert _rows(database_url, run_id) == before
    with listener:
        assert not list(listener.notifies(timeout=0.5)), "no notification for a lost race"
    with engine.connect() as conn:
        timers = conn.execute(
            sa.text("SELECT count(*) FROM eec_workflow_timer WHERE run_id = :r"), {"r": run_id}
        ).scalar_one()
    assert timers == 1, "the timer row not deleted by a lost race"
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM eec_workflow_outbox")).scalar() == 0


def _now() -> Any:
    from datetime import UTC, datetime

    return datetime.now(UTC)


def _first_commit(conn: Any, run_id: str, payload: Any) -> pg_commit.Committed:
    """The one-statement commit of ``payload`` on a run at version 0, with no transitions or
    outbox rows."""
    return pg_commit.commit(
        conn,
        run_id=run_id,
        version=0,
        run_values={"record_version": 1},
        payload=payload,
        transitions=[],
        outbox=[],
        now=_now(),
    )


@pytest.mark.parametrize("folded", [[], ["nope"]])
def test_empty_and_unknown_row_sets_are_fine(
    database_url: str, tmp_path: Path, folded: list[str]
) -> None:
    from ductor_celery.engine import RunState, TickInputs, compute_tick

    d = _app(database_url, tmp_path)
    run_id = d.start("pgc", input={"a": 1, "c": False, "items": []}).run_id
    spec = d.client.find_definition("pgc")
    payload = compute_tick(spec, RunState(), TickInputs(run_id=run_id, input={"a": 1}), _now())
    payload.folded = list(folded)
    payload.new_attempts = []
    with get_engine(database_url).begin() as conn:
        done = _first_commit(conn, run_id, payload)
    assert done == (True, True, True, [], None)


_PG_TYPES = {bool: "boolean", int: "bigint", float: "double precision", str: "text"}


def _generic_plan(conn: Any, text: str, params: dict[str, Any]) -> dict[str, Any]:
    """``text`` (psycopg's ``%(name)s`` placeholders) prepared on the server and run by
    ``EXPLAIN ANALYZE`` with its generic plan, the one a connection reuses once it has
    prepared a statement; in the caller's transaction, which rolls back what it wrote."""
    names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", text)))
    positional = re.sub(r"%\((\w+)\)s", lambda m: f"${names.index(m.group(1)) + 1}", text)
    types = [
        "timestamptz" if isinstance(params[n], datetime) else _PG_TYPES[type(params[n])]
        for n in names
    ]
    driver = conn.connection.dbapi_connection
    with psycopg.ClientCursor(driver) as cursor:
        cursor.execute(f"PREPARE probe ({', '.join(types)}) AS {positional}")
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        holes = ", ".join(["%s"] * len(names))
        cursor.execute(
            f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE probe ({holes})", [params[n] for n in names]
        )
        (plan,) = cursor.fetchone()[0]
        cursor.execute("DEALLOCATE probe")
    return plan  # type: ignore[no-any-return]


def _loops(plan: dict[str, Any], table: str) -> int:
    """How many times the plan's scans of ``table`` ran."""
    scan = "Scan" in plan["Node Type"] and plan.get("Relation Name") == table
    here = plan.get("Actual Loops", 0) if scan else 0
    return here + sum(_loops(child, table) for child in plan.get("Plans", []))


@pytest.mark.parametrize("folded", [[], ["t1", "t2"]])
def test_a_commit_with_nothing_to_fold_reads_no_attempt_rows_for_it(
    database_url: str, tmp_path: Path, monkeypatch: Any, folded: list[str]
) -> None:
    """An inline step's eager tick folds its own outcome (the carried CTE), so its commit
    has nothing else to fold: the statement has no folded CTE then (a small table's generic
    plan once scanned it whole, every tick), and one that reads the attempts when there is."""
    from ductor_celery.engine import RunState, TickInputs, compute_tick

    d = _app(database_url, tmp_path)
    run_id = d.start("pgc", input={"a": 1, "c": False, "items": []}).run_id
    spec = d.client.find_definition("pgc")
    payload = compute_tick(spec, RunState(), TickInputs(run_id=run_id, input={"a": 1}), _now())
    payload.folded = list(folded)
    sent: list[tuple[str, dict[str, Any]]] = []

    class Recording:
        """Keeps the statement and its values instead of sending them."""

        def execute(self, text: str, params: dict[str, Any]) -> None:
            sent.append((text, params))

        def fetchone(self) -> Any:
            return True, 1, [], True, None, None

    @contextlib.contextmanager
    def recording(conn: Any) -> Any:
        yield Recording()

    monkeypatch.setattr(pg_commit, "driver_cursor", recording)
    engine = get_engine(database_url)
    with engine.begin() as conn:
        _first_commit(conn, run_id, payload)
    ((text, params),) = sent
    with engine.begin() as conn:
        plan = _generic_plan(conn, text, params)
        conn.rollback()
    ctes = [p for p in plan["Plan"]["Plans"] if p.get("Subplan Name") == "CTE folded"]
    assert plan["Plan"]["Plans"][0]["Actual Rows"] == 1, "the run update matched"
    if not folded:
        assert ctes == [] and "folded" not in params
        return
    (cte,) = ctes
    assert _loops(cte, "eec_workflow_step_attempt") > 0


def test_the_statement_sets_and_deletes_the_timer_row_only_when_the_run_update_matched(
    database_url: str, tmp_path: Path
) -> None:
    """The run's timer row, written by the statement itself (``timer=``), as ``_set_timer``
    writes it after: set (an upsert that clears ``woken_at``), deleted, and neither when the
    run update lost its version race."""
    from datetime import timedelta

    from ductor_celery.engine import RunState, TickInputs, compute_tick

    d = _app(database_url, tmp_path)
    run_id = d.start("pgc", input={"a": 1, "c": False, "items": []}).run_id
    spec = d.client.find_definition("pgc")
    payload = compute_tick(spec, RunState(), TickInputs(run_id=run_id, input={"a": 1}), _now())
    payload.new_attempts = []
    engine = get_engine(database_url)
    fire_at = _now().replace(microsecond=0) + timedelta(minutes=5)

    def timer() -> list[tuple[Any, ...]]:
        with engine.connect() as conn:
            return [
                tuple(r)
                for r in conn.execute(
                    sa.text("SELECT fire_at, woken_at FROM eec_workflow_timer WHERE run_id = :r"),
                    {"r": run_id},
                )
            ]

    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO eec_workflow_timer (run_id, fire_at, woken_at) VALUES "
                "(:r, now(), now()) ON CONFLICT (run_id) DO UPDATE SET woken_at = now()"
            ),
            {"r": run_id},
        )

    def commit(version: int, change: Any) -> pg_commit.Committed:
        with engine.begin() as conn:
            return _bare_commit(conn, run_id, version, payload, timer=change)

    assert commit(7, ("set", fire_at)).matched is False  # at version 0: nothing written
    assert timer()[0][1] is not None
    assert commit(0, ("set", fire_at)).matched
    assert timer() == [(fire_at, None)]
    assert commit(1, ("delete", None)).matched
    assert timer() == []


def _bare_commit(
    conn: Any, run_id: str, version: int, payload: Any, **options: Any
) -> pg_commit.Committed:
    """The one-statement commit of ``payload`` at ``version``, moving only the run's version
    (no transition, no outbox row); ``options``: the commit's others (a timer change)."""
    return pg_commit.commit(
        conn,
        run_id=run_id,
        version=version,
        run_values={"record_version": version + 1},
        payload=payload,
        transitions=[],
        outbox=[],
        now=_now(),
        **options,
    )


def _grown_attempts(database_url: str, rows: int, *, folded: bool, run: str = "grown") -> Any:
    """``support.grow_attempts`` on the database's engine, which it returns."""
    engine = get_engine(database_url)
    grow_attempts(engine, rows, run=run, folded=folded)
    return engine


def _a_run_to_commit(database_url: str, tmp_path: Path) -> tuple[str, Any]:
    """A run just started, and its first tick's payload with no new attempt: a commit of it
    writes the run row and whatever a test folds."""
    from ductor_celery.engine import RunState, TickInputs, compute_tick

    d = _app(database_url, tmp_path)
    run_id = d.start("pgc", input={"a": 1, "c": False, "items": []}).run_id
    spec = d.client.find_definition("pgc")
    payload = compute_tick(spec, RunState(), TickInputs(run_id=run_id, input={"a": 1}), _now())
    payload.new_attempts = []
    return run_id, payload


def _fold(conn: Any, run_id: str, version: int, payload: Any, tokens: list[str]) -> int:
    """A commit of the run at ``version`` that folds ``tokens``, in ``conn``'s transaction:
    the attempt rows it read by scanning the whole table (counted before and after in that
    transaction: a backend reports its counters only between transactions)."""
    payload.folded = tokens
    before = attempts_scanned(conn)
    done = _bare_commit(conn, run_id, version, payload)
    assert done.matched
    return attempts_scanned(conn) - before


def test_on_a_grown_attempts_table_postgresql_keeps_the_commits_generic_plan(
    database_url: str, tmp_path: Path
) -> None:
    """A prepared statement is planned anew at every call when its custom plans look
    cheaper than its generic one: a condition on a parameter that a custom plan folds away
    (an empty list of results to fold) made the commit's generic plan look dearer once the
    attempts table had grown (a scatter's rows), and planning it cost more than running it.
    The list is an array the statement builds (no custom plan can see its length), so the
    generic plan is kept; and a commit with nothing to fold (this one) has no such part."""
    run_id, payload = _a_run_to_commit(database_url, tmp_path)
    payload.folded = []
    engine = _grown_attempts(database_url, 25000, folded=True)
    with engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE eec_workflow_step_attempt")
        conn.commit()
        for _ in range(20):  # psycopg prepares it after 5 calls; PostgreSQL plans 5 custom first
            done = pg_commit.commit(
                conn,
                run_id=run_id,
                version=999,  # no such version: nothing written
                run_values={"record_version": 1000},
                payload=payload,
                transitions=[],
                outbox=[],
                now=_now(),
            )
            conn.rollback()
            assert not done.matched
        generic, custom = conn.exec_driver_sql(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
            "WHERE statement LIKE '%%run_update AS%%'"
        ).one()
    assert generic >= 5 and custom <= 5, (generic, custom)


def test_a_commits_fold_finds_each_result_by_its_key_on_a_grown_table(
    database_url: str, tmp_path: Path
) -> None:
    """The results a commit marks folded are looked up by the primary key, whatever the
    plan PostgreSQL keeps for the statement: on a grown, analyzed attempts table, a commit
    that folds three results reads three rows, not the table (a join to the list was
    planned as a hash join against a scan of every attempt row, at every scatter tick). The
    generic plan is kept (no planning at every call), and the three rows are folded."""
    run_id, payload = _a_run_to_commit(database_url, tmp_path)
    engine = _grown_attempts(database_url, 11000, folded=False)
    read: list[int] = []
    with engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE eec_workflow_step_attempt")
        conn.commit()
        for version in range(20):  # psycopg prepares it after 5 calls; 5 custom plans first
            tokens = [f"grown:s:{3 * version + k}" for k in (1, 2, 3)]
            read.append(_fold(conn, run_id, version, payload, tokens))
            conn.commit()
        generic, _custom = conn.exec_driver_sql(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
            "WHERE statement LIKE '%%folded AS%%'"
        ).one()
        still = conn.exec_driver_sql(
            "SELECT count(*) FROM eec_workflow_step_attempt WHERE run_id = 'grown' AND NOT folded"
        ).scalar_one()
    assert read == [0] * 20, read
    assert generic >= 5, generic
    assert still == 11000 - 60, "each commit folded its three results"


def test_a_plan_made_on_a_small_table_is_made_again_on_a_later_checkout(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prepared statement's plan is kept until its tables are analyzed again: made while
    the attempts table was small, the fold's plan scans the table, and kept scanning it as it
    grew. A pooled connection checked out ``PLANS_REFRESHED_EVERY_S`` after its plans were
    made has them made again (``DISCARD PLANS``), from the table as it is now."""
    from ductor_celery.store import db

    run_id, payload = _a_run_to_commit(database_url, tmp_path)
    engine = _grown_attempts(database_url, 30, folded=False)
    with engine.begin() as conn:
        # This test says when the table is analyzed, not autovacuum.
        conn.exec_driver_sql(
            "ALTER TABLE eec_workflow_step_attempt SET (autovacuum_enabled = false)"
        )
        conn.exec_driver_sql("ANALYZE eec_workflow_step_attempt")
    monkeypatch.setattr(db, "PLANS_REFRESHED_EVERY_S", 3600.0)
    version = 0

    def fold(tokens: list[str]) -> int:
        """One commit folding ``tokens`` on a connection checked out for it: the rows its
        transaction read by scanning the attempts table."""
        nonlocal version
        with engine.connect() as conn:
            scanned = _fold(conn, run_id, version, payload, tokens)
            conn.commit()
        version += 1
        return scanned

    for i in range(12):  # prepared after 5 calls, 5 custom plans, then the generic one
        fold([f"grown:s:{1 + i % 30}"])
    _grown_attempts(database_url, 11000, folded=False, run="more")
    assert fold(["more:s:1"]) >= 11000, "the plan kept from the small table scans it"
    monkeypatch.setattr(db, "PLANS_REFRESHED_EVERY_S", 0.0)
    assert fold(["more:s:2"]) == 0, "made again at this checkout: found by the key"
    assert fold(["more:s:3", "grown:s:5"]) == 0
    with engine.connect() as conn:
        folded = conn.exec_driver_sql(
            "SELECT token FROM eec_workflow_step_attempt WHERE folded AND run_id = 'more'"
        ).scalars()
        assert sorted(folded) == ["more:s:1", "more:s:2", "more:s:3"]


def test_a_connection_lost_while_idle_is_replaced_when_its_plans_are_made_again(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refresh at checkout is a round trip: on a connection the server dropped while it
    sat in the pool, it fails, and the pool hands out a new connection instead (the caller
    never sees the lost one)."""
    from ductor_celery.store import db

    engine = get_engine(database_url)
    with engine.connect() as conn:
        lost = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
    with psycopg.connect(**psycopg_connect_args(database_url), autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (lost,))
    monkeypatch.setattr(db, "PLANS_REFRESHED_EVERY_S", 0.0)
    with engine.connect() as conn:
        now = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
    assert now != lost
