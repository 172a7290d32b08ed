"""Issue 14 item 4 with real processes: two ``celery worker -Q ductor-coord`` coordinators fire
an ``every=1`` schedule, each fire time exactly once, and catch up the fire times they missed
while both were down."""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from ductor_celery import RunStatus

pytestmark = pytest.mark.e2e


def _fired(cluster: Any) -> list[tuple[datetime, str]]:
    with cluster.engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT workflow_id, run_id FROM eec_workflow_run WHERE workflow_id LIKE 'tick@%'"
            )
        ).all()
    return sorted((datetime.fromisoformat(wid.split("@", 1)[1]), run_id) for wid, run_id in rows)


def _contiguous(times: list[datetime]) -> bool:
    return all(b - a == timedelta(seconds=1) for a, b in zip(times, times[1:], strict=False))


def test_two_coordinators_fire_an_every_1_schedule_once_per_second(
    cluster_factory: Any, client_for: Any
) -> None:
    cluster = cluster_factory(E2E_SWEEP_INTERVAL="0.2")
    cluster.start_steps(concurrency=2)
    first = cluster.start_coordinator("coord_a")
    second = cluster.start_coordinator("coord_b")
    ductor = client_for(cluster)
    view = ductor.schedule("tick", workflow="chain10", every=1, input={"value": 1}, overlap="allow")
    assert view.next_fire_at is not None
    deadline = time.monotonic() + 30
    while len(_fired(cluster)) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    fired = _fired(cluster)
    assert len(fired) >= 4, cluster.logs()
    times = [t for t, _ in fired]
    assert len(set(times)) == len(times), "one run per fire time, with two coordinators"
    assert _contiguous(times), times
    assert times[0] >= view.next_fire_at

    # Both coordinators go down; the schedule's fire times keep coming.
    first.stop()
    second.stop()
    down_from = _fired(cluster)[-1][0]
    time.sleep(3.0)
    cluster.start_coordinator("coord_c")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        times = [t for t, _ in _fired(cluster)]
        if times[-1] >= down_from + timedelta(seconds=5):
            break
        time.sleep(0.2)
    ductor.unschedule("tick")
    fired = _fired(cluster)
    times = [t for t, _ in fired]
    assert len(set(times)) == len(times)
    assert _contiguous(times), f"the missed fire times were caught up: {times}"
    assert times[-1] >= down_from + timedelta(seconds=5)
    views = [ductor.wait(run_id, timeout=60) for _, run_id in fired]
    assert all(v.status == RunStatus.SUCCEEDED and v.output == 1 for v in views), [
        (v.workflow_id, v.status) for v in views if v.status != RunStatus.SUCCEEDED
    ]
