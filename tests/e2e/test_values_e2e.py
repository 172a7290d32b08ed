"""Issue 15, items 1 and 2 with real worker processes: a model and a dataclass cross processes
by their import path, and a secret used every careless way by a step leaves no trace in any
``eec_`` table, in any broker message (every Redis command, seen with MONITOR) or in any log
line of the workers."""

from __future__ import annotations

import base64
import binascii
import importlib
import re
import sys
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from ductor_celery import RunStatus

pytestmark = pytest.mark.e2e

SECRET = "sk_live_Q9x7-e2e-never-anywhere"


@pytest.fixture
def values_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """values_app's module in this process (which has no secret), pointed at a cluster."""

    def make(cluster: Any) -> Any:
        monkeypatch.delenv("DUCTOR_SECRET_STRIPE", raising=False)
        monkeypatch.setenv("DUCTOR_DATABASE_URL", cluster.database_url)
        monkeypatch.setenv("E2E_BROKER_URL", cluster.broker_url)
        sys.modules.pop("values_app", None)
        return importlib.import_module("values_app")

    yield make
    sys.modules.pop("values_app", None)


class _Monitor(threading.Thread):
    """Every command the Redis server receives (kombu's messages, events, acks)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url)
        self.commands: list[str] = []
        self.ready = threading.Event()
        self.done = threading.Event()

    def run(self) -> None:
        with self.client.monitor() as monitor:
            self.ready.set()
            self.client.ping()  # wake next_command below at least once
            while not self.done.is_set():
                self.commands.append(str(monitor.next_command().get("command", "")))


_BASE64 = re.compile(r"[A-Za-z0-9+/]{12,}={0,2}")


def _decoded(text: str) -> str:
    """``text`` and every base64 run inside it decoded (kombu base64-encodes bodies)."""
    out = [text]
    for chunk in _BASE64.findall(text):
        for cut in range(4):  # a run may start mid-quad in an escaped string
            part = chunk[cut:]
            part = part[: len(part) - len(part) % 4]
            try:
                out.append(base64.b64decode(part).decode("utf-8", "replace"))
            except (binascii.Error, ValueError):
                continue
    return "\n".join(out)


def _every_row(engine: Any) -> str:
    with engine.connect() as conn:
        tables = [t for t in sa.inspect(conn).get_table_names() if t.startswith("eec_")]
        return "\n".join(
            repr(tuple(row)) for t in tables for row in conn.execute(sa.text(f"SELECT * FROM {t}"))
        )


def test_a_secret_leaves_no_trace_in_tables_messages_or_logs(
    cluster_factory: Any, values_client: Any
) -> None:
    cluster = cluster_factory(app="values_app", DUCTOR_SECRET_STRIPE=SECRET)
    monitor = _Monitor(cluster.broker_url)
    monitor.start()
    assert monitor.ready.wait(10)
    cluster.start_coordinator()
    cluster.start_steps(concurrency=2)
    app = values_client(cluster)
    order = app.Order(id=uuid.UUID(int=5), total=Decimal("12.34"), placed=datetime.now(UTC))
    at = datetime(2024, 6, 1, 12, 0, tzinfo=UTC)
    handle = app.ductor.start("values_pay", input={"order": order, "at": at})
    view = app.ductor.wait(handle.run_id, timeout=60)
    monitor.done.set()
    redis.Redis.from_url(cluster.broker_url).ping()  # unblock the monitor's last read

    assert view.status == RunStatus.SUCCEEDED, (view.error, cluster.logs())
    receipt = view.output["receipt"]
    assert isinstance(receipt, app.Receipt) and receipt.note == "paid with ***"
    assert receipt == app.Receipt(order.id, Decimal("12.34"), at, "paid with ***")
    assert view.output["check"] == {"same_order": True, "charged": Decimal("12.34")}
    assert view.nodes["pay"].attempts == 2  # the first one raised with the key in its message
    assert view.context == {"last_key": "***"}

    rows = _every_row(cluster.engine)
    assert "$.secret.stripe" in rows and "gateway refused key ***" in rows
    assert SECRET not in rows

    commands = "\n".join(monitor.commands)
    assert "ductor-steps" in commands  # the capture saw the step messages
    assert SECRET not in _decoded(commands)

    for worker in cluster.workers:
        worker.stop()
    logs = "\n".join(w.log_path.read_text(errors="replace") for w in cluster.workers)
    assert "charging" in logs and "stdout: key ***" in logs  # the lines were written...
    assert SECRET not in logs  # ...without the key
