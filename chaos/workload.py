"""The mixed workload: runs started through ductor's public client, each with a script of
timed actions (signals, approvals, controls, redrives) run by a small thread pool.

Every script is one top-level workflow id. Its actions:

* ``chaos_signals``: three ``tick`` signals (consumed in order by a chain of waits), sent early
  (before the waits are reached) or late, some from several threads at once, each under an
  idempotency key that is sent one to three times; extra keyless ticks; events ``a``/``b``/``c``
  for a 2-of-3 event set (which may time out into ``continue``); an approval (approve, reject,
  or two racing decisions). A feeder keeps the run live: if a wait is waiting and no tick is
  left, it sends one (a continue-as-new with new input restarts the waits).
* any workflow, at random: pause (and a resume that insists until the pause is applied),
  cancel, terminate, continue-as-new (carried or with new input), at a random moment.
* after a run ends failed, cancelled or terminated: sometimes a redrive (``chaos_failing``
  opens its gate first, so the redrive can succeed).

The driver writes down what it sent (signal keys and the ids ductor returned, decisions and
their answers), which the checker compares with the tables. Client calls that raise anything
but a ``DuctorError`` are counted as client exceptions.

When the fault window ends, ``finish()`` stops new starts and makes every pending action due
at once, so that every run can end.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ledger
import sqlalchemy as sa
from checker import in_windows

from ductor_celery import DuctorError, InvalidOperation

log = logging.getLogger("chaos.workload")

OPEN = ("pending", "running", "paused")
TERMINAL = ("succeeded", "failed", "cancelled", "terminated", "continued")

#: Workflow -> weight in the mix.
MIX: dict[str, float] = {
    "chaos_dag": 3.0,
    "chaos_failing": 1.0,
    "chaos_scatter": 1.5,
    "chaos_batched": 1.2,
    "chaos_parent": 1.0,
    "chaos_signals": 1.5,
    "chaos_limited": 1.0,
    "chaos_long": 0.8,
    "chaos_race": 1.0,
}
CUSTOMERS = ("acme", "globex", "initech")
CONTROLS = ("pause", "cancel", "terminate", "continue", "continue_input", "pause_cancel")

Action = Callable[["Script"], None]

#: Actions that poll and reschedule themselves: an error (the database restarting under the
#: driver's own reads) must not end them, or a run would wait forever for its approval.
POLLERS = frozenset({"_watch", "_approver", "_feeder", "_go_feeder", "_resume"})
BACKGROUND = frozenset({"_approver", "_feeder", "_go_feeder"})


@dataclass
class Script:
    seq: int
    workflow: str
    workflow_id: str
    input: dict[str, Any]
    rng: random.Random
    started: bool = False
    done: bool = False
    redrives: int = 0
    pending: int = 0
    terminal_seen: str | None = None
    #: When ``start()`` returned (seconds after the workload's t0).
    started_at: float | None = None
    notes: list[str] = field(default_factory=list)


class Workload:
    def __init__(
        self,
        ductor: Any,
        engine: sa.Engine,
        seed: int,
        *,
        target_open: int = 16,
        control_p: float = 0.3,
        redrive_p: float = 0.5,
        threads: int = 8,
    ) -> None:
        self.ductor = ductor
        self.engine = engine
        self.rng = random.Random(seed)
        self.target_open = target_open
        self.control_p = control_p
        self.redrive_p = redrive_p
        self.scripts: list[Script] = []
        self.stats: Counter[str] = Counter()
        self.client_exceptions: Counter[str] = Counter()
        self.signals_sent: list[dict[str, Any]] = []
        self.decisions: list[dict[str, Any]] = []
        self._heap: list[tuple[float, int, Script, Action, bool]] = []
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="chaos-client")
        self._stop = threading.Event()
        self.finishing = False
        self.starting = True
        self.t0 = time.monotonic()
        #: The asynchronous failovers' loss windows so far (seconds after t0; the fleet
        #: harness sets it, checker.async_loss_windows).
        self.loss_windows: Callable[[], list[tuple[float, float]]] = list

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> None:
        last_start = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if self.starting and not self.finishing and now - last_start >= 0.05:
                open_scripts = sum(1 for s in self.scripts if not s.done)
                if open_scripts < self.target_open:
                    self._new_script()
                    last_start = now
            due: list[tuple[Script, Action, bool]] = []
            with self._lock:
                while self._heap and self._heap[0][0] <= now:
                    _, _, script, action, background = heapq.heappop(self._heap)
                    due.append((script, action, background))
            for script, action, background in due:
                self._pool.submit(self._run_action, script, action, background)
            self._stop.wait(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def finish(self) -> None:
        """No new runs; every pending action is due now (and follow-ups come within 0.3 s)."""
        with self._lock:
            self.finishing = True
            now = time.monotonic()
            self._heap = [(min(due, now), seq, s, a, b) for due, seq, s, a, b in self._heap]
            heapq.heapify(self._heap)

    def open_scripts(self) -> list[Script]:
        return [s for s in self.scripts if not s.done]

    def later(self, script: Script, delay: float, action: Action) -> None:
        """Run ``action`` in ``delay`` seconds. Pollers (approver, feeders) are background:
        they do not keep a script open, and they stop once the script is done (a run that
        ends is not done while it may still be redriven, which reopens its waits)."""
        if self.finishing:
            delay = min(delay, 0.3)
        background = getattr(action, "__name__", "") in BACKGROUND
        with self._lock:
            if not background:
                script.pending += 1
            heapq.heappush(
                self._heap, (time.monotonic() + delay, next(self._seq), script, action, background)
            )

    def _run_action(self, script: Script, action: Action, background: bool = False) -> None:
        if background and script.done:
            return
        try:
            action(script)
        except Exception as exc:  # noqa: BLE001 - counted, the script goes on
            if not isinstance(exc, DuctorError):
                self.stats[f"action_error:{type(exc).__name__}"] += 1
                log.warning(
                    "action %s failed for %s: %s",
                    getattr(action, "__name__", "?"),
                    script.workflow_id,
                    exc,
                )
            if getattr(action, "__name__", "") in POLLERS and not self._stop.is_set():
                self.later(script, 1.0, action)
        finally:
            if not background:
                with self._lock:
                    script.pending -= 1

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        """A ductor client call: counted. DuctorError is re-raised for the caller to decide;
        anything else is a client exception (the contract says only DuctorError subclasses)."""
        self.stats[f"op:{what}"] += 1
        try:
            return fn()
        except DuctorError as exc:
            self.stats[f"refused:{what}:{type(exc).__name__}"] += 1
            raise
        except Exception as exc:
            self.client_exceptions[f"{what}: {type(exc).__name__}: {str(exc)[:160]}"] += 1
            raise

    def _db(self, fn: Callable[[Any], Any]) -> Any:
        """The driver's own reads and writes, riding out a PostgreSQL restart."""
        for attempt in range(120):
            try:
                with self.engine.begin() as conn:
                    return fn(conn)
            except sa.exc.DBAPIError:
                if attempt == 119 or self._stop.is_set():
                    raise
                time.sleep(0.5)
        return None

    # -- reading state (plain SQL: cheap polling) -----------------------------------------------

    def newest(self, workflow_id: str) -> Any:
        return self._db(
            lambda conn: conn.execute(
                sa.text(
                    # The whole state (migration 0020: the row names some nodes it does not hold).
                    "SELECT run_id, status, eec_run_state(state, run_id) AS state "
                    "FROM eec_workflow_run WHERE workflow_id = :w "
                    "ORDER BY created_at DESC, run_id DESC LIMIT 1"
                ),
                {"w": workflow_id},
            ).one_or_none()
        )

    def _unhandled(self, run_id: str, kinds: tuple[str, ...]) -> int:
        return int(
            self._db(
                lambda conn: conn.execute(
                    sa.text(
                        "SELECT count(*) FROM eec_workflow_control WHERE run_id = :r AND "
                        "handled_at IS NULL AND kind = ANY(:k)"
                    ),
                    {"r": run_id, "k": list(kinds)},
                ).scalar_one()
            )
        )

    def _unapplied_ticks(self, workflow_id: str) -> int:
        return int(
            self._db(
                lambda conn: conn.execute(
                    sa.text(
                        "SELECT count(*) FROM eec_workflow_signal WHERE workflow_id = :w AND "
                        "name = 'tick' AND applied_at IS NULL"
                    ),
                    {"w": workflow_id},
                ).scalar_one()
            )
        )

    # -- scripts --------------------------------------------------------------------------------

    def _new_script(self) -> None:
        rng = random.Random(self.rng.getrandbits(64))
        names = sorted(MIX)
        workflow = rng.choices(names, weights=[MIX[n] for n in names])[0]
        seq = len(self.scripts)
        script = Script(
            seq, workflow, f"c{seq}-{uuid.uuid4().hex[:6]}", self._input(workflow, rng), rng
        )
        self.scripts.append(script)
        self.later(script, 0.0, self._start)

    def _input(self, workflow: str, rng: random.Random) -> dict[str, Any]:
        if workflow == "chaos_dag":
            return {
                "x": rng.randrange(100),
                "do_c": rng.random() < 0.5,
                "skip_f": rng.random() < 0.3,
                "fails": rng.randint(0, 2),
            }
        if workflow == "chaos_failing":
            return {
                "key": uuid.uuid4().hex,
                "exhaust": rng.random() < 0.15,
                "bad": rng.random() < 0.15,
            }
        if workflow == "chaos_scatter":
            n = rng.randint(5, 12)
            return {"items": self._items(rng, n, rng.choice([0, 0, 1, 2, 3]))}
        if workflow == "chaos_batched":
            n = rng.randint(8, 20)
            return {"items": self._items(rng, n, rng.randint(0, max(1, n // 3)))}
        if workflow == "chaos_parent":
            groups = [
                self._items(rng, rng.randint(2, 4), 1 if rng.random() < 0.15 else 0)
                for _ in range(rng.randint(2, 4))
            ]
            return {"id": rng.randrange(1000), "groups": groups}
        if workflow == "chaos_limited":
            return {"customer": rng.choice(CUSTOMERS)}
        if workflow == "chaos_long":
            return {"x": rng.randrange(100)}
        if workflow == "chaos_race":
            return {"ms": rng.choice([5, 20, 60, 150])}
        return {}

    @staticmethod
    def _items(rng: random.Random, n: int, fails: int) -> list[dict[str, Any]]:
        failing = set(rng.sample(range(n), min(fails, n)))
        items = []
        for i in range(n):
            mode = "fail" if i in failing else ("flaky" if rng.random() < 0.2 else "ok")
            items.append({"i": i, "mode": mode, "ms": rng.choice([5, 10, 20, 40])})
        return items

    def _start(self, script: Script) -> None:
        if script.started:
            return
        try:
            self.call(
                "start",
                lambda: self.ductor.start(
                    script.workflow, input=script.input, workflow_id=script.workflow_id
                ),
            )
        except DuctorError:
            self.later(script, 1.0, self._start)  # the database was down: try again
            return
        script.started = True
        script.started_at = time.monotonic() - self.t0
        self.stats[f"started:{script.workflow}"] += 1
        rng = script.rng
        if script.workflow == "chaos_signals":
            self._plan_signals(script)
        if script.workflow == "chaos_race":
            # The signal lands about when step a finishes: two ticks of the run at once.
            at = script.input["ms"] / 1000.0 + rng.uniform(-0.05, 0.4)
            key = f"{script.workflow_id}:go"
            for _ in range(rng.randint(1, 2)):
                self.later(script, max(0.0, at), self._send("go", {"go": True}, key))
            self.later(script, 5.0, self._go_feeder)
        if rng.random() < self.control_p:
            self.later(script, rng.uniform(0.05, 6.0), self._control(rng.choice(CONTROLS)))
        self.later(script, 1.0, self._watch)

    # -- controls ---------------------------------------------------------------------------------

    def _control(self, kind: str) -> Action:
        def act(script: Script) -> None:
            d, w = self.ductor, script.workflow_id
            if kind == "pause":
                self.call("pause", lambda: d.pause(w, reason="chaos"))
                self.later(script, script.rng.uniform(0.5, 4.0), self._resume)
            elif kind == "pause_cancel":
                # Two controls racing: the cancel must win over a paused run as well.
                if not self._stop.is_set():
                    self._pool.submit(self._quiet, "pause", lambda: d.pause(w))
                self.call("cancel", lambda: d.cancel(w, reason="chaos race"))
            elif kind == "cancel":
                self.call("cancel", lambda: d.cancel(w, reason="chaos"))
            elif kind == "terminate":
                self.call("terminate", lambda: d.terminate(w, reason="chaos"))
            elif kind == "continue":
                self.call("continue_as_new", lambda: d.continue_as_new(w))
            elif kind == "continue_input":
                self.call("continue_as_new_input", lambda: d.continue_as_new(w, input=script.input))

        return act

    def _quiet(self, what: str, fn: Callable[[], Any]) -> None:
        try:
            self.call(what, fn)
        except DuctorError:
            pass
        except Exception:  # noqa: BLE001 - counted by call()
            pass

    def _resume(self, script: Script) -> None:
        """Resume until the run is not paused and no pause is on its way (a pause queued
        behind a tick would otherwise park the run after our resume). The control table is
        read before the run row: a pause handled in between shows in the row."""
        first = self.newest(script.workflow_id)
        if first is None:
            return
        queued = self._unhandled(first.run_id, ("pause",))
        resuming = self._unhandled(first.run_id, ("resume",))
        row = self.newest(script.workflow_id)
        if row is None or row.status in TERMINAL:
            return
        if row.status == "paused" and not resuming:  # a careful client: one resume at a time
            try:
                self.call("resume", lambda: self.ductor.resume(script.workflow_id))
            except InvalidOperation:
                pass
        elif row.status != "paused" and not queued:
            return
        self.later(script, 0.5, self._resume)

    def _watch(self, script: Script) -> None:
        """Once per second: redrive some runs that ended badly; mark the script done."""
        row = self.newest(script.workflow_id)
        if row is None:
            if script.pending <= 1 and in_windows(script.started_at, self.loss_windows()):
                # Its start was acknowledged inside an asynchronous failover's loss window and
                # the promoted primary has no run: lost with the old primary, not waited for.
                script.notes.append("start lost with the primary")
                self.stats["starts_lost_with_primary"] += 1
                script.done = True
                return
            self.later(script, 1.0, self._watch)
            return
        if row.status in TERMINAL and row.status != "continued":
            if self._unhandled(row.run_id, ("redrive",)):
                self.later(script, 0.5, self._watch)
                return
            redrivable = row.status in ("failed", "cancelled", "terminated")
            if (
                redrivable
                and script.terminal_seen != row.run_id + row.status
                and script.redrives < 2
                and not self.finishing
                and script.rng.random() < self.redrive_p
            ):
                script.terminal_seen = row.run_id + row.status
                self._redrive(script)
                self.later(script, 0.5, self._watch)
                return
            script.terminal_seen = row.run_id + row.status
            if script.pending <= 1:  # only this watch (pollers are background)
                script.done = True
                return
        if row.status == "paused" and self.finishing:
            self.later(script, 0.0, self._resume)
        self.later(script, 1.0, self._watch)

    def _redrive(self, script: Script) -> None:
        if script.workflow == "chaos_failing" and script.rng.random() < 0.8:
            self._db(
                lambda conn: conn.execute(
                    sa.text("INSERT INTO chaos_gate (key) VALUES (:k) ON CONFLICT DO NOTHING"),
                    {"k": script.input["key"]},
                )
            )
            ledger.mark_gate(script.input["key"])
        script.redrives += 1
        try:
            self.call("redrive", lambda: self.ductor.redrive(script.workflow_id))
            self.stats["redrive:sent"] += 1
        except DuctorError:
            pass

    # -- signals, events, approvals ---------------------------------------------------------------

    def _plan_signals(self, script: Script) -> None:
        rng = script.rng
        for k in range(3):
            key = f"{script.workflow_id}:tick:{k}"
            at = rng.uniform(0.0, 0.3) if rng.random() < 0.4 else rng.uniform(1.0, 8.0)
            repeats = rng.randint(1, 3)
            together = rng.random() < 0.5  # the repeats race each other
            for r in range(repeats):
                delay = at if together else at + r * rng.uniform(0.05, 1.5)
                self.later(script, delay, self._send("tick", {"seq": k, "key": key}, key))
        if rng.random() < 0.3:
            self.later(script, rng.uniform(0.0, 8.0), self._send("tick", {"seq": 99}, None))
        for event in rng.sample(["a", "b", "c"], rng.randint(1, 3)):
            key = f"{script.workflow_id}:{event}"
            at = rng.uniform(0.0, 10.0)
            for _ in range(rng.randint(1, 2)):
                self.later(script, at, self._send(event, {"event": event}, key))
        self.later(script, 0.5, self._approver)
        self.later(script, 10.0, self._feeder)

    def _send(self, name: str, payload: dict[str, Any], key: str | None) -> Action:
        def act(script: Script) -> None:
            record = {
                "workflow_id": script.workflow_id,
                "name": name,
                "key": key,
                "payload": payload,
                "t": round(time.monotonic() - self.t0, 3),
            }
            try:
                record["id"] = self.call(
                    f"signal:{'keyed' if key else 'keyless'}",
                    lambda: self.ductor.signal(
                        script.workflow_id, name, payload, idempotency_key=key
                    ),
                )
                record["acked"] = round(time.monotonic() - self.t0, 3)
            except Exception as exc:  # noqa: BLE001 - DuctorError, or counted by call()
                record["error"] = type(exc).__name__
            finally:
                with self._lock:
                    self.signals_sent.append(record)

        return act

    def _waiting(self, row: Any, node: str) -> bool:
        nodes = (row.state or {}).get("nodes", {}) if row is not None else {}
        return nodes.get(node, {}).get("status") == "waiting"

    def _approver(self, script: Script) -> None:
        row = self.newest(script.workflow_id)
        if row is not None and row.status == "running" and self._waiting(row, "ok"):
            rng = script.rng
            approved = rng.random() < 0.8
            racers = 2 if rng.random() < 0.3 else 1
            for i in range(racers):
                if not self._stop.is_set():
                    self._pool.submit(self._decide, script, row.run_id, approved, f"op{i}")
            self.later(script, 2.0, self._approver)
            return
        self.later(script, 0.5, self._approver)

    def _decide(self, script: Script, run_id: str, approved: bool, by: str) -> None:
        record = {
            "workflow_id": script.workflow_id,
            "run_id": run_id,
            "approved": approved,
            "by": by,
            "t": round(time.monotonic() - self.t0, 3),
        }
        verb = self.ductor.approve if approved else self.ductor.reject
        try:
            self.call("decide", lambda: verb(script.workflow_id, "ok", by=by, comment="chaos"))
            record["accepted"] = True
            record["acked"] = round(time.monotonic() - self.t0, 3)
        except DuctorError as exc:
            record["accepted"] = False
            record["error"] = type(exc).__name__
        except Exception as exc:  # noqa: BLE001 - counted by call()
            record["accepted"] = False
            record["error"] = type(exc).__name__
        with self._lock:
            self.decisions.append(record)

    def _go_feeder(self, script: Script) -> None:
        """Liveness for chaos_race: its wait has no timeout."""
        row = self.newest(script.workflow_id)
        if row is not None and row.status == "running" and self._waiting(row, "w"):
            pending = int(
                self._db(
                    lambda conn: conn.execute(
                        sa.text(
                            "SELECT count(*) FROM eec_workflow_signal WHERE workflow_id = :w AND "
                            "name = 'go' AND applied_at IS NULL"
                        ),
                        {"w": script.workflow_id},
                    ).scalar_one()
                )
            )
            if pending == 0:
                self._send("go", {"go": True, "fed": True}, None)(script)
        self.later(script, 1.0, self._go_feeder)

    def _feeder(self, script: Script) -> None:
        """Liveness: a waiting tick wait with no tick left gets one."""
        row = self.newest(script.workflow_id)
        if (
            row is not None
            and row.status == "running"
            and any(self._waiting(row, w) for w in ("w0", "w1", "w2"))
        ):
            if self._unapplied_ticks(script.workflow_id) == 0:
                self._send("tick", {"seq": 100}, None)(script)
        self.later(script, 1.0, self._feeder)
