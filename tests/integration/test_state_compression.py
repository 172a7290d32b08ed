"""Migration 0017: the run state compresses with lz4 on a PostgreSQL server that has it
(PostgreSQL compresses a row's large values once the row passes about 2 kB, at every update
of the run row; lz4 costs it less CPU than its default, pglz)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from inline_support import deliver, make_ductor, run_row, start_run

from ductor_celery import StepContext
from ductor_celery.definition import Workflow
from ductor_celery.store.db import get_engine
from ductor_celery.store.migrate import downgrade, upgrade

#: The column's compression method as the catalog says: "l" lz4, "p" pglz, "" the default.
_COLUMN_METHOD = sa.text(
    "SELECT attcompression FROM pg_attribute "
    "WHERE attrelid = 'eec_workflow_run'::regclass AND attname = 'state'"
)
_SERVER_HAS_LZ4 = sa.text(
    "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'"
)


def _method(url: str) -> str:
    with get_engine(url).connect() as conn:
        return str(conn.execute(_COLUMN_METHOD).scalar_one())


def test_the_migration_sets_lz4_on_the_state_and_its_downgrade_takes_it_back(
    pg_server: Any,
) -> None:
    pg_server.create_database("state_lz4")
    url = pg_server.url("state_lz4")
    with get_engine(url).connect() as conn:
        # The test server is PostgreSQL 15 built with lz4: were it not, this test would prove
        # nothing (the migration skips such a server).
        assert conn.execute(_SERVER_HAS_LZ4).scalar() is True
    upgrade(url, "0016")
    assert _method(url) == ""
    upgrade(url)
    assert _method(url) == "l"
    downgrade(url, "0016")
    assert _method(url) == ""
    upgrade(url)
    assert _method(url) == "l"


def test_a_large_run_state_a_tick_writes_is_stored_lz4_compressed_and_reads_back(
    database_url: str,
) -> None:
    """A 40-step chain run inline, each step adding to the run's context: its state passes
    the threshold halfway, and every later tick's version of the row holds it compressed
    with lz4; the run reads back whole. (Its nodes alone would not: a succeeded step's is
    kept by its attempt row, store/done_nodes.py.)"""
    ductor, recorder = make_ductor(database_url)

    def add_one(ctx: StepContext, value: int = 0) -> int:
        ctx.patch({f"note_{value}": f"step {value} was here, and it says so at length"})
        return value + 1

    step = ductor.step(name="lz4.add")(add_one)
    wf = Workflow("lz4chain")
    wf.step("node_0", step, args={"value": 0})
    for i in range(1, 40):
        wf.step(
            f"node_{i}",
            step,
            after=[f"node_{i - 1}"],
            args={"value": f"$.nodes.node_{i - 1}.output"},
        )
    wf.output("$.nodes.node_39.output")
    ductor.register(wf)
    run_id, first = start_run(ductor, "lz4chain", recorder)

    assert deliver(ductor, first) == "succeeded"

    run = run_row(ductor, run_id)
    assert run.status == "succeeded" and run.output == 40
    with ductor.runtime.engine().connect() as conn:
        method, stored, size = conn.execute(
            sa.text(
                "SELECT pg_column_compression(state), pg_column_size(state), "
                "octet_length(state::text) FROM eec_workflow_run WHERE run_id = :run_id"
            ),
            {"run_id": run_id},
        ).one()
    assert method == "lz4"
    assert size > 2048 and stored < size / 2, (stored, size)
    assert ductor.get(run_id).status == "succeeded"
