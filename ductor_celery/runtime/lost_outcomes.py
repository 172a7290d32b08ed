"""Outcomes a database failover lost, written again by the worker process that ran the step.

With asynchronous replication (docs/reliability.md, "Database failover"), a primary that dies
takes its last commits with it, acknowledged or not. Among them may be the outcome of an
attempt whose step ran in this process: on the promoted standby that attempt is still open,
claimed by this process, which has moved on. Nobody else would close it before the step's
timeout (``ductor_default_step_timeout``, 300 s unless the step says otherwise), and the run
would wait that long and then run the step again. The same holds for an outcome this process
could not write at all (the database away for longer than ``FINISH_DEADLINE_S``).

So a step worker process keeps each outcome it wrote for ``RETAIN_S`` (at most
``MAX_ENTRIES`` of them, ``MAX_BYTES`` in all), and, while it keeps any, a thread looks at the
database every ``CHECK_EVERY_S``: which server answers (``store.db.server_identity``), and
whether this process has found the database gone meanwhile (``store.db.outages``). After
either changes, it reads which of its attempts are still open, claimed by the claim this
process made (or by no one: the claim was lost too), writes their outcomes again and wakes
their runs. The step does not run again; what the run sees is the outcome it would have seen.

Nothing here is needed for the outcome to be applied once: the write is the ordinary one
(``finish``: only an open attempt takes an outcome), and the tick ignores results for tokens
the run no longer waits on. A worker process that died with the primary writes nothing
again: its attempts time out as any lost worker's do. On SQLite nothing is kept.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..store import attempts
from ..store.db import get_engine, open_engine, outages, server_identity

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

log = logging.getLogger("ductor_celery.step")

#: How long an outcome written is kept, in case the commit that wrote it is lost: longer
#: than replication lag plus the time a failover takes to promote a standby.
RETAIN_S = 600.0
#: At most this many outcomes, this many bytes (their JSON) per process; the oldest go first,
#: and an outcome larger than the whole budget is not kept.
MAX_ENTRIES = 2000
MAX_BYTES = 8 << 20
#: While any outcome is kept, the database is looked at this often (one round trip).
CHECK_EVERY_S = 2.0


@dataclass(frozen=True, slots=True)
class _Kept:
    token: str
    run_id: str
    #: The claim this process made (``claimed_by``): an attempt claimed by another worker
    #: since (a re-sent message) is that worker's to finish.
    claimer: str
    #: Writes the outcome again (``steps._record``) and wakes the run.
    rewrite: Callable[[], str]
    size: int
    at: float


class LostOutcomes:
    """One per worker process: the outcomes it wrote lately, and the thread that writes the
    lost ones again."""

    def __init__(self, engine: Callable[[], Engine | None], *, watch: bool = True) -> None:
        """``engine``: this process's engine, or ``None`` once it was disposed of (then
        everything kept is forgotten: the app is gone). ``watch``: a thread looks while
        anything is kept (off: ``check()`` is called by hand)."""
        self._engine = engine
        self._watch = watch
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._identity: str | None = None
        self._outages = outages()
        #: The next look checks the database whatever it finds.
        self._force = False

    def keep(
        self,
        token: str,
        run_id: str,
        claimer: str,
        size: int,
        rewrite: Callable[[], str],
        *,
        since: int,
        written: bool = True,
    ) -> None:
        """Remember an outcome this process wrote (``written``) or gave up writing (the
        database away too long: the thread writes it once it is back). ``since``:
        ``outages()`` before the write began; an outage during the write (its commit perhaps
        lost, or retried) has the next look check the database."""
        if size > MAX_BYTES:
            return
        with self._lock:
            if not written or since != outages():
                self._force = True
            old = self._kept.pop(token, None)
            if old is not None:
                self._bytes -= old.size
            self._kept[token] = _Kept(token, run_id, claimer, rewrite, size, time.monotonic())
            self._bytes += size
            self._trim(time.monotonic())
            if self._thread is None and self._watch:
                self._thread = threading.Thread(
                    target=self._loop, name="ductor-lost-outcomes", daemon=True
                )
                self._thread.start()

    def __len__(self) -> int:
        return len(self._kept)

    def _trim(self, now: float) -> None:
        while self._kept:
            oldest = next(iter(self._kept.values()))
            if (
                now - oldest.at < RETAIN_S
                and len(self._kept) <= MAX_ENTRIES
                and self._bytes <= MAX_BYTES
            ):
                return
            self._kept.popitem(last=False)
            self._bytes -= oldest.size

    def _loop(self) -> None:
        """Look every CHECK_EVERY_S while anything is kept; then end (``keep`` starts a new
        thread with the next outcome)."""
        while True:
            time.sleep(CHECK_EVERY_S)
            with self._lock:
                self._trim(time.monotonic())
                if not self._kept:
                    self._thread = None
                    return
            try:
                self.check()
            except Exception:  # noqa: BLE001 - never let the thread die; look again later
                log.exception("looking for lost outcomes failed; looking again")

    def _forget_all(self) -> None:
        with self._lock:
            self._kept.clear()
            self._bytes = 0

    def check(self) -> int:
        """One look: if the server changed or was lost since the last look, write again the
        outcomes it no longer has. Returns how many were written again."""
        with self._lock:
            self._trim(time.monotonic())
            if not self._kept:
                return 0
        seen = outages()
        engine = self._engine()
        if engine is None:  # the app's engine was disposed of: nobody to write for
            self._forget_all()
            return 0
        try:
            identity = server_identity(engine)
        except Exception as exc:  # noqa: BLE001 - away: the next look, once it is back
            log.debug("lost outcomes: database not reachable (%s)", exc)
            return 0
        # The first look knows no server before it: only an outage since this keeper began
        # tells it anything.
        with self._lock:
            force, self._force = self._force, False
        changed = force or seen != self._outages or self._identity not in (None, identity)
        try:
            written = self._rewrite_lost(engine) if changed else 0
        except Exception:
            self._force = True  # look again next time
            raise
        self._identity, self._outages = identity, seen
        return written

    def _rewrite_lost(self, engine: Engine) -> int:
        with self._lock:
            kept = list(self._kept.values())
        still_open = attempts.open_claims(engine, [k.token for k in kept])
        written = 0
        for entry in kept:
            if entry.token not in still_open:
                continue  # finished, closed, or never there (the tick that made it was lost)
            claimer = still_open[entry.token]
            if claimer is not None and claimer != entry.claimer:
                continue  # claimed again since by another worker: its outcome will come
            log.warning(
                "attempt %s: the database does not have its outcome (a commit lost in a "
                "failover, or a write given up); the step ran here: writing it again",
                entry.token,
            )
            entry.rewrite()
            written += 1
            with self._lock:
                gone = self._kept.pop(entry.token, None)
                if gone is not None:
                    self._bytes -= gone.size
        return written


_by_process: dict[tuple[int, str, bool], LostOutcomes] = {}
_by_process_lock = threading.Lock()


def lost_outcomes(url: str, *, prepare: bool) -> LostOutcomes | None:
    """This process's keeper for the database ``url`` (``get_engine``'s URL and
    ``prepare``): a new one after a fork; ``None`` on SQLite. Its looks use the engine
    ``get_engine`` made, and stop once that engine is disposed of."""
    if not attempts.may_lose_commits(get_engine(url, prepare=prepare)):
        return None
    key = (os.getpid(), url, prepare)
    keeper = _by_process.get(key)
    if keeper is None:
        with _by_process_lock:
            keeper = _by_process.get(key)
            if keeper is None:
                keeper = _by_process[key] = LostOutcomes(lambda: open_engine(url, prepare=prepare))
    return keeper
