"""Times typed by a person (``ductor runs --since``, the console's filters): ISO 8601 or an age.

``2026-01-02T03:04:05Z``, ``2026-01-02 03:04`` (no zone: UTC), ``2026-01-02`` (midnight UTC),
or an age before now: ``90s``, ``15m``, ``2h``, ``7d``, ``2w``.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from ..limits import MAX_DURATION_S, time_problem

#: Any number of digits: ``99999999999w`` is refused as "more than ten years ago", not as
#: "not a time" (and never computed: the number is compared before any timedelta is made).
_AGE = re.compile(r"^\s*(\d{1,50})\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_time(text: str, what: str, now: datetime) -> datetime:
    """The aware datetime ``text`` names; ValueError naming ``what`` otherwise."""
    age = _AGE.match(text)
    if age is not None:
        seconds = int(age.group(1)) * _UNIT_S[age.group(2)]
        if seconds > MAX_DURATION_S:
            raise ValueError(f"{what} {text[:60]!r} is more than ten years ago")
        return now - timedelta(seconds=seconds)
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"{what} {text[:60]!r} is neither an ISO 8601 time (2026-01-02T03:04:05Z) "
            "nor an age such as 15m, 2h or 7d"
        ) from None
    value = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    problem = time_problem(value)  # 0001-01-01T00:00+14:00 is no time in UTC
    if problem is not None:
        raise ValueError(f"{what} {problem}")
    return value
