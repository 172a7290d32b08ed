"""Being told that a run finished: LISTEN/NOTIFY on PostgreSQL, polling on SQLite.

The tick's commit notifies ``RUN_FINISHED_CHANNEL`` with the run id when it finishes a run
(``store/ticks.py``); ``Client.wait`` re-reads the run after each wake-up, so a listener only
has to cut the wait short, never to be exact: a missed notification costs at most the safety
poll below.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from .db import is_postgres

if TYPE_CHECKING:
    import psycopg

RUN_FINISHED_CHANNEL = "ductor_run_finished"

#: Longest wait between two looks at the run, even when told nothing.
SAFETY_POLL_S = 1.0


class FinishListener(Protocol):
    def wait_for(self, run_id: str, seconds: float) -> None:
        """Return when ``run_id`` may have finished, or after at most ``seconds``."""


class _Notified:
    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn

    def wait_for(self, run_id: str, seconds: float) -> None:
        for note in self._conn.notifies(timeout=min(SAFETY_POLL_S, seconds)):
            if note.payload == run_id:
                return


class _Polling:
    """SQLite has no notifications: look again soon, then less and less often."""

    def __init__(self) -> None:
        self._delay = 0.01

    def wait_for(self, run_id: str, seconds: float) -> None:
        time.sleep(max(0.0, min(self._delay, seconds)))
        self._delay = min(self._delay * 1.5, 0.2)


@contextmanager
def listener(engine: Engine, listen_url: str) -> Iterator[FinishListener]:
    """A listener for as long as the block runs. Its LISTEN starts before the block, so a
    caller that reads the run inside the block cannot miss a finish between the two.

    ``listen_url`` (``Settings.listen_url``) gets a connection of its own: LISTEN is session
    state, which a transaction-pooling PgBouncer does not keep (its notifications arrive on a
    server connection no client is linked to), so behind one it is a direct URL."""
    if not is_postgres(engine):
        yield _Polling()
        return
    import psycopg

    url = sa.engine.make_url(listen_url).set(drivername="postgresql")
    with psycopg.connect(url.render_as_string(hide_password=False), autocommit=True) as conn:
        conn.execute(f"LISTEN {RUN_FINISHED_CHANNEL}")
        yield _Notified(conn)
