"""An inline step's finish is a HOT update (docs/hot-attempt-finish.md; migration 0019).

The attempt table's three partial indexes name generated columns (``rate_waiting``,
``lease_waiting``, ``unfolded``) instead of ``finished_at`` and ``folded``; an inline step's
carried finish changes none of them, so PostgreSQL writes its new row version as a heap-only
tuple, with no new index entry. On a real PostgreSQL, through production's code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from support import recording_ductor, run_to_end

from ductor_celery import Workflow
from ductor_celery.store import console, leases, load, migrate, rates, sweep, wakes
from ductor_celery.store.db import get_engine
from ductor_celery.store.schema import ATTEMPT_PREDICATES, step_attempt

#: ``t_infomask2``'s flag of a heap-only tuple (PostgreSQL's htup_details.h): the version a
#: HOT update wrote.
HEAP_ONLY_TUPLE = 0x8000


@pytest.fixture
def ductor(database_url: str, tmp_path: Path) -> Any:
    d = recording_ductor(database_url, f"hot{tmp_path.name}")

    @d.step(name="hot.ok")
    def ok(ctx: Any) -> dict[str, int]:
        return {"ok": 1}

    chain = Workflow("hot_chain")
    for i in range(4):
        chain.step(f"s{i}", "hot.ok", after=[f"s{i - 1}"] if i else [])
    d.register(chain)
    return d


def _heap_only(engine: Any, run_id: str) -> dict[str, bool]:
    """Each attempt row of the run (by node): whether its current version is a heap-only
    tuple (``pageinspect`` on the row's own page)."""
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE EXTENSION IF NOT EXISTS pageinspect")
        rows = conn.exec_driver_sql(
            "SELECT a.node, (p.t_infomask2 & %(flag)s) <> 0 "
            "FROM eec_workflow_step_attempt a, "
            "LATERAL heap_page_items(get_raw_page('eec_workflow_step_attempt', "
            "    (a.ctid::text::point)[0]::int)) p "
            "WHERE a.run_id = %(run)s AND p.lp = (a.ctid::text::point)[1]::int",
            {"flag": HEAP_ONLY_TUPLE, "run": run_id},
        ).all()
    return dict(rows)  # type: ignore[arg-type]


def test_an_inline_steps_finish_writes_no_index_entry(ductor: Any) -> None:
    """Every attempt of a 4-step inline chain is finished by a tick's commit that carries its
    outcome: each row's current version is heap-only, the version a HOT update writes, with
    no index entry of its own."""
    engine = ductor.runtime.engine()
    run_id = run_to_end(ductor, "hot_chain", {})
    assert ductor.get(run_id).status == "succeeded"
    assert _heap_only(engine, run_id) == {f"s{i}": True for i in range(4)}
    with engine.connect() as conn:
        finished = conn.execute(
            sa.select(
                step_attempt.c.unfolded, step_attempt.c.lease_waiting, step_attempt.c.rate_waiting
            ).where(step_attempt.c.run_id == run_id)
        ).all()
    assert finished == [(False, False, False)] * 4


def test_an_outcome_written_alone_still_changes_the_unfolded_index(
    ductor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The contrast: an outcome written alone (no eager tick to carry it) makes the row
    unfolded, an index's predicate, so that finish is a full update, as before; the tick that
    folds it later finds it through the index."""
    settings = dataclasses.replace(ductor.runtime.settings, eager_ticks=False)
    monkeypatch.setattr(ductor.runtime, "settings", settings)
    engine = ductor.runtime.engine()
    run_id = run_to_end(ductor, "hot_chain", {})
    assert ductor.get(run_id).status == "succeeded"
    assert set(_heap_only(engine, run_id).values()) == {False}


def _plans(engine: Any, call: Callable[[], Any], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The plans of the statements on the attempt table that ``call`` sends to psycopg
    (through SQLAlchemy or straight to its cursor), each explained again with its own
    parameters and sequential scans off (a table this small would be scanned whole whatever
    its indexes)."""
    import psycopg

    seen: list[tuple[str, Any]] = []
    execute = psycopg.Cursor.execute

    def record(cursor: Any, query: Any, params: Any = None, *args: Any, **kwargs: Any) -> Any:
        text = str(query)
        if "eec_workflow_step_attempt" in text and text.lstrip().startswith(("SELECT", "WITH")):
            seen.append((text, params))
        return execute(cursor, query, params, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(psycopg.Cursor, "execute", record)
        call()
    assert seen, "the call read no attempt row"
    plans = []
    with engine.connect() as conn:
        conn.exec_driver_sql("SET enable_seqscan = off")
        cursor = conn.connection.driver_connection.cursor()
        for statement, params in seen:
            cursor.execute("EXPLAIN " + statement, params)
            plans.append("\n".join(r[0] for r in cursor.fetchall()))
    return plans


def _on(engine: Any, read: Callable[[Any], Any]) -> Any:
    with engine.connect() as conn:
        return read(conn)


@pytest.mark.parametrize(
    ("index", "reader"),
    [
        ("unfolded", lambda e: sweep.unfolded_runs(e, older_than=0)),
        ("unfolded", lambda e: wakes.clear_wake(e, "r")),
        ("lease_wait", lambda e: console.lease_waiters(e)),
        ("lease_wait", lambda e: sweep.lease_keys_to_sweep(e, now=datetime.now(UTC))),
        ("lease_wait", lambda e: _on(e, lambda c: leases._has_waiters(c, "s|k", {"t"}))),
        ("rate_wait", lambda e: rates.keys_with_waiters(e)),
        (
            "rate_wait",
            lambda e: _on(e, lambda c: rates.older_waiter(c, "s|k", datetime.now(UTC), "t")),
        ),
    ],
    ids=[
        "sweeper-unfolded",
        "settled-run",
        "console-lease",
        "sweeper-lease",
        "lease-waiters",
        "rate-keys",
        "rate-line",
    ],
)
def test_the_readers_ask_what_the_indexes_hold(
    database_url: str, index: str, reader: Callable[[Any], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partial index serves a query only if the query's WHERE implies its predicate, and
    PostgreSQL cannot see what a generated column holds: each reader names the column."""
    engine = get_engine(database_url)
    plans = _plans(engine, lambda: reader(engine), monkeypatch)
    assert any(f"eec_workflow_step_attempt_{index}" in p for p in plans), plans


def test_the_runs_unfolded_results_are_read_through_the_index(database_url: str) -> None:
    engine = get_engine(database_url)
    with engine.connect() as conn:
        conn.exec_driver_sql("SET enable_seqscan = off")
        plan = conn.exec_driver_sql(
            "EXPLAIN " + str(load._results_statement().compile(engine)), {"b_run": "r"}
        ).all()
    assert "eec_workflow_step_attempt_unfolded" in "\n".join(r[0] for r in plan)


#: Rows of every combination the three predicates tell apart, as 0018 held them.
_ROWS = [
    {"finished_at": finished, "folded": folded, "lease_key": lease, "rate_wait_since": wait}
    for finished in (None, datetime(2026, 1, 1, tzinfo=UTC))
    for folded in (False, True)
    for lease in (None, "step:k")
    for wait in (None, datetime(2026, 1, 1, tzinfo=UTC) - timedelta(seconds=5))
]


def _expected(row: dict[str, Any]) -> tuple[bool, bool, bool]:
    open_ = row["finished_at"] is None
    return (
        row["rate_wait_since"] is not None and open_,
        row["lease_key"] is not None and open_,
        not open_ and not row["folded"],
    )


def _insert_0018_rows(url: str) -> None:
    with get_engine(url).begin() as conn:
        for n, row in enumerate(_ROWS):
            conn.execute(
                sa.text(
                    "INSERT INTO eec_workflow_step_attempt (token, run_id, node, generation, "
                    "attempt, step, args, timeout, finished_at, folded, lease_key, "
                    "rate_wait_since) VALUES (:token, 'r', :node, 1, 1, 's', '{}', 60, "
                    ":finished_at, :folded, :lease_key, :rate_wait_since)"
                ),
                {"token": f"r:n{n}:1", "node": f"n{n}", **row},
            )


def _computed(url: str) -> list[tuple[bool, bool, bool]]:
    a = step_attempt.c
    with get_engine(url).connect() as conn:
        rows = conn.execute(
            sa.select(a.rate_waiting, a.lease_waiting, a.unfolded).order_by(
                sa.cast(sa.func.substr(a.node, 2), sa.Integer)
            )
        ).all()
    return [tuple(r) for r in rows]  # type: ignore[misc]


def _index_predicates(url: str) -> dict[str, str]:
    with get_engine(url).connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT indexname, indexdef FROM pg_indexes "
            "WHERE tablename = 'eec_workflow_step_attempt' AND indexdef LIKE '%%WHERE%%'"
        ).all()
    return {
        name.removeprefix("eec_workflow_step_attempt_"): d.split("WHERE")[1] for name, d in rows
    }


def test_the_migration_computes_the_columns_of_existing_rows_and_goes_back(pg_server: Any) -> None:
    """Upgrading from 0018 computes each existing row's three columns as its old predicates;
    the downgrade puts the indexes back on them."""
    pg_server.create_database("hot_mig")
    url = pg_server.url("hot_mig")
    migrate.upgrade(url, "0018")
    _insert_0018_rows(url)
    migrate.upgrade(url)
    assert _computed(url) == [_expected(r) for r in _ROWS]
    assert _index_predicates(url) == {
        "rate_wait": " rate_waiting",
        "lease_wait": " lease_waiting",
        "unfolded": " unfolded",
    }
    migrate.downgrade(url, "0018")
    old = _index_predicates(url)
    assert "finished_at IS NOT NULL" in old["unfolded"] and "NOT folded" in old["unfolded"]
    assert (
        "lease_key IS NOT NULL" in old["lease_wait"] and "finished_at IS NULL" in old["lease_wait"]
    )
    assert "rate_wait_since IS NOT NULL" in old["rate_wait"]
    with get_engine(url).connect() as conn:
        columns = {c["name"] for c in sa.inspect(conn).get_columns("eec_workflow_step_attempt")}
    assert not columns & set(ATTEMPT_PREDICATES)


def test_the_migration_on_sqlite(tmp_path: Path) -> None:
    """The same on SQLite, which rebuilds the table (and the history view around it)."""
    url = f"sqlite:///{tmp_path}/ductor.sqlite3"
    migrate.upgrade(url, "0018")
    _insert_0018_rows(url)
    migrate.upgrade(url)
    assert _computed(url) == [_expected(r) for r in _ROWS]
    with get_engine(url).connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM eec_workflow_history").scalar() == 0
        sql = dict(
            conn.exec_driver_sql(
                "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql LIKE '%WHERE%'"
                " AND tbl_name = 'eec_workflow_step_attempt'"
            ).all()
        )
    assert {name: text.split("WHERE")[1] for name, text in sql.items()} == {
        "eec_workflow_step_attempt_rate_wait": " rate_waiting = 1",
        "eec_workflow_step_attempt_lease_wait": " lease_waiting = 1",
        "eec_workflow_step_attempt_unfolded": " unfolded = 1",
    }
    migrate.downgrade(url, "0018")
    with get_engine(url).connect() as conn:
        columns = {c["name"] for c in sa.inspect(conn).get_columns("eec_workflow_step_attempt")}
        assert conn.exec_driver_sql("SELECT count(*) FROM eec_workflow_step_attempt").scalar() == 16
    assert not columns & set(ATTEMPT_PREDICATES)


def test_a_sqlite_too_old_for_the_schema_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sqlite3

    monkeypatch.setattr(sqlite3, "sqlite_version_info", (3, 30, 1))
    monkeypatch.setattr(sqlite3, "sqlite_version", "3.30.1")
    url = f"sqlite:///{tmp_path}/old.sqlite3"
    with pytest.raises(RuntimeError, match=r"needs SQLite 3\.31\.0 or later.*SQLite 3\.30\.1"):
        migrate.upgrade(url)
    with get_engine(url).connect() as conn:
        assert sa.inspect(conn).get_table_names() == []


def test_the_migration_and_the_schema_say_the_same_predicates() -> None:
    """Migration 0019 is a snapshot of ``schema.ATTEMPT_PREDICATES`` (a migration must not
    change with the code): the two agree, and each index of the schema is on its column.
    Alembic's comparison of a migrated database with the schema sees neither generated
    expressions nor index predicates."""
    from alembic.script import ScriptDirectory

    scripts = ScriptDirectory.from_config(migrate.alembic_config("sqlite://"))
    migration = scripts.get_revision("0019").module
    assert migration._COLUMNS == ATTEMPT_PREDICATES
    by_name = {i.name: i for i in step_attempt.indexes}
    for name, (keys, column) in migration._INDEXES.items():
        index = by_name[name]
        assert tuple(c.name for c in index.columns) == keys
        assert str(index.dialect_options["postgresql"]["where"]) == column
        assert str(index.dialect_options["sqlite"]["where"]) == f"{column} = 1"
    for column, expression in ATTEMPT_PREDICATES.items():
        assert step_attempt.c[column].computed.sqltext.text == expression
        assert step_attempt.c[column].computed.persisted
