"""Being told that a run finished: LISTEN/NOTIFY on PostgreSQL, polling on SQLite.

The tick's commit notifies ``RUN_FINISHED_CHANNEL`` with the run id when it finishes a run
(``store/ticks.py``); ``Client.wait`` re-reads the run after each wake-up, so a listener only
has to cut the wait short, never to be exact: a missed notification costs at most the safety
poll below.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy.engine import Engine

from .db import brief, on_forget, psycopg_connect_args
from .dialect import dialect_of

if TYPE_CHECKING:
    import psycopg

RUN_FINISHED_CHANNEL = "ductor_run_finished"

#: Longest wait between two looks at the run, even when told nothing.
SAFETY_POLL_S = 1.0
#: A lost LISTEN connection is tried again after SAFETY_POLL_S, doubling up to this.
RELISTEN_MAX_S = 30.0

log = logging.getLogger("ductor_celery.client")


class FinishListener(Protocol):
    def wait_for(self, run_id: str, seconds: float) -> None:
        """Return when ``run_id`` may have finished, or after at most ``seconds``."""


#: Listening connections kept between two waits, per process and listen URL: a wait that
#: finds one LISTENs on it (one round trip) instead of opening a connection (a server
#: process forked and authenticated: several milliseconds of both machines' CPU, on every
#: ``Client.wait``).
MAX_IDLE_LISTENERS = 4


class _IdleListeners:
    """Connections a finished wait handed back, UNLISTENed: an idle connection that still
    listened would never read its notifications, and the server's notification queue, which
    every finishing commit writes to, cannot move past a listener that does not read. Keyed
    by process: a forked child never uses (nor closes) its parent's connections."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple[int, str], list[psycopg.Connection[Any]]] = {}

    def take(self, url: str) -> psycopg.Connection[Any] | None:
        with self._lock:
            idle = self._idle.get((os.getpid(), url))
            return idle.pop() if idle else None

    def give_back(self, url: str, conn: psycopg.Connection[Any]) -> None:
        try:
            conn.execute("UNLISTEN *")
        except Exception:  # noqa: BLE001 - a connection that fails here is not kept
            with contextlib.suppress(Exception):
                conn.close()
            return
        with self._lock:
            idle = self._idle.setdefault((os.getpid(), url), [])
            if len(idle) < MAX_IDLE_LISTENERS:
                idle.append(conn)
                return
        conn.close()

    def forget(self, url: str) -> None:
        """Close this process's idle connections to ``url`` (``db.forget_engine``)."""
        with self._lock:
            conns = self._idle.pop((os.getpid(), url), [])
        for conn in conns:
            with contextlib.suppress(Exception):
                conn.close()


IDLE_LISTENERS = _IdleListeners()
on_forget(IDLE_LISTENERS.forget)


class _Notified:
    """LISTENs on a connection of its own (one a finished wait handed back, or a new one),
    and gets a new one when it is lost (a restart, a failover): meanwhile it waits as the
    safety poll does. A notification sent while no connection listened is missed, which costs
    nothing: the caller reads the run after every ``wait_for``, and a new connection LISTENs
    before that read. A notification left from an earlier wait on a reused connection only
    cuts a wait short, which costs one more read of the run."""

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]], url: str) -> None:
        self._connect = connect
        self._url = url
        self._conn: psycopg.Connection[Any] | None = None
        self._retry_at = 0.0
        self._delay = SAFETY_POLL_S
        self.listen()

    def _listening(self) -> psycopg.Connection[Any]:
        """A connection that LISTENs: an idle one if one still works, else a new one."""
        while (idle := IDLE_LISTENERS.take(self._url)) is not None:
            try:
                idle.execute(f"LISTEN {RUN_FINISHED_CHANNEL}")
                return idle
            except Exception:  # noqa: BLE001 - lost while idle (a restart): the next one
                with contextlib.suppress(Exception):
                    idle.close()
        conn = self._connect()
        try:
            conn.execute(f"LISTEN {RUN_FINISHED_CHANNEL}")
        except BaseException:
            with contextlib.suppress(Exception):
                conn.close()
            raise
        return conn

    def listen(self) -> None:
        """(Re)connect and LISTEN; on failure, try again after a growing pause (never a
        loop of connection attempts)."""
        try:
            conn = self._listening()
        except Exception as exc:  # noqa: BLE001 - psycopg's errors, a bad conninfo: poll
            self._retry_at = time.monotonic() + self._delay
            log.warning(
                "wait(): cannot LISTEN (%s); polling, next try in %.0fs",
                brief(exc),
                self._delay,
            )
            self._delay = min(self._delay * 2, RELISTEN_MAX_S)
            return
        self._conn, self._delay = conn, SAFETY_POLL_S

    def wait_for(self, run_id: str, seconds: float) -> None:
        timeout = max(0.0, min(SAFETY_POLL_S, seconds))
        if self._conn is None and time.monotonic() >= self._retry_at:
            self.listen()
            if self._conn is not None:
                return  # LISTENing again: let the caller read the run (it may be done)
        if self._conn is None:
            time.sleep(timeout)
            return
        try:
            for note in self._conn.notifies(timeout=timeout):
                if note.payload == run_id:
                    return
        except Exception as exc:  # noqa: BLE001 - a lost connection: listen again later
            log.warning("wait(): LISTEN connection lost (%s); listening again", brief(exc))
            self._drop()

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def close(self) -> None:
        """The wait is over: its connection goes back for the next wait."""
        conn, self._conn = self._conn, None
        if conn is not None:
            IDLE_LISTENERS.give_back(self._url, conn)


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
    if not dialect_of(engine).notifies:
        yield _Polling()
        return
    import psycopg

    # Several hosts and the connect defaults as the engine has them (store/db.py).
    args = psycopg_connect_args(listen_url)
    notified = _Notified(lambda: psycopg.connect(autocommit=True, **args), listen_url)
    try:
        yield notified
    finally:
        notified.close()
