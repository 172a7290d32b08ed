"""A run's input is read by its first tick only: every later tick of the process takes it from
the per-database cache (a scatter's item list decoded by every tick made big scatters cost
quadratic time). Two databases never share an entry, even for the same run id."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from support import load_tick

from ductor_celery.definition import Workflow
from ductor_celery.engine import EngineConfig
from ductor_celery.store import runs
from ductor_celery.store.db import get_engine

SPEC = Workflow("w").wait_signal("s", signal="go").build()


def _load(url: str, run_id: str) -> Any:
    found = load_tick(get_engine(url), run_id, lambda _h: SPEC, EngineConfig())
    assert found is not None
    return found[2].input


def _insert(url: str, run_id: str, value: Any) -> None:
    runs.save_definition(get_engine(url), SPEC)
    runs.insert_run(get_engine(url), run_id=run_id, workflow_id=run_id, spec=SPEC, input=value)


def test_only_the_first_load_reads_the_input(database_url: str) -> None:
    _insert(database_url, "r1", {"items": list(range(5))})
    assert _load(database_url, "r1") == {"items": [0, 1, 2, 3, 4]}
    with get_engine(database_url).begin() as conn:  # what no code does: change it by hand
        conn.execute(
            sa.text("UPDATE eec_workflow_run SET input = '{\"x\": 1}' WHERE run_id = 'r1'")
        )
    assert _load(database_url, "r1") == {"items": [0, 1, 2, 3, 4]}


def test_two_databases_keep_their_own_inputs_for_one_run_id(
    database_url: str, pg_server: Any, template_db: str
) -> None:
    pg_server.create_database("other_inputs", template=template_db)
    other = pg_server.url("other_inputs")
    _insert(database_url, "r1", "first")
    _insert(other, "r1", "second")
    assert _load(database_url, "r1") == "first"
    assert _load(other, "r1") == "second"
