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
#: An idle connection older than this is closed, not reused: one kept longer may lead to a
#: server that is gone or no longer the primary (a failover behind a multi-host URL), and a
#: wait would first spend its time finding that out.
IDLE_LISTENER_MAX_AGE_S = 30.0


class _IdleListeners:
    """Connections a finished wait handed back, UNLISTENed: an idle connection that still
    listened would never read its notifications, and the server's notification queue, which
    every finishing commit writes to, cannot move past a listener that does not read. Keyed
    by process: a forked child never uses (nor closes) its parent's connections."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: (pid, url) -> [(connection, when it was handed back)], newest last.
        self._idle: dict[tuple[int, str], list[tuple[psycopg.Connection[Any], float]]] = {}
        #: Bumped by ``forget``: a connection taken before is closed when handed back.
        self._generation: dict[str, int] = {}

    def after_fork(self) -> None:
        """In a forked child: a lock another thread of the parent held stays held there."""
        self._lock = threading.Lock()

    def generation(self, url: str) -> int:
        with self._lock:
            return self._generation.get(url, 0)

    def take(self, url: str) -> psycopg.Connection[Any] | None:
        """The newest idle connection to ``url`` not older than the age limit (older ones
        are closed)."""
        now = time.monotonic()
        with self._lock:
            idle = self._idle.get((os.getpid(), url), [])
            expired = [c for c, at in idle if now - at > IDLE_LISTENER_MAX_AGE_S]
            idle[:] = [(c, at) for c, at in idle if now - at <= IDLE_LISTENER_MAX_AGE_S]
            taken = idle.pop()[0] if idle else None
        _close(expired)
        return taken

    def give_back(self, url: str, conn: psycopg.Connection[Any], generation: int) -> None:
        try:
            conn.execute("UNLISTEN *")
        except Exception:  # noqa: BLE001 - a connection that fails here is not kept
            _close([conn])
            return
        with self._lock:
            idle = self._idle.setdefault((os.getpid(), url), [])
            if generation == self._generation.get(url, 0) and len(idle) < MAX_IDLE_LISTENERS:
                idle.append((conn, time.monotonic()))
                return
        _close([conn])

    def forget(self, url: str) -> None:
        """Close this process's idle connections to ``url`` (``db.forget_engine``, and a
        wait that found one dead: the others went the same way); one in use now is closed
        when its wait ends."""
        with self._lock:
            self._generation[url] = self._generation.get(url, 0) + 1
            conns = [c for c, _ in self._idle.pop((os.getpid(), url), [])]
        _close(conns)


def _close(conns: list[psycopg.Connection[Any]]) -> None:
    for conn in conns:
        with contextlib.suppress(Exception):
            conn.close()


IDLE_LISTENERS = _IdleListeners()
on_forget(IDLE_LISTENERS.forget)
os.register_at_fork(after_in_child=IDLE_LISTENERS.after_fork)


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
        self._generation = IDLE_LISTENERS.generation(url)
        self._conn: psycopg.Connection[Any] | None = None
        self._retry_at = 0.0
        self._delay = SAFETY_POLL_S
        self.listen()

    def _listening(self) -> psycopg.Connection[Any]:
        """A connection that LISTENs: an idle one if it still works, else a new one. One
        idle connection found dead means the others are too (a restart, a failover): they
        are all closed, and a new one is opened at once."""
        idle = IDLE_LISTENERS.take(self._url)
        if idle is not None:
            try:
                idle.execute(f"LISTEN {RUN_FINISHED_CHANNEL}")
                return idle
            except Exception:  # noqa: BLE001 - lost while idle: the others too
                _close([idle])
                IDLE_LISTENERS.forget(self._url)
                self._generation = IDLE_LISTENERS.generation(self._url)
        conn = self._connect()
        try:
            conn.execute(f"LISTEN {RUN_FINISHED_CHANNEL}")
        except BaseException:
            _close([conn])
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
            # Closed on the way out, also by an exception between two notifications: the
            # generator holds the connection's lock until it is closed.
            with contextlib.closing(self._conn.notifies(timeout=timeout)) as notes:
                for note in notes:
                    if note.payload == run_id:
                        return
        except Exception as exc:  # noqa: BLE001 - a lost connection: listen again later
            log.warning("wait(): LISTEN connection lost (%s); listening again", brief(exc))
            self._drop()

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            _close([conn])

    def close(self, *, reuse: bool = True) -> None:
        """The wait is over: its connection goes back for the next wait (``reuse``), or is
        closed (the wait ended in an error: the connection may be part of it)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if reuse:
            IDLE_LISTENERS.give_back(self._url, conn, self._generation)
        else:
            _close([conn])


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
    except BaseException:
        notified.close(reuse=False)
        raise
    notified.close()
