"""Large values by reference (docs/large-values.md) with real workers: a multi-MiB result goes
to ``eec_blob`` once, the next step (on another worker process, or inline on the same one)
reads the value, and the rows and messages carry only the reference."""

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
