"""Prune: delete finished runs, and everything that belongs to them, in short batches.

A run is prunable when it is finished (a terminal status) and finished before the cutoff, and
- it is not the child of a parent that stays (an open parent, or one finished after the
  cutoff: the parent reads its child's output and status);
- it is not a ``continued`` run whose successor still exists (the successor may show outputs
  that live in this run's attempt rows, and its input may be a reference to this run's blob);
- it is not the parent of a child that still exists, open or finished: a child's input may be
  a reference to one of this run's blobs (``input="$.nodes.make.output"`` passes the
  reference, not the value: docs/large-values.md), and that blob must outlive the child.
  No deadlock with the first rule: a child waits for its parent to be *old*, not gone, so an
  old family is pruned children first, the parent in a later batch.

Each batch is one transaction: pick up to ``batch_size`` prunable runs (on PostgreSQL locking
them ``FOR UPDATE SKIP LOCKED``, so a redrive's tick or a second pruner is never waited on and a
run reopened meanwhile no longer matches), delete their attempts, transitions, signals,
controls, outbox rows, timers, wake-up rows, tags (docs/tags.md), blobs (large values:
docs/large-values.md) and start requests (an HTTP start's idempotency key, a webhook's
delivery: store/start_requests.py), then the runs. Definitions are kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from ..engine.kinds import AuditAction
from ..engine.status import TERMINAL_RUN_STATUSES, RunStatus
from . import audit
from .audit import Who
from .dialect import dialect_of
from .schema import (
    blob,
    concurrency_lease,
    run_slot,
    run_tag,
    start_request,
    step_attempt,
    workflow_control,
    workflow_outbox,
    workflow_run,
    workflow_signal,
    workflow_timer,
    workflow_transition,
    workflow_wake,
)

#: Runs per transaction: each batch holds its locks for well under a second.
DEFAULT_BATCH_SIZE = 1000

#: The tables whose rows belong to one run, by their run id column.
_RUN_TABLES = (
    step_attempt,
    workflow_transition,
    workflow_signal,
    workflow_control,
    workflow_outbox,
    workflow_timer,
    workflow_wake,
    concurrency_lease,
    start_request,
    run_slot,
    run_tag,
    # Large values (docs/large-values.md): every blob a row of the run refers to.
    blob,
)


def _prunable(cutoff: datetime, statuses: Iterable[RunStatus], *, counting: bool = False) -> Any:
    """The WHERE clause of prunable runs (see the module docstring). ``counting`` (a dry
    run, which deletes nothing): a parent counts when each of its children is prunable in its
    own right, since the prune deletes those first and the parent in a later batch."""
    parent = workflow_run.alias("parent")
    successor = workflow_run.alias("successor")
    terminal = [s.value for s in TERMINAL_RUN_STATUSES]
    parent_stays = sa.exists().where(
        parent.c.run_id == workflow_run.c.parent_run_id,
        sa.or_(
            parent.c.status.not_in(terminal),
            parent.c.finished_at.is_(None),
            parent.c.finished_at >= cutoff,
        ),
    )
    successor_exists = sa.exists().where(successor.c.run_id == workflow_run.c.continued_to)
    child = workflow_run.alias("child")
    # By the partial index on parent_run_id: one index probe per candidate run.
    child_exists = sa.exists().where(
        child.c.parent_run_id == workflow_run.c.run_id,
        *(
            [
                sa.or_(
                    child.c.finished_at.is_(None),
                    child.c.finished_at >= cutoff,
                    child.c.status.not_in([s.value for s in statuses]),
                )
            ]
            if counting
            else []
        ),
    )
    return sa.and_(
        workflow_run.c.finished_at.is_not(None),
        workflow_run.c.finished_at < cutoff,
        workflow_run.c.status.in_([s.value for s in statuses]),
        # Most runs have no parent and no successor: the OR lets the planner skip the lookup
        # (by primary key) for them instead of scanning for the few parents that stay.
        sa.or_(workflow_run.c.parent_run_id.is_(None), ~parent_stays),
        sa.or_(workflow_run.c.continued_to.is_(None), ~successor_exists),
        ~child_exists,
    )


def count_prunable(engine: Engine, *, cutoff: datetime, statuses: Iterable[RunStatus]) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.select(sa.func.count())
                .select_from(workflow_run)
                .where(_prunable(cutoff, tuple(statuses), counting=True))
            ).scalar_one()
        )


def prune_batch(
    engine: Engine,
    *,
    cutoff: datetime,
    statuses: Iterable[RunStatus],
    batch_size: int = DEFAULT_BATCH_SIZE,
    who: Who | None = None,
) -> int:
    """Delete one batch of prunable runs in one transaction; how many runs it deleted. The
    runs' audit entries go with them (but for bulk actions'); ``who``: the batch's own entry."""
    query = (
        sa.select(workflow_run.c.run_id)
        .where(_prunable(cutoff, tuple(statuses)))
        .order_by(workflow_run.c.finished_at)
        .limit(batch_size)
    )
    query = dialect_of(engine).lock_rows(query, of=workflow_run, skip_locked=True)
    with engine.begin() as conn:
        run_ids = list(conn.execute(query).scalars())
        if not run_ids:
            return 0
        for table in _RUN_TABLES:
            conn.execute(sa.delete(table).where(table.c.run_id.in_(run_ids)))
        conn.execute(sa.delete(workflow_run).where(workflow_run.c.run_id.in_(run_ids)))
        audit.delete_for_runs(conn, run_ids)
        if who is not None:
            audit.record(
                conn,
                AuditAction.PRUNE,
                actor=who.actor,
                source=who.source,
                detail={
                    "runs": len(run_ids),
                    "finished_before": cutoff.isoformat(),
                    "statuses": sorted(s.value for s in statuses),
                },
            )
    return len(run_ids)


def prune(
    engine: Engine,
    *,
    cutoff: datetime,
    statuses: Iterable[RunStatus],
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_batches: int | None = None,
    on_batch: Callable[[int, float], None] | None = None,
    who: Who | None = None,
) -> int:
    """Delete prunable runs batch after batch until none is left (or ``max_batches``).

    ``on_batch(deleted, seconds)`` is told about each batch (its size and how long its
    transaction took). Returns how many runs were deleted.
    """
    wanted = tuple(statuses)
    total = batches = 0
    while max_batches is None or batches < max_batches:
        started = time.monotonic()
        deleted = prune_batch(
            engine, cutoff=cutoff, statuses=wanted, batch_size=batch_size, who=who
        )
        if on_batch is not None and deleted:
            on_batch(deleted, time.monotonic() - started)
        total += deleted
        batches += 1
        # Not "a short batch means done": deleting children can make their parents prunable
        # (a parent stays while a child exists), so only an empty batch ends the prune.
        if deleted == 0:
            break
    return total
