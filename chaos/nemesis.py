"""The nemesis: a seeded schedule of faults, and the code that injects them.

``make_schedule(seed, window_s, ...)`` is a pure function: the same seed, window and worker
set give the same list of faults (kind, time, target, duration, parameter), which the report
prints in full. Faults on one resource never overlap in the schedule (a worker is not killed
while it is stopped, Redis is not restarted during its outage, PostgreSQL is not terminated
while it restarts); faults on different resources do, on purpose. The first faults cycle
through every kind once, so even a short window exercises each of them.

``Nemesis`` runs the schedule against the live processes, each fault in a thread of its own
(a SIGSTOP or an outage lasts a while), records what actually happened, and ``heal()`` brings
everything back at the end of the window (SIGCONT, restart, servers up).
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg
from procs import Worker

log = logging.getLogger("chaos.nemesis")

#: kind -> (weight, what it targets). Targets: a role of worker, or a server.
KINDS: dict[str, tuple[float, str]] = {
    "kill_step_worker": (3.0, "steps"),  # SIGKILL the whole step worker, restart it later
    "kill_step_child": (4.0, "steps"),  # SIGKILL one pool child mid-step (Celery replaces it)
    "kill_coordinator": (2.0, "coord"),  # SIGKILL a coordinator (and its sweeper), restart it
    "kill_coord_child": (1.5, "coord"),  # SIGKILL the coordinator's pool child mid-tick
    "failpoint": (3.0, "failpoint"),  # arm a worker's failpoint: it dies there, once
    "stop_step_worker": (2.0, "steps"),  # SIGSTOP past the step timeout, then SIGCONT (zombie)
    "stop_coordinator": (2.0, "coord"),  # SIGSTOP one coordinator while the other works
    "redis_restart": (1.5, "redis"),  # restart, everything in it lost
    "redis_outage": (0.6, "redis"),  # unreachable ~20 s, then back on the same port (empty)
    "pg_restart": (1.5, "pg"),  # immediate-mode shutdown (crash recovery), then start
    "pg_terminate": (3.0, "pg"),  # pg_terminate_backend of random connections
    "dup_steps": (3.0, "broker"),  # copies of real step messages, shuffled, some late
    "dup_ticks": (3.0, "broker"),  # copies of tick messages, shuffled, some late
    "forged": (2.0, "broker"),  # forged and truncated step and tick messages: dropped, no effect
}

REDIS_OUTAGE_S = 20.0

#: The fleet's faults (``scripts/chaos --fleet``, chaos/fleet_run.py, docs/fleet.md), added to
#: the kinds above when the harness runs on hosts in network namespaces. Target "host": a
#: step-worker or coordinator host; "failover": the database pair.
FLEET_KINDS: dict[str, tuple[float, str]] = {
    "partition_db": (3.0, "host"),  # the host and the database (and pooler) stop hearing each other
    "partition_broker": (3.0, "host"),  # the host and the broker
    "partition_all": (2.0, "host"),  # the host's port on the bridge down: cut from everything
    "flap": (1.5, "host"),  # that port down and up every few hundred milliseconds
    "failover": (1.0, "failover"),  # primary killed, standby promoted, old primary rebuilt
}
#: The broker faults of a fleet whose broker is RabbitMQ (``--fleet --broker rabbitmq``), in
#: place of the ``redis_*`` ones. Target: the broker server (one at a time, like Redis's).
RABBITMQ_KINDS: dict[str, tuple[float, str]] = {
    "rabbitmq_restart": (1.5, "broker_server"),  # clean stop (SIGTERM), then start: mnesia kept
    "rabbitmq_kill": (1.0, "broker_server"),  # SIGKILL of the node, down a moment, then start
}
#: The fleet's kinds that every fleet run injects early (the first faults of its schedule).
FLEET_FIRST = ["partition_db", "partition_broker", "failover", "partition_all", "flap"]
#: ``Fault.param`` bits of a partition: longer than the step timeout; one-way (only the peers'
#: packets to the host are lost: its requests arrive and are acted on, the answers never come).
PARTITION_LONG, PARTITION_ONE_WAY = 1, 2


@dataclass
class Fault:
    seq: int
    at: float  # seconds after the fault window opened
    kind: str
    target: str
    duration: float
    param: int
    # filled in when it runs
    started: float | None = None
    ended: float | None = None
    result: str = "scheduled"
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("at", "duration", "started", "ended"):
            if out[key] is not None:
                out[key] = round(out[key], 3)
        return out


def make_schedule(
    seed: int,
    window_s: float,
    workers: dict[str, str],
    failpoints: list[str],
    *,
    mean_gap_s: float,
    step_timeout: float,
    warmup_s: float = 2.0,
    kinds: dict[str, tuple[float, str]] | None = None,
    first: list[str] | None = None,
) -> list[Fault]:
    """The fault schedule for ``seed``: a pure function of its arguments.

    ``workers``: worker name -> role ("steps"/"coord"); ``failpoints``: names of workers
    started with a failpoint. ``kinds``: kind -> (weight, target role), ``KINDS`` by default
    (the fleet passes ``KINDS`` and the ``FLEET_KINDS`` its topology can inject); ``first``:
    kinds scheduled before the shuffled round of every other kind (in this order).
    """
    kinds_map = KINDS if kinds is None else kinds
    rng = random.Random(seed)
    busy: dict[str, float] = {}
    by_role: dict[str, list[str]] = {
        "steps": sorted(n for n, r in workers.items() if r == "steps"),
        "coord": sorted(n for n, r in workers.items() if r == "coord"),
        "failpoint": sorted(failpoints),
        "redis": ["redis"],
        "pg": ["pg"],
        "broker": ["broker"],
        "broker_server": ["broker"],
        "host": sorted(workers),
        "failover": ["pg"],  # the database pair: never at once with a restart of PostgreSQL
    }
    kinds = sorted(kinds_map)
    bag = kinds[:]
    rng.shuffle(bag)
    if first:
        head = [k for k in first if k in kinds_map]
        bag = [k for k in bag if k not in head] + head[::-1]  # pop() takes from the end
    faults: list[Fault] = []
    t = warmup_s
    while True:
        t += rng.expovariate(1.0 / mean_gap_s)
        if t >= window_s:
            break
        if bag:
            kind = bag.pop()
        else:
            kind = rng.choices(kinds, weights=[kinds_map[k][0] for k in kinds])[0]
        role = kinds_map[kind][1]
        duration, param = _shape(rng, kind, step_timeout)
        if t + duration > window_s:
            continue
        free = [n for n in by_role[role] if busy.get(n, 0.0) <= t]
        if kind == "stop_coordinator":
            # Only while the other coordinator works (it is reserved as well, below).
            free = [n for n in free if all(busy.get(o, 0.0) <= t for o in by_role["coord"])]
        if kind == "failpoint":
            free = [n for n in free if busy.get(f"fp:{n}", 0.0) <= t]
        if not free:
            continue
        target = rng.choice(free)
        hold = _hold(kind, duration)
        if kind == "stop_coordinator":
            for other in by_role["coord"]:
                busy[other] = t + hold
        elif kind == "failpoint":
            busy[f"fp:{target}"] = t + 25.0
            busy[target] = t + 1.0
        elif role != "broker":
            busy[target] = t + hold
        faults.append(Fault(len(faults), round(t, 3), kind, target, round(duration, 3), param))
    return faults


def _shape(rng: random.Random, kind: str, step_timeout: float) -> tuple[float, int]:
    """(duration, parameter) of one fault."""
    if kind in ("kill_step_worker", "kill_coordinator"):
        return rng.uniform(0.5, 3.0), 0  # down time before the restart
    if kind in ("kill_step_child", "kill_coord_child"):
        return 0.0, rng.randrange(8)  # which pool child
    if kind == "stop_step_worker":
        return step_timeout + rng.uniform(2.0, 5.0), 0
    if kind == "stop_coordinator":
        return rng.uniform(4.0, 12.0), 0
    if kind == "redis_outage":
        return REDIS_OUTAGE_S, 0
    if kind == "pg_restart":
        return rng.uniform(0.3, 3.0), 0  # down time after the immediate shutdown
    if kind == "rabbitmq_kill":
        return rng.uniform(0.5, 3.0), 0  # down time after the SIGKILL
    if kind == "pg_terminate":
        return 0.0, rng.randint(1, 6)  # connections to terminate
    if kind in ("dup_steps", "dup_ticks"):
        return 0.0, rng.randint(5, 40)  # messages to copy
    if kind == "forged":
        return 0.0, rng.randint(5, 30)  # messages to forge
    if kind in ("partition_db", "partition_broker", "partition_all"):
        long = rng.random() < 0.5
        one_way = kind != "partition_all" and rng.random() < 0.3
        duration = (
            step_timeout + rng.uniform(2.0, 6.0) if long else step_timeout * rng.uniform(0.3, 0.8)
        )
        return duration, (PARTITION_LONG if long else 0) | (PARTITION_ONE_WAY if one_way else 0)
    if kind == "flap":
        return rng.uniform(3.0, 8.0), rng.randint(200, 800)  # period in milliseconds
    if kind == "failover":
        # Down time; the param (drawn so that every seed keeps its schedule) is not used: the
        # fleet's --replication chooses synchronous or asynchronous.
        return rng.uniform(0.5, 3.0), rng.randint(0, 1)
    return 0.0, 0


def _hold(kind: str, duration: float) -> float:
    """How long a fault keeps its resource (down time plus a restart)."""
    if kind in ("kill_step_worker", "kill_coordinator"):
        return duration + 12.0
    if kind in ("kill_step_child", "kill_coord_child"):
        return 3.0
    if kind == "redis_outage":
        return duration + 3.0
    if kind == "redis_restart":
        return 4.0
    if kind == "pg_restart":
        return duration + 6.0
    if kind == "rabbitmq_restart":
        return 12.0  # a clean stop and a start take ~8 s
    if kind == "rabbitmq_kill":
        return duration + 8.0  # a start takes ~4.5 s
    if kind == "pg_terminate":
        return 1.0
    if kind == "failover":
        return duration + 25.0  # the promotion, then the old primary rebuilt as the standby
    return duration + 1.0


class Nemesis:
    """Runs a schedule against the live cluster; thread-safe enough for one driver."""

    def __init__(
        self,
        schedule: list[Fault],
        workers: dict[str, Worker],
        pg: Any,
        redis: Any,
        dbname: str,
        send_task: Callable[..., Any],
        steps_queue: str,
        coord_queue: str,
        seed: int,
        publish: Callable[[str, str | bytes, str, dict[str, Any] | None], None] | None = None,
    ) -> None:
        self.schedule = schedule
        self.workers = workers
        self.pg = pg
        self.redis = redis
        self.dbname = dbname
        self.send_task = send_task
        self.steps_queue = steps_queue
        self.coord_queue = coord_queue
        #: Publishes a raw message on a queue: (queue, body, content type, headers).
        self.publish = publish
        self.rng = random.Random(seed ^ 0x5EED)
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.t0 = 0.0
        self.redis_down = False
        self.pg_down = False
        self.last_fault_end = 0.0

    # -- running the schedule ---------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.t0

    def run(self, t0: float) -> None:
        """Inject every scheduled fault at its time (blocks; call in a thread)."""
        self.t0 = t0
        for fault in self.schedule:
            wait = fault.at - self.now()
            if wait > 0 and self._stop.wait(wait):
                break
            thread = threading.Thread(
                target=self._run_one, args=(fault,), name=f"fault-{fault.seq}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run_one(self, fault: Fault) -> None:
        fault.started = self.now()
        try:
            getattr(self, f"_do_{fault.kind}")(fault)
            if fault.result == "scheduled":
                fault.result = "done"
        except Exception as exc:  # noqa: BLE001 - a fault that could not be injected
            fault.result = f"failed: {type(exc).__name__}: {exc}"[:300]
            log.warning("fault %s %s failed: %s", fault.seq, fault.kind, exc)
        fault.ended = self.now()
        with self._lock:
            self.last_fault_end = max(self.last_fault_end, fault.ended)
        log.info(
            "fault %s %s on %s: %s %s",
            fault.seq,
            fault.kind,
            fault.target,
            fault.result,
            fault.detail,
        )

    def _sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))

    # -- the faults ---------------------------------------------------------------------------

    def _do_kill_step_worker(self, fault: Fault) -> None:
        self._kill_and_restart(fault)

    def _do_kill_coordinator(self, fault: Fault) -> None:
        self._kill_and_restart(fault)

    def _kill_and_restart(self, fault: Fault) -> None:
        worker = self.workers[fault.target]
        if worker.stopped:
            fault.result = "skipped: stopped"
            return
        with worker.lock:
            worker.expected_down = True
            fault.detail["pids"] = worker.pids()
            worker.kill()
        self._sleep(fault.duration)
        t = time.monotonic()
        with worker.lock:
            worker.start()
            worker.expected_down = False
        fault.detail["ready"] = worker.wait_ready(90)
        fault.detail["restart_s"] = round(time.monotonic() - t, 2)

    def _do_kill_step_child(self, fault: Fault) -> None:
        self._kill_child(fault)

    def _do_kill_coord_child(self, fault: Fault) -> None:
        self._kill_child(fault)

    def _kill_child(self, fault: Fault) -> None:
        worker = self.workers[fault.target]
        if not worker.alive or worker.stopped:
            fault.result = "skipped: worker down or stopped"
            return
        pid = worker.kill_child(fault.param)
        if pid is None:
            fault.result = "skipped: no pool child"
        fault.detail["pid"] = pid

    def _do_failpoint(self, fault: Fault) -> None:
        worker = self.workers[fault.target]
        fault.detail["point"] = worker.failpoint
        worker.arm_failpoint()
        deadline = time.monotonic() + 20.0
        while time.monotonic() < deadline:
            if worker.failpoint_fired():
                fault.detail["fired_after_s"] = round(20.0 - (deadline - time.monotonic()), 2)
                return
            time.sleep(0.05)
        fault.result = "armed, did not fire within 20 s"

    def _do_stop_step_worker(self, fault: Fault) -> None:
        self._stop_for(fault)

    def _do_stop_coordinator(self, fault: Fault) -> None:
        self._stop_for(fault)

    def _stop_for(self, fault: Fault) -> None:
        worker = self.workers[fault.target]
        if not worker.alive:
            fault.result = "skipped: worker down"
            return
        worker.pause()
        self._sleep(fault.duration)
        worker.resume()

    def _do_redis_restart(self, fault: Fault) -> None:
        if self.redis_down:
            fault.result = "skipped: redis down"
            return
        self.redis_down = True
        try:
            self.redis.restart()
        finally:
            self.redis_down = False

    def _do_redis_outage(self, fault: Fault) -> None:
        if self.redis_down:
            fault.result = "skipped: redis down"
            return
        self.redis_down = True
        try:
            self.redis._shutdown(signal.SIGTERM, timeout=30)  # noqa: SLF001 - keep port and dir
            self._sleep(fault.duration)
            self.redis.start()
        finally:
            self.redis_down = False

    def _do_pg_restart(self, fault: Fault) -> None:
        if self.pg_down:
            fault.result = "skipped: pg down"
            return
        self.pg_down = True
        try:
            # Immediate mode: the postmaster quits at once, the next start runs crash recovery.
            self.pg._shutdown(signal.SIGQUIT, timeout=30)  # noqa: SLF001
            self._sleep(fault.duration)
            self.pg.start()
        finally:
            self.pg_down = False

    def _do_pg_terminate(self, fault: Fault) -> None:
        if self.pg_down:
            fault.result = "skipped: pg down"
            return
        with psycopg.connect(self.pg.conninfo(self.dbname), autocommit=True) as conn:
            pids = [
                r[0]
                for r in conn.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> "
                    "pg_backend_pid() AND backend_type = 'client backend' ORDER BY pid",
                    (self.dbname,),
                ).fetchall()
            ]
            victims = self.rng.sample(pids, min(fault.param, len(pids)))
            for pid in victims:
                conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        fault.detail["terminated"] = len(victims)
        fault.detail["of"] = len(pids)

    def _recent(self, query: str, limit: int) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.pg.conninfo(self.dbname), autocommit=True) as conn:
            return [tuple(r) for r in conn.execute(query, (limit,)).fetchall()]

    def _do_dup_steps(self, fault: Fault) -> None:
        if self.redis_down or self.pg_down:
            fault.result = "skipped: broker or database down"
            return
        rows = self._recent(
            "SELECT token, step FROM eec_workflow_step_attempt ORDER BY created_at DESC LIMIT %s",
            300,
        )
        picks = [self.rng.choice(rows) for _ in range(min(fault.param, len(rows)))] if rows else []
        sent = self._publish(
            [
                (step, [token], {"task_id": token, "queue": self.steps_queue})
                for token, step in picks
            ]
        )
        fault.detail.update(messages=sent, distinct=len({t for t, _ in picks}))

    def _do_dup_ticks(self, fault: Fault) -> None:
        if self.redis_down or self.pg_down:
            fault.result = "skipped: broker or database down"
            return
        rows = self._recent(
            "SELECT run_id FROM eec_workflow_run ORDER BY updated_at DESC LIMIT %s", 200
        )
        count = min(fault.param, len(rows))
        picks = [self.rng.choice(rows)[0] for _ in range(count)] if rows else []
        sent = self._publish(
            [("ductor.tick", [run_id], {"queue": self.coord_queue}) for run_id in picks]
        )
        fault.detail.update(messages=sent, distinct=len(set(picks)))

    def _do_forged(self, fault: Fault) -> None:
        """Messages nobody issued, put straight on the queues: each must be logged and dropped
        by the worker that takes it, and change nothing (the checker still passes); the
        envelopes that would kill or wedge a Celery 5.7 worker before any task code runs
        included (runtime/poison.py drops those)."""
        if self.redis_down or self.pg_down:
            fault.result = "skipped: broker or database down"
            return
        attempts = self._recent(
            "SELECT token, step FROM eec_workflow_step_attempt ORDER BY created_at DESC LIMIT %s",
            100,
        )
        runs = self._recent(
            "SELECT run_id, workflow_id FROM eec_workflow_run ORDER BY updated_at DESC LIMIT %s",
            50,
        )
        menu = forged_messages(self.rng, attempts, runs, self.steps_queue, self.coord_queue)
        if self.publish is None:
            menu = [m for m in menu if m[0] == "task"]
        shapes: dict[str, int] = {}
        for _ in range(fault.param):
            how, what, queue, name_or_body, args_or_type, extra = self.rng.choice(menu)
            if how == "task":
                self.send_task(
                    name_or_body, args=args_or_type, kwargs=extra, queue=queue, serializer="json"
                )
            else:
                assert self.publish is not None
                self.publish(queue, name_or_body, args_or_type, extra)
            shapes[what] = shapes.get(what, 0) + 1
        fault.detail.update(messages=fault.param, shapes=shapes)

    def _publish(self, messages: list[tuple[str, list[Any], dict[str, Any]]]) -> int:
        """Send copies shuffled; some of them (a random tail) a moment later, out of order."""
        copies = [m for m in messages for _ in range(self.rng.randint(1, 3))]
        self.rng.shuffle(copies)
        cut = self.rng.randint(0, len(copies))
        sent = 0
        for i, (name, args, opts) in enumerate(copies):
            if i == cut:
                time.sleep(self.rng.uniform(0.2, 2.0))
            self.send_task(name, args=args, serializer="json", **opts)
            sent += 1
        return sent

    # -- healing ------------------------------------------------------------------------------

    def heal(self, timeout: float = 120.0) -> float:
        """Wait for faults in progress to end, then make sure everything runs again.
        Returns the time (seconds after t0) at which the last fault ended."""
        self.stop()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for worker in self.workers.values():
            worker.disarm_failpoint()
            if worker.stopped:
                worker.resume()
        for worker in self.workers.values():
            with worker.lock:
                if not worker.alive:
                    worker.expected_down = False
                    worker.start()
            worker.wait_ready(90)
        with contextlib.suppress(Exception):
            if not self.redis.running:
                self.redis.start()
        with contextlib.suppress(Exception):
            if not self.pg.running:
                self.pg.start()
        with self._lock:
            self.last_fault_end = max(self.last_fault_end, self.now())
            return self.last_fault_end

    def summary(self) -> dict[str, Any]:
        by_kind: dict[str, dict[str, int]] = {}
        for fault in self.schedule:
            entry = by_kind.setdefault(fault.kind, {"scheduled": 0, "injected": 0})
            entry["scheduled"] += 1
            if fault.result == "done":
                entry["injected"] += 1
        return by_kind


def _headers(rng: random.Random, task: Any, **extra: Any) -> dict[str, Any]:
    """Celery's protocol-2 headers for a message nobody sent through Celery."""
    task_id = f"forged-{rng.getrandbits(48):012x}"
    headers = {
        "lang": "py",
        "task": task,
        "id": task_id,
        "root_id": task_id,
        "parent_id": None,
        "group": None,
        "retries": 0,
        "timelimit": [None, None],
        "eta": None,
        "expires": None,
        "argsrepr": "forged",
        "kwargsrepr": "{}",
        "origin": "nemesis",
    }
    headers.update(extra)
    return headers


def forged_messages(
    rng: random.Random,
    attempts: list[tuple[Any, ...]],
    runs: list[tuple[Any, ...]],
    steps_queue: str,
    coord_queue: str,
) -> list[tuple[str, str, str, Any, Any, Any]]:
    """The menu of forged messages, built from recent rows: ("task", shape, queue, task name,
    args, kwargs) sent with ``send_task``, or ("raw", shape, queue, body, content type,
    headers) published as they are."""
    token, step = rng.choice(attempts) if attempts else ("no-such-token", "chaos.work")
    steps = sorted({s for _, s in attempts}) or [step]
    other = next((s for s in steps if s != step), None)
    run_id, workflow_id = rng.choice(runs) if runs else ("no-such-run", "no-such-workflow")
    body = json.dumps(
        [[token], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
    )
    menu: list[tuple[str, str, str, Any, Any, Any]] = [
        ("task", "unknown token", steps_queue, step, [f"{token}:forged"], None),
        ("task", "token not a string", steps_queue, step, [rng.choice([5, None, True])], None),
        ("task", "token a container", steps_queue, step, [rng.choice([[token], {"t": 1}])], None),
        ("task", "token with NUL", steps_queue, step, [f"{token}\x00"], None),
        ("task", "no token", steps_queue, step, [], None),
        ("task", "one argument too many", steps_queue, step, [token, "extra"], None),
        ("task", "unknown keyword", steps_queue, step, [token], {"forged": True}),
        ("task", "unregistered step", steps_queue, "chaos.no_such_step", [token], None),
        ("task", "unknown run", coord_queue, "ductor.tick", [f"no-such-run-{rng.random()}"], None),
        ("task", "workflow id as run id", coord_queue, "ductor.tick", [workflow_id], None),
        ("task", "run id not a string", coord_queue, "ductor.tick", [rng.choice([5, None])], None),
        ("task", "no run id", coord_queue, "ductor.tick", [], None),
        ("task", "a tick with two run ids", coord_queue, "ductor.tick", [run_id, run_id], None),
        ("task", "a step message on the coordinator", coord_queue, step, [f"{token}:forged"], None),
        ("raw", "garbage JSON", steps_queue, "{not json", "application/json", _headers(rng, step)),
        (
            "raw",
            "truncated JSON",
            rng.choice([steps_queue, coord_queue]),
            body[: rng.randint(1, len(body) - 1)],
            "application/json",
            _headers(rng, step),
        ),
        (
            "raw",
            "pickle",
            steps_queue,
            pickle.dumps([[token], {}, {}]),
            "application/x-python-serialize",
            _headers(rng, step),
        ),
        (
            "raw",
            "no headers",
            rng.choice([steps_queue, coord_queue]),
            body,
            "application/json",
            None,
        ),
        (
            "raw",
            "unknown task",
            coord_queue,
            body,
            "application/json",
            _headers(rng, "ductor.no_such_task"),
        ),
        ("raw", "bad ETA", steps_queue, body, "application/json", _headers(rng, step, eta="never")),
        # Envelopes that escape Celery 5.7's own per-message handling (the worker would exit,
        # or reconnect forever): runtime/poison.py drops them on ductor's queues.
        (
            "raw",
            "body not an [args, kwargs, embed] triple",
            rng.choice([steps_queue, coord_queue]),
            json.dumps(rng.choice(["a string", {"args": [token]}, [[token]], None])),
            "application/json",
            _headers(rng, step),
        ),
        ("raw", "empty body", steps_queue, "", "application/json", _headers(rng, step)),
        (
            "raw",
            "binary body",
            steps_queue,
            b"\x00\xffnot a task",
            "application/data",
            _headers(rng, step),
        ),
        (
            "raw",
            "headers without an id",
            rng.choice([steps_queue, coord_queue]),
            body,
            "application/json",
            {k: v for k, v in _headers(rng, step).items() if k != "id"},
        ),
        (
            "raw",
            "timelimit not a pair",
            steps_queue,
            body,
            "application/json",
            _headers(rng, step, timelimit=5),
        ),
        ("raw", "task name a list", coord_queue, body, "application/json", _headers(rng, [step])),
    ]
    if other is not None:
        menu.append(("task", "another step's token", steps_queue, other, [token], None))
    return menu
