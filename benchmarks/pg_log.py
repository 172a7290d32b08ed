"""``--pg-log``: what one 10-step run asks of PostgreSQL, statement by statement, by role."""

from __future__ import annotations

import re
import time
from collections import defaultdict
from typing import Any

from common import STEPS
from ductor_phases import ductor_run
from harness import Bench


def pg_statements(bench: Bench) -> None:
    """One extra run with log_statement=all: every statement each process sends, per step."""
    with bench.pg.connect() as conn:
        conn.execute("ALTER SYSTEM SET log_statement = 'all'")
        conn.execute("ALTER SYSTEM SET log_line_prefix = '%m [%p] '")
        conn.execute("SELECT pg_reload_conf()")
    time.sleep(0.3)
    offset = bench.pg.log_path.stat().st_size
    try:
        _, run_id, _, _ = ductor_run(bench)
        time.sleep(0.3)
    finally:
        with bench.pg.connect() as conn:
            conn.execute("ALTER SYSTEM RESET log_statement")
            conn.execute("ALTER SYSTEM RESET log_line_prefix")
            conn.execute("SELECT pg_reload_conf()")
    with open(bench.pg.log_path, "rb") as fh:
        fh.seek(offset)
        text = fh.read().decode("utf-8", "replace")
    bench.results["pg_statements_one_run"] = statements_by_role(text, run_id)


def role(stmts: list[str]) -> str:
    """Which process a backend served, from the statements it ran."""
    joined = " ".join(stmts)
    if "claimed_at=now()" in joined.replace(" ", "") or "SET claimed_at" in joined:
        return "step worker"
    if "UPDATE eec_workflow_run" in joined:
        return "coordinator"
    if "INSERT INTO eec_workflow_run" in joined or "LISTEN" in joined:
        return "client"
    return "other (sweeper, ...)"


def statements_by_role(text: str, run_id: str) -> dict[str, Any]:
    """The statements of a PostgreSQL log (``log_line_prefix = '%m [%p] '``), grouped by the
    role of the backend that ran them: totals, per step, and each statement's first 90
    characters counted."""
    by_backend: dict[str, list[str]] = defaultdict(list)
    for line in text.splitlines():
        m = re.match(r"\S+ \S+ \S+ \[(\d+)\] LOG:  (?:statement|execute [^:]*): (.*)", line)
        if m:
            by_backend[m.group(1)].append(re.sub(r"\s+", " ", m.group(2)).strip())
    roles: dict[str, list[str]] = defaultdict(list)
    for stmts in by_backend.values():
        roles[role(stmts)].extend(stmts)
    out: dict[str, Any] = {"run_id": run_id, "statements": {}}
    for name, stmts in sorted(roles.items()):
        shapes: dict[str, int] = defaultdict(int)
        for st in stmts:
            shapes[st[:90]] += 1
        out["statements"][name] = {
            "total": len(stmts),
            "per_step": round(len(stmts) / STEPS, 1),
            "shapes": dict(sorted(shapes.items(), key=lambda kv: -kv[1])),
        }
    return out
