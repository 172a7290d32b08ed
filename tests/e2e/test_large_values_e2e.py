"""Large values by reference (docs/large-values.md) with real workers: a multi-MiB result goes
to ``eec_blob`` once, the next step (on another worker process, or inline on the same one)
reads the value, and the rows carry only the reference (messages carry tokens, never values:
every one is sent, none is left in the outbox); a batched scatter's large item results go by
reference too."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from ductor_celery import RunStatus
from ductor_celery.definition.blobrefs import ref_of
from ductor_celery.store.schema import blob, step_attempt, workflow_outbox

pytestmark = pytest.mark.e2e

MIB = 1024 * 1024


@pytest.fixture
def ductor(shared_cluster: Any, client_for: Any) -> Any:
    return client_for(shared_cluster)


def test_a_multi_mib_value_through_a_two_step_run(ductor: Any, shared_cluster: Any) -> None:
    size = 6 * MIB
    handle = ductor.start("big_two", input={"size": size})
    view = ductor.wait(handle.run_id, timeout=120)
    assert view.status == RunStatus.SUCCEEDED, view.error
    assert view.output == {"length": size, "all_x": True}
    assert view.nodes["big"].output == "x" * size  # the view reads the value back
    with ductor.client.engine.connect() as conn:
        rows = {
            r.node: r
            for r in conn.execute(
                sa.select(step_attempt).where(step_attempt.c.run_id == handle.run_id)
            )
        }
        chunks = list(conn.execute(sa.select(blob).where(blob.c.run_id == handle.run_id)))
        outbox = list(
            conn.execute(
                sa.select(workflow_outbox).where(workflow_outbox.c.run_id == handle.run_id)
            )
        )
    ref = ref_of(rows["big"].output)
    assert ref is not None and ref.size == size + 2
    assert rows["measure"].args == {"text": rows["big"].output}  # the reference travelled
    assert {c.id for c in chunks} == {ref.id}
    assert sum(len(c.data) for c in chunks) == size + 2
    assert len(chunks) == 7 and all(len(c.data) <= MIB for c in chunks)
    assert outbox == []  # every message sent (they carry tokens, never values)
    assert shared_cluster.executions(handle.run_id) == 2


def test_a_batched_scatter_with_large_item_results(ductor: Any, shared_cluster: Any) -> None:
    """Each item's result over the offload threshold (256 KiB) is its own blob; the batch's
    output list holds the references and the run's output reads back the values."""
    sizes = [300_000, 10, 300_001]
    handle = ductor.start("big_batch", input={"sizes": sizes})
    view = ductor.wait(handle.run_id, timeout=120)
    assert view.status == RunStatus.SUCCEEDED, view.error
    assert view.output == ["x" * n for n in sizes]
    with ductor.client.engine.connect() as conn:
        outputs = [
            r.output
            for r in conn.execute(
                sa.select(step_attempt.c.output).where(step_attempt.c.run_id == handle.run_id)
            )
        ]
        blob_ids = set(
            conn.execute(sa.select(blob.c.id).where(blob.c.run_id == handle.run_id)).scalars()
        )
    items = [item for out in outputs if isinstance(out, list) for item in out]
    held = [ref_of(item) for item in items]
    assert sorted(r.size for r in held if r is not None) == [300_002, 300_003]
    assert items.count("x" * 10) == 1  # a small result stays inline
    assert {r.id for r in held if r is not None} == blob_ids
