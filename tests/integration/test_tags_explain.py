"""A tag filter over a million runs is an index scan (docs/tags.md, "Measured").

1,000,000 runs are generated set-wise in SQL (``generate_series`` on PostgreSQL, a recursive
CTE on SQLite), each with two tags: ``customer`` (10,000 values, 100 runs each) and ``region``
(4 values). The statement ``list_runs(tags=...)`` sends is captured as it is sent and
explained with the same parameters: the plan must read ``eec_run_tag`` through
``eec_run_tag_key_value`` and scan neither the tags nor the runs table. The generation time
and the call's time are printed (``-s``) for docs/tags.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event

from ductor_celery.definition import Workflow
from ductor_celery.store import runs
from ductor_celery.store.db import get_engine
from ductor_celery.store.migrate import upgrade

RUNS = 1_000_000
CUSTOMERS = 10_000

#: The rows, from one sequence of integers ``i`` (PostgreSQL and SQLite spell it alike).
_RUN_ROW = (
    "SELECT 'run-' || i, 'wf-' || i, 'bulk', 1, :spec_hash, 'succeeded', '{{}}', "
    "{created}, {created}, 0, 0, 0 FROM {series}"
)
_RUN_COLUMNS = (
    "run_id, workflow_id, workflow, version, spec_hash, status, state, created_at, updated_at, "
    "record_version, transition_count, priority"
)
_TAG_ROWS = (
    "SELECT 'run-' || i, 'customer', 'c-' || (i % {customers}) FROM {series} "
    "UNION ALL SELECT 'run-' || i, 'region', 'r-' || (i % 4) FROM {series}"
)


@pytest.fixture(params=["postgresql", "sqlite"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'million.sqlite3'}"
        upgrade(url)
    else:
        url = request.getfixturevalue("database_url")
    found = get_engine(url)
    yield found
    found.dispose()


def _generate(engine: Any) -> float:
    wf = Workflow("bulk")
    wf.sleep("nap", seconds=1)
    spec = wf.build()
    runs.save_definition(engine, spec)
    started = time.monotonic()
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            series = f"generate_series(1, {RUNS}) AS i"
            created = "now() - i * interval '1 second'"
            prefix = ""
        else:
            series = "n"
            created = "datetime('now', '-' || i || ' seconds')"
            prefix = (
                f"WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {RUNS}) "
            )
        run_rows = _RUN_ROW.format(series=series, created=created)
        conn.execute(
            sa.text(f"INSERT INTO eec_workflow_run ({_RUN_COLUMNS}) {prefix}{run_rows}"),
            {"spec_hash": spec.spec_hash},
        )
        tag_rows = _TAG_ROWS.format(customers=CUSTOMERS, series=series)
        conn.execute(sa.text(f"INSERT INTO eec_run_tag (run_id, key, value) {prefix}{tag_rows}"))
    with engine.begin() as conn:
        conn.execute(sa.text("ANALYZE"))
    return time.monotonic() - started


def _captured(engine: Any, tags: dict[str, str]) -> tuple[str, Any, list[Any], float]:
    """Call ``list_runs(tags=...)`` and catch the statement it sends: (SQL, parameters, the
    runs it returned, seconds the call took)."""
    seen: list[tuple[str, Any]] = []

    def listen(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        if "eec_run_tag" in statement:
            seen.append((statement, params))

    event.listen(engine, "before_cursor_execute", listen)
    try:
        started = time.monotonic()
        found, _ = runs.list_runs(engine, where=runs.RunFilter(tags=tuple(tags.items())))
        took = time.monotonic() - started
    finally:
        event.remove(engine, "before_cursor_execute", listen)
    assert len(seen) == 1, seen
    return seen[0][0], seen[0][1], found, took


def _plan(engine: Any, statement: str, params: Any) -> str:
    with engine.connect() as conn:
        raw = conn.connection.dbapi_connection
        cursor = raw.cursor()
        try:
            if conn.dialect.name == "postgresql":
                cursor.execute("EXPLAIN " + statement, params)
            else:
                cursor.execute("EXPLAIN QUERY PLAN " + statement, params)
            rows = cursor.fetchall()
        finally:
            cursor.close()
    return "\n".join(" ".join(str(c) for c in row) for row in rows)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_tag_filter_over_a_million_runs_uses_the_tag_index(engine: Any) -> None:
    dialect = engine.dialect.name
    generated = _generate(engine)
    print(  # noqa: T201 - the figures docs/tags.md quotes, with -s
        f"\n[{dialect}] generated {RUNS:,} runs and {2 * RUNS:,} tags in {generated:.1f} s"
    )
    for tags in ({"customer": "c-4242"}, {"customer": "c-4242", "region": "r-2"}):
        statement, params, found, took = _captured(engine, tags)
        # i % 10000 == 4242: 100 runs; those with i % 4 == 2 as well: all 100 (4242 % 4 == 2).
        assert len(found) == 50 and all(r.run_id.endswith("4242") for r in found)
        plan = _plan(engine, statement, params)
        print(f"[{dialect}] list_runs(tags={tags}): {took * 1000:.1f} ms\n{plan}")  # noqa: T201
        assert "eec_run_tag_key_value" in plan, plan
        if dialect == "postgresql":
            assert "Seq Scan" not in plan, plan
        else:
            # SQLite says "SCAN <table>" for a full scan, "SEARCH ... USING INDEX" otherwise.
            lines = [line for line in plan.splitlines() if " SCAN " in f" {line} "]
            assert not [x for x in lines if "eec_run_tag" in x or "eec_workflow_run" in x], plan
        assert took < 1.0, took
