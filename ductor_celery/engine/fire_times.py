"""When a schedule fires: cron expressions in a time zone, or a fixed period. Pure.

A schedule's fire times are a fixed series, the same whoever computes them: ``every=N``
fires at the multiples of N seconds since the Unix epoch (UTC), a cron expression at the
matching wall-clock minutes of its time zone (``croniter``; DST gaps and repeats as croniter
resolves them). The sweeper fires each time at most once (store/schedules.py); this module
only says which times are due at ``now`` and which one comes next.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, croniter

from .. import limits

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: The shortest period: a schedule is a row the sweeper reads, not a busy loop.
MIN_EVERY_S = 1.0
#: How many fire times one pass of the sweeper handles per schedule; the rest wait a pass.
MAX_FIRES_PER_PASS = 100


@dataclass(frozen=True, slots=True)
class Cadence:
    """A checked cron expression (with its time zone) or period in seconds."""

    cron: str | None
    every: float | None
    timezone: str = "UTC"

    def next_after(self, after: datetime) -> datetime:
        """The first fire time strictly after ``after`` (UTC); ``limits.LATEST`` ("never")
        when there is none: a cron whose year field has run out, a time past the calendar.
        Never raises, so one such schedule cannot stop the sweeper firing the others."""
        try:
            found = self._next_after(after)
        except (CroniterBadDateError, OverflowError, ValueError, KeyError, IndexError):
            return limits.LATEST
        return min(found, limits.LATEST)

    def _next_after(self, after: datetime) -> datetime:
        if self.every is not None:
            step = _micros(self.every)
            elapsed = _micros_between(EPOCH, after)
            return EPOCH + timedelta(microseconds=(elapsed // step + 1) * step)
        assert self.cron is not None
        local = after.astimezone(ZoneInfo(self.timezone))
        found = croniter(self.cron, local).get_next(datetime)
        assert isinstance(found, datetime)
        return found.astimezone(UTC)

    def next_fire(self, after: datetime, what: str = "schedule") -> datetime:
        """``next_after``, or a ValueError when the schedule would never fire again."""
        found = self.next_after(after)
        if found >= limits.LATEST:
            shown = f"cron expression {self.cron!r}" if self.cron else f"every={self.every:g}"
            raise ValueError(f"{what}: {shown} has no fire time after {after.isoformat()}")
        return found


def _micros(seconds: float) -> int:
    return round(seconds * 1_000_000)


def _micros_between(start: datetime, end: datetime) -> int:
    delta = end - start
    return (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds


def check_cadence(cron: object, every: object, timezone: object) -> Cadence:
    """The cadence a user asked for, or a ValueError / TypeError naming what is wrong."""
    if not isinstance(timezone, str):
        raise TypeError(f"timezone must be a string, got {type(timezone).__name__}")
    try:
        ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ValueError(
            f"unknown time zone {limits.show(timezone)} (an IANA name, e.g. 'Europe/Paris')"
        ) from None
    if (cron is None) == (every is None):
        raise ValueError("give exactly one of cron= or every=")
    if every is not None:
        problem = limits.duration_problem(every)
        if problem is not None:
            raise (TypeError if not limits.is_number(every) else ValueError)(f"every {problem}")
        assert isinstance(every, int | float)
        if every < MIN_EVERY_S:
            raise ValueError(f"every must be at least {MIN_EVERY_S:g} second, got {every!r}")
        return Cadence(cron=None, every=float(every), timezone=timezone)
    if not isinstance(cron, str):
        raise TypeError(f"cron must be a string, got {type(cron).__name__}")
    if not cron.strip() or len(cron) > limits.MAX_ID_LENGTH or not croniter.is_valid(cron):
        raise ValueError(f"bad cron expression {limits.show(cron)}")
    cadence = Cadence(cron=cron, every=None, timezone=timezone)
    try:
        first = [cadence._next_after(EPOCH) for _ in range(5)]  # "0 0 30 2 *" never comes
    except (CroniterBadDateError, ValueError, OverflowError, KeyError, IndexError):
        raise ValueError(f"cron expression {cron!r} never fires") from None
    if len(set(first)) != 1:
        # croniter's random fields ("R") give another time at every call: a fire time must
        # be the same whoever computes it.
        raise ValueError(f"cron expression {cron!r} is random (R): give fixed times")
    return cadence


@dataclass(frozen=True, slots=True)
class DueFires:
    #: Fire times to handle now, oldest first (each within the catch-up window).
    fires: tuple[datetime, ...]
    #: Fire times that were missed by more than the catch-up window (not fired).
    missed: int
    #: The next fire time not handled yet (the row's new ``next_fire_at``).
    next_fire_at: datetime


def due_fires(
    cadence: Cadence,
    next_fire_at: datetime,
    now: datetime,
    catchup_window: float,
    limit: int = MAX_FIRES_PER_PASS,
) -> DueFires:
    """The fire times from ``next_fire_at`` up to ``now``: those older than the catch-up
    window are counted as missed; at most ``limit`` are returned (the rest next pass)."""
    oldest = now - timedelta(seconds=catchup_window)
    missed = 0
    current = next_fire_at
    if current < oldest:
        # Jump over the downtime instead of walking it (every=1 for a week is 600,000 steps).
        first = cadence.next_after(oldest - timedelta(microseconds=1))
        missed = _count_between(cadence, current, first)
        current = first
    fires: list[datetime] = []
    while current <= now and len(fires) < limit:
        fires.append(current)
        current = cadence.next_after(current)
    return DueFires(fires=tuple(fires), missed=missed, next_fire_at=current)


def _count_between(cadence: Cadence, start: datetime, end: datetime, cap: int = 10_000) -> int:
    """How many fire times lie in ``[start, end)`` (counted exactly for a period, up to
    ``cap`` for cron): only for the log line about missed fires."""
    if cadence.every is not None:
        return max(0, -(-_micros_between(start, end) // _micros(cadence.every)))
    count, current = 0, start
    while current < end and count < cap:
        count += 1
        current = cadence.next_after(current)
    return count


def fire_id(name: str, fire_at: datetime) -> str:
    """The workflow id of the run of one fire time: ``<name>@<fire time, ISO 8601 UTC>``.
    Every coordinator computes the same one, so the open-workflow-id rule and the fire
    bookkeeping make each fire time one run."""
    return f"{name}@{fire_at.astimezone(UTC).isoformat()}"
