"""Issue 9 with a real ``celery worker``: a step that raises SystemExit fails its node at once
(its outcome is written before the pool process exits), not after the 300 s step timeout."""

from __future__ import annotations

import time
from typing import Any

import pytest

from ductor_celery import NodeStatus, RunStatus

pytestmark = pytest.mark.e2e


@pytest.fixture
def ductor(shared_cluster: Any, client_for: Any) -> Any:
    return client_for(shared_cluster)


def test_a_step_raising_system_exit_fails_its_node_within_seconds(
    ductor: Any, shared_cluster: Any
) -> None:
    started = time.monotonic()
    view = ductor.wait(ductor.start("e2e_exits").run_id, timeout=30)
    assert time.monotonic() - started < 30
    assert view.status == RunStatus.FAILED, shared_cluster.logs()
    assert view.nodes["exits"].status == NodeStatus.FAILED
    assert view.error["type"] == "SystemExit"
    assert "sys.exit" in view.error["message"]
    assert shared_cluster.executions(view.run_id, "exits") == 1
    # The pool replaced the process that exited: the worker still runs steps.
    again = ductor.wait(ductor.start("diamond", input={"x": 1}).run_id, timeout=30)
    assert again.status == RunStatus.SUCCEEDED, shared_cluster.logs()
