"""Issue 22, item 1 on a real prefork worker: an envelope naming ``lib2to3.__main__`` (whose
import raises SystemExit) ended the pool child that decoded it, the run then hung until a
misleading StepTimeout and the message was reported as "dropped" after its claim. Now the step
gets the dict it was sent at once, and a declared class that raises SystemExit while it is
rebuilt fails its attempt without retry, naming the argument; no child exits either way."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from ductor_celery import NodeStatus, RunStatus

pytestmark = pytest.mark.e2e

EXITS = {"__type__": "dataclass", "__value__": {"class": "lib2to3.__main__:X", "fields": {}}}


@pytest.fixture
def hostile_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    def make(cluster: Any) -> Any:
        monkeypatch.setenv("DUCTOR_DATABASE_URL", cluster.database_url)
        monkeypatch.setenv("E2E_BROKER_URL", cluster.broker_url)
        sys.modules.pop("hostile_app", None)
        return importlib.import_module("hostile_app").ductor

    yield make
    sys.modules.pop("hostile_app", None)


def test_envelopes_naming_classes_end_no_pool_child(
    cluster_factory: Any, hostile_client: Any
) -> None:
    cluster = cluster_factory(app="hostile_app")
    cluster.start_coordinator()
    steps = cluster.start_steps(concurrency=2)
    children = sorted(steps.child_pids())
    ductor = hostile_client(cluster)

    view = ductor.wait(ductor.start("hostile_echo", input={"value": EXITS}).run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED, (view.error, cluster.logs())
    assert view.output["type"] == "dict" and view.output["value"] == EXITS
    assert view.output["imported"] == []
    assert view.nodes["echo"].attempts == 1

    poisoned = {
        "__type__": "pydantic",
        "__value__": {"class": "hostile_app:Guarded", "data": {"n": 13}},
    }
    view = ductor.wait(ductor.start("hostile_guarded", input={"g": poisoned}).run_id, timeout=60)
    assert view.status == RunStatus.FAILED
    node = view.nodes["guarded"]
    assert node.status == NodeStatus.FAILED and node.attempts == 1
    assert node.error["type"] == "InvalidArgument"
    assert "parameter 'g'" in node.error["message"] and "SystemExit" in node.error["message"]

    assert sorted(steps.child_pids()) == children  # no pool child exited
    logs = cluster.logs()
    assert "dropped" not in logs and "WorkerLostError" not in logs, logs
