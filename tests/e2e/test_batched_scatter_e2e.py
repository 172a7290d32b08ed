"""Batched scatter with real worker processes: a step worker SIGKILLed in the middle of a
batch. The batch's checkpoints (at most a second apart) are its heartbeats, so the attempt is
declared lost within the heartbeat timeout, and its retry runs only the items the killed
attempt had not checkpointed."""

from __future__ import annotations

import time
from typing import Any

import pytest
import sqlalchemy as sa

from ductor_celery import RunStatus

pytestmark = pytest.mark.e2e


def _item_runs(cluster: Any, run_id: str) -> dict[int, int]:
    with cluster.engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT node, count(*) FROM e2e_ledger WHERE run_id = :r GROUP BY node"),
            {"r": run_id},
        )
        return {int(node.split("[")[1].rstrip("]")): int(n) for node, n in rows}


@pytest.mark.parametrize("eager", ["1", "0"])
def test_sigkill_mid_batch_reruns_only_the_items_without_a_recorded_output(
    cluster_factory: Any, client_for: Any, eager: str
) -> None:
    cluster = cluster_factory(E2E_EAGER=eager)
    cluster.start_coordinator()
    steps = cluster.start_steps(concurrency=1)
    ductor = client_for(cluster)
    handle = ductor.start("e2e_batched", input={"items": list(range(10)), "pause": 0.3})
    deadline = time.monotonic() + 30
    while sum(_item_runs(cluster, handle.run_id).values()) < 6:  # past its first checkpoint
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.05)
    steps.kill()  # SIGKILL the worker and its pool child in the middle of the batch
    cluster.start_steps(concurrency=1, name="steps-again")
    view = ductor.wait(handle.run_id, timeout=40)
    assert view.status == RunStatus.SUCCEEDED, cluster.logs()
    assert view.output == [2 * i for i in range(10)]
    with cluster.engine.connect() as conn:
        killed = conn.execute(
            sa.text(
                "SELECT outcome, output FROM eec_workflow_step_attempt "
                "WHERE run_id = :r AND attempt = 1"
            ),
            {"r": handle.run_id},
        ).one()
    assert killed.outcome == "timed_out"
    checkpointed = {int(i) for i in killed.output["done"]}
    assert checkpointed, "the killed attempt had checkpointed some items"
    runs = _item_runs(cluster, handle.run_id)
    assert set(runs) == set(range(10))
    # A checkpointed item never runs again; one after the checkpoint runs at most twice.
    assert all(runs[i] == 1 for i in checkpointed), runs
    assert all(count <= 2 for count in runs.values()), runs
    assert sum(runs.values()) < 20
