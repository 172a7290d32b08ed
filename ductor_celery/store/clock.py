"""The store's clock on SQLite, replaceable per engine (the seam ``ductor_celery.testing`` uses).

On PostgreSQL every time the store writes or compares is the server's ``now()``: one clock for
every process. On SQLite (one machine) it is Python's ``datetime.now(UTC)``, read here, unless
a clock was injected for that engine. The test harness injects its controlled clock into its
own throwaway engine only, so no other engine, and no other harness, ever sees it; an engine
without one pays a dictionary miss.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from datetime import UTC, datetime

from sqlalchemy.engine import Engine

Clock = Callable[[], datetime]

_clocks: weakref.WeakKeyDictionary[Engine, Clock] = weakref.WeakKeyDictionary()


def now(engine: Engine) -> datetime:
    """The store's time for ``engine``: its injected clock, else the real UTC time."""
    clock = _clocks.get(engine) if _clocks else None
    return datetime.now(UTC) if clock is None else clock()


def injected_now(engine: Engine) -> datetime | None:
    """The injected clock's time, or None when ``engine`` runs on the real clock (then rows
    keep their database defaults)."""
    clock = _clocks.get(engine) if _clocks else None
    return None if clock is None else clock()


def inject(engine: Engine, clock: Clock) -> None:
    """Make ``clock`` the time of every read and write the store makes through ``engine``.

    Called through ``Dialect.inject_clock``, which refuses a database that keeps its own
    time (this module knows no dialect: the dialect reads its clock from here)."""
    _clocks[engine] = clock


def restore(engine: Engine) -> None:
    """Back to the real clock."""
    _clocks.pop(engine, None)
