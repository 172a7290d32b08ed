"""The sweeper: a thread in the coordinator worker that replaces lost messages.

Every ``ductor_sweep_interval`` seconds it wakes runs with due timers, re-sends outbox rows a
dead dispatcher left behind, and wakes runs whose wake-up was lost (finished attempts not
folded, runs still pending). It never changes run state itself: it only sends hints.

It is also the backstop of concurrency leases (``store.sweep.reclaim_leases``): a lease past its
expiry whose holder ended is freed and handed to the oldest waiter, a live holder's lease is
kept and its run woken, and free slots go to waiters. See docs/leases.md.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from celery import bootsteps

from ..engine.kinds import AuditSource
from ..engine.status import TERMINAL_RUN_STATUSES
from ..store import audit, rates, retention, run_slots, schedules, sweep
from ..store.audit import Who
from ..store.db import brief, db_now, is_transient
from ..store.outbox import delete_outbox
from . import metrics

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from .ports import WorkerPort

log = logging.getLogger("ductor_celery.sweeper")

#: Don't wake the same run for the same reason more often than this.
REWAKE_AFTER_S = 5.0
SIGNAL_REWAKE_AFTER_S = 30.0
#: A result, run or control this old with no tick having folded it had its wake-up lost.
LOST_WAKEUP_AFTER_S = 10.0
#: ... and such a run is woken again at most this often.
LOST_REWAKE_AFTER_S = 30.0
#: With ``ductor_retention_days``, prune at most this often, and at most this many batches a
#: time, so a backlog of old runs never holds up the sweep's other work for long.
PRUNE_EVERY_S = 60.0
PRUNE_BATCHES_PER_SWEEP = 10
#: Sweeps that fail wait twice as long each time, up to this (or the sweep interval).
SWEEP_BACKOFF_MAX_S = 5.0


class Sweeper:
    def __init__(self, rt: WorkerPort) -> None:
        self.rt = rt
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._recent: dict[str, tuple[float, float]] = {}
        #: Where the last sweep stopped among rate-limit keys with waiters (store/rates.py).
        self._rate_cursor: str | None = None
        self._pruned_at: float | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="ductor-sweeper", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        interval = self.rt.settings.sweep_interval
        wait = interval
        while not self._stop.wait(wait):
            try:
                self.sweep_once()
            except Exception as exc:  # noqa: BLE001 - keep sweeping through outages
                # Failing sweeps back off (a database that is away, being failed over, is not
                # asked every interval), up to SWEEP_BACKOFF_MAX_S: once it is back, the next
                # sweep comes soon enough.
                wait = min(max(wait * 2, interval), max(interval, SWEEP_BACKOFF_MAX_S))
                if is_transient(exc):
                    log.warning(
                        "sweep: database unreachable (%s); next sweep in %.1fs", brief(exc), wait
                    )
                else:
                    log.exception("sweep failed; retrying in %.1fs", wait)
            else:
                wait = interval

    def sweep_once(self) -> dict[str, int]:
        engine = self.rt.engine()
        grace = self.rt.settings.outbox_grace
        due = sweep.due_timer_runs(engine, rewake_after=REWAKE_AFTER_S)
        fired = self._fire_schedules(engine)
        relayed = sweep.relay_stale_outbox(engine, self.rt.dispatcher.send, older_than=grace)
        leased = sweep.reclaim_leases(engine, self.rt.dispatcher.send)
        rated = rates.release_waiters(engine, self.rt.dispatcher.send, self._rate_cursor)
        self._rate_cursor = rated.last_key
        # A wake-up counts as lost only well past the grace: under load the coordinator's queue
        # is simply long, and re-waking every run with a result still queued would flood it.
        lost_after = max(LOST_WAKEUP_AFTER_S, grace)
        lost = (
            self._throttle(
                sweep.unfolded_runs(engine, older_than=lost_after)
                + sweep.pending_runs(engine, older_than=lost_after)
                + sweep.runs_with_unhandled_controls(engine, older_than=lost_after)
                + sweep.parents_behind_children(engine, older_than=lost_after),
                LOST_REWAKE_AFTER_S,
            )
            + self._throttle(
                # A signal can wait legitimately for a node not reached yet: look again rarely.
                sweep.runs_with_unapplied_signals(engine, older_than=grace),
                SIGNAL_REWAKE_AFTER_S,
            )
            + self._throttle(
                # An open attempt outlived its lease: its tick decides whether it is lost.
                leased.wake,
                LOST_REWAKE_AFTER_S,
            )
        )
        self.rt.dispatcher.wake_many(fired.started + due + lost)
        if fired.started or fired.skipped or fired.missed:
            log.info(
                "sweep: schedules: %d runs started, %d fire times skipped (overlap), %d missed",
                len(fired.started),
                fired.skipped,
                fired.missed,
            )
        if due or relayed or lost:
            log.info(
                "sweep: %d due timers, %d outbox rows re-sent, %d lost wake-ups",
                len(due),
                relayed,
                len(lost),
            )
        if leased.released or leased.granted or leased.extended:
            log.info(
                "sweep: leases: %d released, %d granted to waiters, %d kept for open holders",
                leased.released,
                leased.granted,
                leased.extended,
            )
        if rated.released:
            log.info("sweep: rate limits: %d waiting attempts released", rated.released)
        try:
            pruned = self._prune(engine)
        except Exception:  # noqa: BLE001 - retention must never stop the sweep's other work
            log.exception("sweep: prune failed; trying again in %.0fs", PRUNE_EVERY_S)
            pruned = 0
        actions = {
            "pruned": pruned,
            "schedules_fired": len(fired.started),
            "timers": len(due),
            "outbox": relayed,
            "lost_wakeups": len(lost),
            "leases_released": leased.released,
            "leases_granted": leased.granted,
            "leases_extended": leased.extended,
            "rate_waiters_released": rated.released,
        }
        metrics.record_sweep(actions)
        return actions

    def _fire_schedules(self, engine: Engine) -> schedules.FireResult:
        """Start the runs of due fire times; a failure here (a schema not migrated yet, a bad
        row) is logged and leaves the rest of the sweep alone."""
        try:
            # A fire time is on time if a sweep or two comes after it: never "missed" for that.
            floor = max(schedules.MIN_CATCHUP_WINDOW_S, 3 * self.rt.settings.sweep_interval)
            return schedules.fire_due(engine, min_window=floor)
        except Exception:  # noqa: BLE001
            log.exception("sweep: firing schedules failed; retrying next sweep")
            return schedules.FireResult()

    def _prune(self, engine: Engine) -> int:
        """``ductor_retention_days``: delete finished runs older than that, a few batches at
        most every PRUNE_EVERY_S (several coordinators skip each other's locked batches)."""
        days = self.rt.settings.retention_days
        now = time.monotonic()
        if self._pruned_at is not None and now - self._pruned_at < PRUNE_EVERY_S:
            return 0
        self._pruned_at = now
        self._prune_audit(engine)
        rates.prune_full_buckets(engine)
        self._reap_run_slots(engine)
        if days is None:
            return 0
        cutoff = db_now(engine) - timedelta(days=days)
        pruned = retention.prune(
            engine,
            cutoff=cutoff,
            statuses=TERMINAL_RUN_STATUSES,
            max_batches=PRUNE_BATCHES_PER_SWEEP,
            who=Who("ductor_retention_days", AuditSource.SCHEDULE),
        )
        if pruned:
            log.info("sweep: pruned %d runs finished before %s", pruned, cutoff.isoformat())
        return pruned

    def _reap_run_slots(self, engine: Engine) -> None:
        """Run concurrency's backstop (store/run_slots.py ``reap``): slots of runs that ended
        without releasing them are released, and the woken waiters sent."""
        with engine.begin() as conn:
            outbox = run_slots.reap(conn, db_now(engine))
        if outbox:
            log.warning("sweep: slots of ended runs released; %d waiting run(s) woken", len(outbox))
            self.rt.dispatcher.send(outbox)
            delete_outbox(engine, [r.id for r in outbox])

    def _prune_audit(self, engine: Engine) -> int:
        """``ductor_audit_retention_days``: delete audit entries older than that (with the
        runs' prune, at most every PRUNE_EVERY_S)."""
        days = self.rt.settings.audit_retention_days
        if days is None:
            return 0
        return audit.delete_older_than(engine, db_now(engine) - timedelta(days=days))

    def _throttle(self, run_ids: list[str], window: float) -> list[str]:
        """Drop runs woken for the same reason within ``window`` seconds."""
        now = time.monotonic()
        self._recent = {k: v for k, v in self._recent.items() if now - v[0] < v[1]}
        fresh = [r for r in dict.fromkeys(run_ids) if r not in self._recent]
        for run_id in fresh:
            self._recent[run_id] = (now, window)
        return fresh


class SweeperBootstep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Runs the sweeper inside ``celery worker -Q ductor-coord``; no extra process to deploy."""

    requires = {"celery.worker.components:Pool"}

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.sweeper: Sweeper | None = None

    def start(self, worker: Any) -> None:
        rt = getattr(worker.app, "_ductor_runtime", None)
        if rt is None or not rt.consumes_coord_queue(worker.app):
            return
        self.sweeper = Sweeper(rt)
        self.sweeper.start()
        log.info("ductor sweeper started (every %.1fs)", rt.settings.sweep_interval)

    def stop(self, worker: Any) -> None:
        if self.sweeper is not None:
            self.sweeper.stop()
            self.sweeper = None

    # A cold stop (``local_workers()`` leaving, a second Ctrl-C) calls terminate, whose
    # default acts on ``self.obj``, which this step does not use: the sweeper thread would
    # outlive its worker, and go on firing schedules for it.
    shutdown = terminate = stop
