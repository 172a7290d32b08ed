"""Every limit ductor enforces at the door, in one place, the same on SQLite and PostgreSQL.

A value is checked against these before anything is written, so a run can never be accepted
and then fail to tick (an infinite timeout overflowing a datetime, a node id too long for its
column, a payload nested too deep to decode). The README's "Limits" section lists them.

Pure: imported by ``definition/`` and ``engine/`` as well as the client.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

#: Workflow ids and names, node ids, step names, signal names, idempotency keys, queue names,
#: ``requested_by``: 1..200 characters, no NUL (the columns are ``VARCHAR(200)``).
MAX_ID_LENGTH = 200

#: Secret names (``$.secret.<name>``, ``ctx.secret(name)``): 1..100 ASCII letters, digits
#: and ``_``, not starting with a digit (``definition.paths.secret_name_problem``).
MAX_SECRET_NAME_LENGTH = 100

#: Deepest nesting of lists and dicts in any JSON value ductor stores (inputs, arguments,
#: outputs, context patches, signal payloads, heartbeat details, reasons).
MAX_JSON_DEPTH = 100

#: Longest duration in seconds (timeouts, sleeps, retry intervals): ten years. Anything longer
#: is a typo for "never" (write ``None``), and ``now + seconds`` must stay a valid datetime.
MAX_DURATION_S = 10 * 365 * 86400.0

#: The time ductor's arithmetic saturates at instead of raising ``OverflowError``: "never".
#: A year short of ``datetime.max``, so it stays a valid datetime in every time zone (a
#: PostgreSQL session at +14:00 reads it back as a date Python can hold).
LATEST = datetime(9999, 1, 1, tzinfo=UTC)

#: The clock ductor runs at lies between these (``testing.harness`` refuses a clock outside
#: them): from there, ten years of delay, deadline, timeouts and look-backs (``since=2w``,
#: ``older_than=``) stay far inside the calendar.
EARLIEST_NOW = datetime(1000, 1, 1, tzinfo=UTC)
LATEST_NOW = datetime(9000, 1, 1, tzinfo=UTC)

#: Largest ``RetryPolicy.max_attempts``.
MAX_ATTEMPTS = 1_000_000

#: Largest ``RetryPolicy.backoff`` multiplier.
MAX_BACKOFF = 1000.0

#: Largest workflow version, ``max_parallel``, ``tolerated_failures``, event-set ``mode``:
#: what a 32-bit signed integer column holds.
MAX_INT = 2**31 - 1

#: ``list_runs(limit=...)``, ``ductor runs --limit``: 1..MAX_LIST_LIMIT.
MAX_LIST_LIMIT = 1000


def is_number(value: object) -> bool:
    """An int or float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def show(value: object, limit: int = 60) -> str:
    """``repr(value)`` for a message, cut short; never raises (``repr(10**5000)`` does)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - an int too long to print, a user's broken __repr__
        if isinstance(value, int):
            return f"an integer of {value.bit_length()} bits"
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else f"{text[:limit]}..."


def duration_problem(value: object, *, allow_zero: bool = False) -> str | None:
    """Why ``value`` is not a usable number of seconds, or ``None`` when it is."""
    if not is_number(value):
        return f"must be a number of seconds, got {show(value)}"
    assert isinstance(value, int | float)
    # An int is always finite (and math.isfinite(10**400) would raise OverflowError); an int
    # compares exactly with the float bounds below.
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number of seconds, got {show(value)}"
    if value < 0 or (value == 0 and not allow_zero):
        return f"must be {'>= 0' if allow_zero else 'positive'}, got {show(value)}"
    if value > MAX_DURATION_S:
        return f"must be at most {MAX_DURATION_S:.0f} s (ten years), got {show(value)}"
    return None


def in_utc(value: datetime) -> datetime | None:
    """An aware datetime as UTC, or ``None`` when that instant is not a datetime at all:
    ``0001-01-01T00:00+14:00`` is in year 0, ``9999-12-31T23:00-14:00`` in year 10000."""
    try:
        return value.astimezone(UTC)
    except (OverflowError, ValueError):
        return None


def time_problem(value: datetime) -> str | None:
    """Why an aware datetime is not a time ductor can compare and store, or ``None``."""
    if value.tzinfo is None or value.utcoffset() is None:
        return f"{value.isoformat()} has no time zone (give an aware datetime)"
    if in_utc(value) is None:
        return f"{value.isoformat()} is out of range: in UTC it falls outside years 1..9999"
    return None


def later(start: datetime, seconds: float) -> datetime:
    """``start`` plus ``seconds``, saturating at ``LATEST`` instead of raising: the tick's
    time arithmetic is total, so a run whose clock or timer is near the end of the calendar
    never makes every tick raise ``OverflowError``. (Bounded durations keep real runs far
    from it: this is the last line of defence, not a limit.)"""
    try:
        found = start + timedelta(seconds=seconds)
    except (OverflowError, ValueError):  # past either end of the calendar; nan
        return start if seconds < 0 else max(start, LATEST)
    return found if found <= LATEST else max(start, LATEST)


def int_problem(value: object, *, minimum: int, maximum: int = MAX_INT) -> str | None:
    """Why ``value`` is not an integer in ``minimum..maximum``, or ``None`` when it is."""
    if not isinstance(value, int) or isinstance(value, bool):
        return f"must be an integer, got {show(value)}"
    if not minimum <= value <= maximum:
        return f"must be between {minimum} and {maximum}, got {show(value)}"
    return None


def id_problem(value: object) -> str | None:
    """Why ``value`` is not a usable identifier string, or ``None`` when it is."""
    if not isinstance(value, str):
        return f"must be a string, got {type(value).__name__}"
    if not value:
        return "must not be empty"
    if len(value) > MAX_ID_LENGTH:
        return f"must be at most {MAX_ID_LENGTH} characters, got {len(value)}"
    if "\x00" in value:
        return "must not contain NUL characters"
    if not value.isprintable() and any(0xD800 <= ord(c) <= 0xDFFF for c in value):
        return "must not contain lone surrogates (it is not valid Unicode)"
    return None


#: Longest ``ConcurrencyLimit.key`` as written (a path or a literal): the lease key column is
#: ``VARCHAR(500)``.
MAX_LEASE_KEY_LENGTH = 500

#: Largest scatter ``batch_size`` (items per attempt): a batch's arguments and outputs travel
#: in one attempt row, so it stays a bounded multiple of one item's.
MAX_BATCH_SIZE = 10_000
