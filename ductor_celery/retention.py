"""The client's side of retention: ``ductor.prune(...)``, checked before anything is deleted."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from . import limits
from .call_checks import check_id
from .client import Client
from .engine.status import TERMINAL_RUN_STATUSES, RunStatus
from .store import retention
from .store.audit import Who, current_source
from .store.db import db_now, with_retry


def check_older_than(older_than: Any) -> timedelta:
    """A ``timedelta`` (or a number of seconds) of at least zero."""
    if isinstance(older_than, timedelta):
        seconds: Any = older_than.total_seconds()
    elif limits.is_number(older_than):
        seconds = older_than
    else:
        raise TypeError(
            f"older_than must be a timedelta or a number of seconds, "
            f"got {type(older_than).__name__}"
        )
    problem = limits.duration_problem(seconds, allow_zero=True)
    if problem is not None:
        raise ValueError(f"older_than {problem}")
    return timedelta(seconds=seconds)


def check_statuses(statuses: Any) -> tuple[RunStatus, ...]:
    """The finished statuses to prune; ``None``: every finished status."""
    finished = sorted(TERMINAL_RUN_STATUSES)
    if statuses is None:
        return tuple(finished)
    if isinstance(statuses, str):
        statuses = [statuses]
    if not isinstance(statuses, Iterable):
        raise TypeError(f"statuses must be a list of run statuses, got {type(statuses).__name__}")
    chosen: list[RunStatus] = []
    for status in statuses:
        try:
            value = RunStatus(status)
        except ValueError:
            raise ValueError(
                f"unknown run status {limits.show(status)} "
                f"(finished ones: {', '.join(s.value for s in finished)})"
            ) from None
        if value not in TERMINAL_RUN_STATUSES:
            raise ValueError(
                f"cannot prune {value.value} runs: only finished runs are pruned "
                f"({', '.join(s.value for s in finished)})"
            )
        chosen.append(value)
    if not chosen:
        raise ValueError("statuses is empty: give None for every finished status")
    return tuple(dict.fromkeys(chosen))


def prune(
    client: Client,
    older_than: Any,
    statuses: Any = None,
    dry_run: bool = False,
    batch_size: int = retention.DEFAULT_BATCH_SIZE,
    by: str | None = None,
) -> int:
    """Delete finished runs that finished more than ``older_than`` ago (with dry_run: count
    them). Returns the number of runs."""
    age = check_older_than(older_than)
    wanted = check_statuses(statuses)
    if by is not None:
        check_id(by, "by")
    if not isinstance(dry_run, bool):
        raise TypeError(f"dry_run must be True or False, got {type(dry_run).__name__}")
    engine = client.engine
    cutoff: datetime = client._read(db_now, engine) - age
    if dry_run:
        return client._read(retention.count_prunable, engine, cutoff=cutoff, statuses=wanted)
    # Each batch is its own transaction and safe to repeat: a retried batch deletes the
    # runs it finds then.
    return with_retry(
        lambda: retention.prune(
            engine,
            cutoff=cutoff,
            statuses=wanted,
            batch_size=batch_size,
            who=Who(by, current_source()),
        ),
        what="prune",
    )
