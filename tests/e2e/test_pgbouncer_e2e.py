"""Real workers through PgBouncer in transaction pooling mode (issue 24): step workers, the
coordinator and the client on a URL through the pooler with server-side prepares off
(``DUCTOR_DATABASE_PREPARE=false``), ``wait()`` on a direct one
(``DUCTOR_LISTEN_DATABASE_URL``). Enough runs that every pooled connection executes the hot
statements past psycopg's prepare threshold, on a pooler with fewer server connections than
the workers have clients, so consecutive transactions of one client change server connection.
Before, workers logged ``prepared statement "_pg3_N" does not exist`` and runs hung."""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from servers import PgBouncer

from ductor_celery import RunStatus

pytestmark = pytest.mark.e2e


@pytest.fixture
def pooled_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    def make(env: dict[str, str]) -> Any:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        sys.modules.pop("e2e_app", None)
        return importlib.import_module("e2e_app").ductor

    yield make
    sys.modules.pop("e2e_app", None)


def test_workflows_run_through_pgbouncer_in_transaction_mode(
    cluster_factory: Any, pgbouncer: PgBouncer, pooled_client: Any
) -> None:
    log_start = len(pgbouncer.log_text())
    probe = cluster_factory()
    direct = probe.database_url
    pooled = pgbouncer.url(sa.engine.make_url(direct).database or "postgres")
    env = {
        "DUCTOR_DATABASE_URL": pooled,
        "DUCTOR_LISTEN_DATABASE_URL": direct,
        "DUCTOR_DATABASE_PREPARE": "false",
    }
    cluster = probe  # the ledger and attempts read the database directly
    cluster.env.update(env)
    cluster.start_steps(concurrency=3)
    cluster.start_coordinator()
    ductor = pooled_client({**env, "E2E_BROKER_URL": cluster.broker_url})

    began = time.monotonic()
    chains = [ductor.start("chain10", input={"value": i}) for i in range(30)]
    scatters = [ductor.start("scatter", input={"items": list(range(k, k + 12))}) for k in range(4)]
    deadline = began + 45
    views = {h.run_id: ductor.wait(h.run_id, timeout=deadline - time.monotonic()) for h in chains}
    for h in scatters:
        views[h.run_id] = ductor.wait(h.run_id, timeout=deadline - time.monotonic())

    logs = "\n".join(w.log_path.read_text(errors="replace") for w in cluster.workers)
    assert "prepared statement" not in logs, cluster.logs()
    assert [(views[h.run_id].status, views[h.run_id].output) for h in chains] == [
        (RunStatus.SUCCEEDED, i) for i in range(30)
    ]
    for k, h in enumerate(scatters):
        squares = [i * i for i in range(k, k + 12)]
        assert views[h.run_id].status == RunStatus.SUCCEEDED, views[h.run_id].error
        assert views[h.run_id].output == {"squares": squares, "total": sum(squares)}
    # Nothing LISTENs through the pool: PgBouncer would log the notifications arriving on a
    # server connection no client is linked to.
    assert "when not linked" not in pgbouncer.log_text()[log_start:]
