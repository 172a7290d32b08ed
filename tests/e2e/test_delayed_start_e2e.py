"""Issue 14 item 1 with real workers: a delayed run waits, as a timer row, for its start time,
then runs; a cancelled one never starts."""

from __future__ import annotations

import time
from typing import Any

import pytest

from ductor_celery import RunStatus

pytestmark = pytest.mark.e2e


@pytest.fixture
def ductor(shared_cluster: Any, client_for: Any) -> Any:
    return client_for(shared_cluster)


def test_a_delayed_run_starts_at_its_time(ductor: Any, shared_cluster: Any) -> None:
    handle = ductor.start("chain10", input={"value": 5}, delay=2.0)
    time.sleep(1.0)
    assert ductor.get(handle.run_id).status == RunStatus.PENDING
    assert shared_cluster.executions(handle.run_id) == 0
    view = ductor.wait(handle.run_id, timeout=30)
    assert view.status == RunStatus.SUCCEEDED and view.output == 5
    started = view.nodes["s0"].started_at
    assert view.start_at is not None and started is not None and started >= view.start_at


def test_a_cancelled_delayed_run_never_starts(ductor: Any, shared_cluster: Any) -> None:
    handle = ductor.start("chain10", input={"value": 5}, delay=3.0)
    ductor.cancel(handle.run_id, reason="changed my mind")
    view = ductor.wait(handle.run_id, timeout=30)
    assert view.status == RunStatus.CANCELLED
    time.sleep(3.5)  # past its start time: still nothing ran
    assert ductor.get(handle.run_id).status == RunStatus.CANCELLED
    assert shared_cluster.executions(handle.run_id) == 0
