"""The chaos ledger: what step functions actually executed, written by the steps themselves.

It lives outside ductor's tables (``chaos_ledger``, in the same PostgreSQL database so the
checker can join it with the ``eec_`` tables) and is written through a plain psycopg
connection of its own, never through ductor's store. Each execution of a step function is
one row:

* inserted when the function starts (``started_at`` is the database's ``clock_timestamp()``,
  the same clock ductor's rows use), with the attempt's token (the Celery task id ductor
  sends it under), run, node, branch (the scatter item index), attempt number and a fresh
  ``nonce``;
* updated when it ends (``ended_at``, ``ok``, ``result`` or ``error``).

Every result a step returns carries its nonce (``{"n": nonce, "v": value}``) and every context
patch it makes is keyed by it (``x:<node>:<branch>:<nonce>``), so the checker can say which
execution produced any value ductor accepted.

Both writes ride out a PostgreSQL restart or a terminated connection for ``DEADLINE_S``. An
insert whose commit answer was lost is retried; the unique nonce turns the second insert into
a no-op. If the ledger cannot be written at all, the step raises ``LedgerUnavailable`` (its
attempt fails and is retried): an execution that is not in the ledger never returns a result.

On a fleet (``scripts/chaos --fleet``, docs/fleet.md) the ledger is written out of band, as
Jepsen's control node keeps its history: with ``CHAOS_LEDGER_DIR`` set, ``begin`` and ``end``
append a JSON line each to a file of their process in that directory (one ``write`` of a whole
line on an ``O_APPEND`` file, before the step does its work, so a SIGKILL loses nothing), and
gates are files there too. The network faults cut a worker from the database, not from its
own disk: a step keeps running, and finishes, while its host is partitioned, and the record of
what it did is still complete. ``load_files`` copies the lines into ``chaos_ledger`` (times
from the same machine's clock) before the checker reads it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

log = logging.getLogger("chaos.ledger")

#: How long a step keeps trying to write its ledger row.
DEADLINE_S = 40.0

DDL = """
CREATE TABLE IF NOT EXISTS chaos_ledger (
    id          bigserial PRIMARY KEY,
    nonce       text NOT NULL UNIQUE,
    token       text,
    run_id      text NOT NULL,
    workflow_id text,
    node        text NOT NULL,
    branch      integer,
    attempt     integer NOT NULL,
    step        text NOT NULL,
    lease_key   text,
    pid         integer NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at    timestamptz,
    ok          boolean,
    result      jsonb,
    error       text
);
CREATE INDEX IF NOT EXISTS chaos_ledger_token ON chaos_ledger (token);
CREATE INDEX IF NOT EXISTS chaos_ledger_run_node ON chaos_ledger (run_id, node);
-- Gates of the `chaos.gate` step: a row opens the gate of that key (the driver opens one
-- before it redrives a run that failed at its gate).
CREATE TABLE IF NOT EXISTS chaos_gate (
    key       text PRIMARY KEY,
    opened_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""


class LedgerUnavailable(RuntimeError):
    """The ledger could not be written: the step fails (retryably) instead of running blind."""


_local = threading.local()


def _dsn() -> str:
    dsn = os.environ.get("CHAOS_LEDGER_DSN")
    if not dsn:
        raise LedgerUnavailable("CHAOS_LEDGER_DSN is not set")
    return dsn


def _conn() -> psycopg.Connection[Any]:
    """This process's (and thread's) ledger connection, reconnected after a fork or a drop."""
    conn = getattr(_local, "conn", None)
    pid = getattr(_local, "pid", None)
    if conn is None or pid != os.getpid() or conn.closed:
        conn = psycopg.connect(_dsn(), autocommit=True, connect_timeout=3)
        _local.conn, _local.pid = conn, os.getpid()
    return conn


def _drop() -> None:
    conn = getattr(_local, "conn", None)
    _local.conn = None
    if conn is not None:
        try:
            conn.close()
        except Exception:  # noqa: BLE001
            pass


def _dir() -> Path | None:
    path = os.environ.get("CHAOS_LEDGER_DIR")
    return Path(path) if path else None


_file_lock = threading.Lock()


def _append(record: dict[str, Any]) -> None:
    """One line, one write, on this process's file (O_APPEND: lines never interleave)."""
    directory = _dir()
    assert directory is not None
    line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
    path = directory / f"ledger-{os.getpid()}.jsonl"
    with _file_lock:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def _gate_path(key: str) -> Path:
    directory = _dir()
    assert directory is not None
    return directory / "gates" / hashlib.sha256(key.encode()).hexdigest()


def mark_gate(key: str) -> None:
    """The driver opens a gate: with a file ledger, the file the steps look for (the row in
    ``chaos_gate`` is written as well, by the caller)."""
    if _dir() is None:
        return
    path = _gate_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(key)


def load_files(directory: Path, dsn: str) -> int:
    """Copy a file ledger into ``chaos_ledger`` (executions in start order); returns the
    number of executions. A torn last line (a process killed mid-write) is skipped."""
    begins: dict[str, dict[str, Any]] = {}
    ends: dict[str, dict[str, Any]] = {}
    for path in sorted(directory.glob("ledger-*.jsonl")):
        for raw in path.read_bytes().splitlines():
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            if rec.get("op") == "begin":
                begins.setdefault(rec["nonce"], rec)
            elif rec.get("op") == "end":
                ends.setdefault(rec["nonce"], rec)

    def ts(t: float | None) -> datetime | None:
        return None if t is None else datetime.fromtimestamp(t, UTC)

    rows = []
    for b in sorted(begins.values(), key=lambda r: r["t"]):
        e = ends.get(b["nonce"], {})
        ok = e.get("ok")
        rows.append(
            (
                b["nonce"], b["token"], b["run_id"], b["workflow_id"], b["node"], b["branch"],
                b["attempt"], b["step"], b["lease_key"], b["pid"], ts(b["t"]), ts(e.get("t")),
                ok, Jsonb(e.get("result")) if ok else None, e.get("error"),
            )
        )  # fmt: skip
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO chaos_ledger (nonce, token, run_id, workflow_id, node, branch, attempt,"
            " step, lease_key, pid, started_at, ended_at, ok, result, error) VALUES (%s, %s, %s,"
            " %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (nonce) DO NOTHING",
            rows,
        )
    return len(rows)


def _with_retry(what: str, fn: Any) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    delay = 0.1
    while True:
        try:
            return fn(_conn())
        except psycopg.OperationalError as exc:
            _drop()
            if time.monotonic() > deadline:
                raise LedgerUnavailable(f"ledger {what}: {exc}") from exc
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


def begin(
    *,
    nonce: str,
    token: str | None,
    run_id: str,
    workflow_id: str | None,
    node: str,
    branch: int | None,
    attempt: int,
    step: str,
    lease_key: str | None = None,
) -> None:
    """Record that a step function starts executing (before it does anything else)."""
    if _dir() is not None:
        _append(
            {
                "op": "begin", "t": time.time(), "nonce": nonce, "token": token,
                "run_id": run_id, "workflow_id": workflow_id, "node": node, "branch": branch,
                "attempt": attempt, "step": step, "lease_key": lease_key, "pid": os.getpid(),
            }
        )  # fmt: skip
        return

    def insert(conn: psycopg.Connection[Any]) -> None:
        conn.execute(
            "INSERT INTO chaos_ledger (nonce, token, run_id, workflow_id, node, branch, attempt,"
            " step, lease_key, pid) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
            " ON CONFLICT (nonce) DO NOTHING",
            (
                nonce,
                token,
                run_id,
                workflow_id,
                node,
                branch,
                attempt,
                step,
                lease_key,
                os.getpid(),
            ),
        )

    _with_retry("insert", insert)


def end(nonce: str, *, ok: bool, result: Any = None, error: str | None = None) -> None:
    """Record how the execution ended (idempotent: an UPDATE by nonce)."""
    if _dir() is not None:
        _append(
            {"op": "end", "t": time.time(), "nonce": nonce, "ok": ok, "result": result,
             "error": error}
        )  # fmt: skip
        return

    def update(conn: psycopg.Connection[Any]) -> None:
        conn.execute(
            "UPDATE chaos_ledger SET ended_at = clock_timestamp(), ok = %s, result = %s,"
            " error = %s WHERE nonce = %s AND ended_at IS NULL",
            (ok, Jsonb(result) if ok else None, error, nonce),
        )

    _with_retry("update", update)


def gate_open(key: str) -> bool:
    if _dir() is not None:
        return _gate_path(key).exists()

    def read(conn: psycopg.Connection[Any]) -> bool:
        found = conn.execute("SELECT 1 FROM chaos_gate WHERE key = %s", (key,)).fetchone()
        return found is not None

    return bool(_with_retry("gate", read))
