"""What the run page shows of each node, read from the run row alone (no outputs, no attempt
rows): the same dict feeds the first render and every poll, so they never disagree."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ..engine.state import NodeState, StepWork
from ..store.runs import RunRow


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def scatter_counts(ns: NodeState) -> dict[str, int] | None:
    """A scatter's items: done, in flight, failed, of how many (batches count their items)."""
    sc = ns.scatter
    if sc is None:
        return None
    in_flight = sum(len(sc.batch_items(b)) for b in sc.branches)
    return {"total": sc.total, "done": sc.succeeded, "running": in_flight, "failed": sc.failed}


def node_label(ns: NodeState) -> str:
    """The status line under a node's name: its status, and what is going on inside it."""
    counts = scatter_counts(ns)
    if counts is not None and (counts["total"] or ns.status != "pending"):
        return (
            f"{counts['done']}/{counts['total']} done · {counts['running']} running · "
            f"{counts['failed']} failed"
        )
    step = ns.work if isinstance(ns.work, StepWork) else None
    if ns.status == "running" and step is not None and step.retry_at and step.token is None:
        return f"retry {step.attempt + 1} due"
    if ns.generation > 1:
        attempt = step.attempt if step is not None else 0
        return f"{ns.status.value} · attempt {attempt or ns.generation}"
    return ns.status.value


def node_live(ns: NodeState) -> dict[str, Any]:
    error = ns.error if ns.status != "succeeded" else None
    return {
        "status": ns.status.value,
        "label": node_label(ns),
        "attempts": ns.generation,
        "started_at": _iso(ns.started_at),
        "finished_at": _iso(ns.finished_at),
        "error": (error or {}).get("message") if isinstance(error, dict) else error,
        "scatter": scatter_counts(ns),
    }


def run_live(row: RunRow, order: list[str]) -> dict[str, Any]:
    """The run page's live data; ``order``: the definition's nodes (all of them are shown,
    ``pending`` until reached)."""
    nodes = {n: node_live(row.state.nodes.get(n) or NodeState()) for n in order}
    return {
        "run_id": row.run_id,
        "status": row.status.value,
        "record_version": row.record_version,
        "finished_at": _iso(row.finished_at),
        "nodes": nodes,
    }
