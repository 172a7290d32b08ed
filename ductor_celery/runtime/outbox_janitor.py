"""Deletes sent outbox rows in batches, off the tick's critical path.

Whoever commits outbox rows sends them right after the commit; deleting them is bookkeeping
that nothing waits for. Each process hands the ids of what it sent to one ``SentOutbox``, whose
daemon thread deletes them every ``FLUSH_INTERVAL_S`` in one statement. If the process dies
first, the rows stay and the sweeper sends them again after ``ductor_outbox_grace``: a
duplicate step message is dropped by its claim (by token), a duplicate wake-up is a no-op tick.
"""

from __future__ import annotations

import logging
import os
import threading

from sqlalchemy.engine import Engine

from ..store.db import brief
from ..store.outbox import delete_outbox

log = logging.getLogger("ductor_celery.outbox")

FLUSH_INTERVAL_S = 0.05
#: Flush at once past this many ids (one DELETE ... WHERE id IN (...) statement).
MAX_BATCH = 1000


class SentOutbox:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._ids: list[int] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="ductor-outbox", daemon=True)
        self._thread.start()

    def add(self, ids: list[int]) -> None:
        if not ids:
            return
        with self._lock:
            self._ids.extend(ids)
            full = len(self._ids) >= MAX_BATCH
        if full:
            self._wake.set()

    def flush(self) -> None:
        """Delete what was handed in so far (also called by tests and at shutdown)."""
        with self._lock:
            ids, self._ids = self._ids, []
        for start in range(0, len(ids), MAX_BATCH):
            batch = ids[start : start + MAX_BATCH]
            try:
                delete_outbox(self._engine, batch)
            except Exception as exc:  # noqa: BLE001 - never crash here
                # Left to the sweeper, which sends them once more and deletes them then.
                log.warning("could not delete %d sent outbox rows: %s", len(batch), brief(exc))

    def _loop(self) -> None:
        while not self._closed:
            self._wake.wait(FLUSH_INTERVAL_S)
            self._wake.clear()
            if self._ids:
                self.flush()

    def close(self) -> None:
        """Flush and stop the thread (a throwaway engine going away)."""
        self._closed = True
        self._wake.set()
        self._thread.join(5.0)
        self.flush()


_janitors: dict[tuple[int, int], SentOutbox] = {}
_lock = threading.Lock()


def sent_outbox(engine: Engine) -> SentOutbox:
    """This process's janitor for ``engine`` (a forked child gets its own thread)."""
    key = (os.getpid(), id(engine))
    found = _janitors.get(key)
    if found is None:
        with _lock:
            found = _janitors.get(key)
            if found is None:
                found = _janitors[key] = SentOutbox(engine)
    return found


def close_janitor(engine: Engine) -> None:
    """Flush and stop this process's janitor for ``engine``, if it has one."""
    with _lock:
        found = _janitors.pop((os.getpid(), id(engine)), None)
    if found is not None:
        found.close()
