"""``ductor doctor``: the checks an operator wants before trusting a deployment.

Celery happily routes tasks to a queue nobody consumes (``task_create_missing_queues``), and
they pile up in silence, so "a worker consumes each ductor queue" is a check of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import sqlalchemy as sa

if TYPE_CHECKING:
    from .ductor import Ductor


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{exc.__class__.__name__}: {text.splitlines()[0] if text else ''}"


def _server(conn: sa.Connection) -> tuple[str, bool]:
    """Which PostgreSQL server answered (a multi-host URL names several), and whether it is
    a standby; nothing to say on SQLite."""
    if conn.dialect.name != "postgresql":
        return "", False
    row = conn.execute(
        sa.text("SELECT inet_server_addr()::text, inet_server_port(), pg_is_in_recovery()")
    ).one()
    where = f"{row[0].split('/')[0]}:{row[1]}" if row[0] else "the local socket"
    return f"answered by {where}", bool(row[2])


def run_checks(d: Ductor, timeout: float = 2.0) -> list[Check]:
    from .store.db import get_engine
    from .store.migrate import current_revision, head_revision

    settings = d.settings
    checks: list[Check] = []
    url = sa.engine.make_url(settings.database_url).render_as_string(hide_password=True)
    engine = get_engine(settings.database_url, prepare=settings.database_prepare)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
            server, standby = _server(conn)
        if standby:
            # A URL naming one host that is (now) a standby, or several without read-write:
            # every write would fail.
            checks.append(
                Check(
                    "database",
                    False,
                    f"reachable ({url}), but {server} is a standby (read-only): point the URL "
                    "at the primary, or name every host with target_session_attrs=read-write",
                )
            )
            return checks
        checks.append(Check("database", True, f"reachable ({url}{server and ', '}{server})"))
        current, head = current_revision(engine), head_revision(settings.database_url)
        if current == head:
            checks.append(Check("schema", True, f"at head ({head})"))
        else:
            checks.append(
                Check(
                    "schema",
                    False,
                    f"at {current or 'nothing'}, head is {head}: run 'ductor migrate'",
                )
            )
    except Exception as exc:  # noqa: BLE001 - every failure is a finding, not a crash
        checks.append(Check("database", False, f"unreachable ({url}): {_first_line(exc)}"))
    app = d.app
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=timeout)
        broker = app.connection_for_write().as_uri()
        checks.append(Check("broker", True, f"reachable ({broker})"))
    except Exception as exc:  # noqa: BLE001
        checks.append(Check("broker", False, f"unreachable: {_first_line(exc)}"))
        return checks
    checks.extend(_queue_declarations(d, timeout))
    try:
        replies = app.control.inspect(timeout=timeout).active_queues() or {}
    except Exception as exc:  # noqa: BLE001
        replies = {}
        checks.append(Check("workers", False, f"cannot inspect workers: {_first_line(exc)}"))
    for queue in (settings.steps_queue, settings.coord_queue):
        consumers = sorted(
            worker
            for worker, queues in replies.items()
            if any(q.get("name") == queue for q in queues or [])
        )
        if consumers:
            checks.append(Check(f"queue {queue}", True, "consumed by " + ", ".join(consumers)))
        else:
            cmd = f"celery -A <app> worker -Q {queue}" + (
                " -c 1" if queue == settings.coord_queue else ""
            )
            checks.append(
                Check(
                    f"queue {queue}",
                    False,
                    f"no worker consumes it: tasks routed there pile up; start '{cmd}'",
                )
            )
    return checks


def _queue_declarations(d: Ductor, timeout: float) -> list[Check]:
    """On RabbitMQ: is each of ductor's queues on the broker of the type ductor declares
    (runtime/broker.py)? A queue not there yet is fine (ductor declares it); one of another
    type is what stops ductor's messages and workers (``QueueMismatch``)."""
    from .errors import QueueMismatch

    queues = d.runtime.queues
    if not queues.amqp:
        return []
    kind = "a classic queue" if d.settings.classic_queues else "a quorum queue"
    checks: list[Check] = []
    try:
        with d.app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=timeout)
            found = queues.check(conn, queues.names(), create=False)
    except Exception as exc:  # noqa: BLE001 - a finding, not a crash
        return [Check("queue declarations", False, f"cannot check: {_first_line(exc)}")]
    for name, state in found.items():
        if isinstance(state, QueueMismatch):
            checks.append(Check(f"queue {name} declaration", False, str(state)))
        elif state == "missing":
            detail = f"not on the broker yet: ductor declares it as {kind} when it first sends"
            checks.append(Check(f"queue {name} declaration", True, detail))
        else:
            checks.append(Check(f"queue {name} declaration", True, f"{kind}, as ductor declares"))
    return checks
