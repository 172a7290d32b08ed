"""The benchmark's Celery apps: ``app`` (ductor) and ``raw`` (plain Celery, same work).

Both do the same trivial work per task, ``value + 1``, so the figures measure orchestration,
not the work:

* ``app``: a ductor step ``bench.echo`` and the workflow ``bench_chain10`` (10 sequential
  ``bench.echo`` steps, each fed the previous output). No result backend: ductor's tasks
  never use one. Its workers are the production commands
  ``celery -A bench_app worker -Q ductor-steps -c 2`` and ``... -Q ductor-coord -c 1``.
  ``bench_chain10_carry`` (``bench.carry``; ``raw.carry`` on the raw side): the same chain
  passing a document on from step to step, for ``run.py --payload-items``.
* ``raw``: ``raw.echo`` (for ``chain``) and ``raw.count`` (for throughput: it INCRs a Redis
  counter, so the driver counts completions without a result per task). Its result backend is
  the benchmark's Redis (another db index). Worker: ``celery -A bench_app:raw worker -Q
  bench-raw -c 2``.

Configured from the environment, which ``run.py`` sets: ``DUCTOR_DATABASE_URL``,
``BENCH_BROKER_URL`` (ductor's broker), ``BENCH_RAW_BROKER_URL``, ``BENCH_RAW_BACKEND_URL``,
``BENCH_COUNTER_URL``. Optional instrumentation, both off unless asked for:

* ``BENCH_TIMERS_DIR``: each worker process appends one JSON line per tick and per step to
  ``<dir>/<pid>.jsonl`` with wall-clock timestamps of its phases (load, compute, commit,
  dispatch, clear outbox; claim, function, finish, wake). Cost: a few ``perf_counter`` calls
  and one ``write()`` per task (~10 us), next to ticks of several ms.
* ``BENCH_PROFILE_DIR``: every tick and every step runs under ``cProfile``; each worker child
  dumps ``<dir>/<tick|step>-<pid>.prof`` (pstats) periodically and when it shuts down.

``BENCH_READY_DIR``: the worker_ready signal writes a file there (how run.py knows a worker
consumes; the production commands log at WARNING). ``BENCH_EXPERIMENTS``: comma-separated
what-ifs (``no-events``, ``no-sweeper``, ``no-pre-ping``, ``no-prepare``), never on in the
default figures.

``BENCH_INLINE`` (a count; unset: the package default) sets ``ductor_inline_steps``.
``BENCH_EAGER`` (``1``/``0``; unset: the package default) sets ``ductor_eager_ticks``: run.py
measures the ductor phases once per mode. ``BENCH_BATCH_SIZE`` (default 100): the batch size
of ``bench_scatter_batched``, registered only when ``Workflow.scatter`` accepts ``batch_size``
(``BATCHED_SCATTER`` is then its name, else ``None`` and ``BATCHED_UNAVAILABLE`` says why).

The instrumentation and the experiments patch ductor from outside (module attributes looked
up at call time); the package itself is not modified.
"""

from __future__ import annotations

import atexit
import cProfile
import inspect
import json
import os
import sys
import threading
import time
from typing import Any

import redis
from celery import Celery
from celery.signals import worker_process_shutdown, worker_ready
from common import APP_EXPERIMENTS

from ductor_celery import Ductor, RateLimit, StepContext, Workflow

STEPS_QUEUE = "ductor-steps"
COORD_QUEUE = "ductor-coord"
RAW_QUEUE = "bench-raw"
COUNTER_KEY = "bench:raw:done"

# --------------------------------------------------------------------------------------------
# ductor
# --------------------------------------------------------------------------------------------

app = Celery("bench")
app.conf.update(
    broker_url=os.environ.get("BENCH_BROKER_URL", "memory://"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)
EXPERIMENTS = set(filter(None, os.environ.get("BENCH_EXPERIMENTS", "").split(",")))
KNOWN_EXPERIMENTS = set(APP_EXPERIMENTS)
if EXPERIMENTS - KNOWN_EXPERIMENTS:
    raise SystemExit(f"unknown experiments {EXPERIMENTS - KNOWN_EXPERIMENTS}")
if "no-events" in EXPERIMENTS:
    # ductor turns task events on unless the app decided; this is the app deciding "off".
    app.conf.update(worker_send_task_events=False, task_send_sent_event=False)
if "no-sent-events" in EXPERIMENTS:
    # Only the task-sent events that follow publishes (a step message, a wake-up; a run's
    # start message has none since 0.3.20).
    app.conf.update(task_send_sent_event=False)
if "classic-queues" in EXPERIMENTS:
    # On RabbitMQ: ductor's queues declared classic, as raw Celery's are (quorum by default).
    app.conf.update(ductor_classic_queues=True)
if "no-sweeper" in EXPERIMENTS:
    # The sweeper still starts, but sweeps once an hour: no re-sent wake-ups.
    app.conf.update(ductor_sweep_interval=3600.0)
if os.environ.get("BENCH_EAGER", "") != "":
    # Read by Ductor(app) below, so it must be set first.
    app.conf.update(ductor_eager_ticks=os.environ["BENCH_EAGER"] not in ("0", "false", "off"))
if os.environ.get("BENCH_INLINE", "") != "":
    app.conf.update(ductor_inline_steps=int(os.environ["BENCH_INLINE"]))
ductor = Ductor(app)


def _experimental_engines() -> None:
    """What-if knobs for the report, never on in the default figures: build ductor's
    PostgreSQL engine without the pool pre-ping and/or without psycopg prepared statements."""
    import sqlalchemy as sa

    from ductor_celery.store import db

    original = db._create_engine

    def create(url: str) -> Any:
        if url.startswith("sqlite"):
            return original(url)
        connect_args = {"prepare_threshold": None} if "no-prepare" in EXPERIMENTS else {}
        return sa.create_engine(
            url,
            json_serializer=db._json_dumps,
            pool_pre_ping="no-pre-ping" not in EXPERIMENTS,
            pool_size=5,
            max_overflow=10,
            pool_recycle=1800,
            connect_args=connect_args,
        )

    db._create_engine = create


if EXPERIMENTS & {"no-pre-ping", "no-prepare"}:
    _experimental_engines()


@ductor.step(name="bench.echo")
def echo(ctx: StepContext, value: int = 0) -> int:
    return value + 1


def _register_chain10(name: str, step: Any) -> None:
    """10 sequential ``step`` steps, the first fed the input's ``value``, each next one the
    output before it; the run's output is the last step's."""
    chain = Workflow(name, version=1)
    chain.step("s0", step, args={"value": "$.input.value"})
    for i in range(1, 10):
        chain.step(f"s{i}", step, after=[f"s{i - 1}"], args={"value": f"$.nodes.s{i - 1}.output"})
    chain.output("$.nodes.s9.output")
    ductor.register(chain)


_register_chain10("bench_chain10", echo)


@ductor.step(name="bench.carry")
def carry(ctx: StepContext, value: dict[str, Any]) -> dict[str, Any]:
    """``--payload-items``: a document passed on, its count one higher."""
    return {"n": value["n"] + 1, "items": value["items"]}


_register_chain10("bench_chain10_carry", carry)

#: The same chain under a rate limit that is never reached (benchmarks/rate_limit_cost.py):
#: what the bucket costs a step. One key for every run, the worst case for the bucket's lock.
RATED_WORKFLOW = "bench_chain10_rated"


@ductor.step(name="bench.echo_rated", rate_limit=RateLimit("1000000/s"))
def echo_rated(ctx: StepContext, value: int = 0) -> int:
    return value + 1


_register_chain10(RATED_WORKFLOW, echo_rated)

#: One no-op step per item: the scatter benchmark (benchmarks/scatter.py).
scatter_wf = Workflow("bench_scatter", version=1)
scatter_wf.scatter("each", echo, over="$.input.items", item_arg="value")
scatter_wf.output({"count": "$.input.count"})
ductor.register(scatter_wf)

BATCH_SIZE = int(os.environ.get("BENCH_BATCH_SIZE") or 100)
#: The batched variant (one message and one attempt per ``BATCH_SIZE`` items), when the package
#: has it; the driver and the workers import this module with the same environment, so both
#: register the same definition.
BATCHED_SCATTER: str | None = None
BATCHED_UNAVAILABLE: str | None = None


def _register_batched() -> None:
    global BATCHED_SCATTER, BATCHED_UNAVAILABLE
    if "batch_size" not in inspect.signature(Workflow.scatter).parameters:
        BATCHED_UNAVAILABLE = "Workflow.scatter has no batch_size parameter"
        return
    wf = Workflow("bench_scatter_batched", version=1)
    try:
        wf.scatter("each", echo, over="$.input.items", item_arg="value", batch_size=BATCH_SIZE)
        wf.output({"count": "$.input.count"})
        ductor.register(wf)
    except Exception as exc:  # noqa: BLE001 - a half-built feature must not stop the benchmark
        BATCHED_UNAVAILABLE = f"registering it failed: {exc!r}"
        return
    BATCHED_SCATTER = wf.name


_register_batched()

# --------------------------------------------------------------------------------------------
# raw Celery
# --------------------------------------------------------------------------------------------

raw = Celery("bench_raw")
raw.conf.update(
    broker_url=os.environ.get("BENCH_RAW_BROKER_URL", "memory://"),
    result_backend=os.environ.get("BENCH_RAW_BACKEND_URL") or None,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    task_default_queue=RAW_QUEUE,
    result_expires=600,
)


@raw.task(name="raw.echo")
def raw_echo(value: int = 0) -> int:
    return value + 1


@raw.task(name="raw.carry")
def raw_carry(value: dict[str, Any]) -> dict[str, Any]:
    """``--payload-items``: as ``bench.carry``; a chain passes each result to the next."""
    return {"n": value["n"] + 1, "items": value["items"]}


@raw.task(name="raw.noop")
def raw_noop(value: int = 0) -> int:
    return value


@raw.task(name="raw.count_results")
def raw_count_results(results: list[int]) -> int:
    return len(results)


_counter: tuple[int, redis.Redis] | None = None


def _counter_client() -> redis.Redis:
    """One Redis client per process (a prefork child must not reuse its parent's socket)."""
    global _counter
    if _counter is None or _counter[0] != os.getpid():
        _counter = (os.getpid(), redis.Redis.from_url(os.environ["BENCH_COUNTER_URL"]))
    return _counter[1]


@raw.task(name="raw.count", ignore_result=True)
def raw_count(value: int = 0) -> int:
    _counter_client().incr(COUNTER_KEY)
    return value + 1


@worker_ready.connect(weak=False)
def _announce_ready(sender: Any = None, **_: Any) -> None:
    """Tell run.py this worker is consuming (the production commands log at WARNING, so the
    "ready." log line is not there to watch)."""
    directory = os.environ.get("BENCH_READY_DIR")
    if directory:
        name = getattr(sender, "hostname", None) or str(os.getpid())
        with open(os.path.join(directory, name.split("@")[0]), "w") as fh:
            fh.write(str(os.getpid()))


# --------------------------------------------------------------------------------------------
# Instrumentation (worker processes only; enabled by environment variables)
# --------------------------------------------------------------------------------------------


class _Timers:
    """Phase timers for ticks and steps, appended as JSON lines to a per-process file."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.local = threading.local()
        self._fd: int | None = None
        self._pid = 0

    def emit(self, record: dict[str, Any]) -> None:
        if self._fd is None or self._pid != os.getpid():
            self._pid = os.getpid()
            path = os.path.join(self.directory, f"{self._pid}.jsonl")
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def current(self) -> dict[str, Any] | None:
        return getattr(self.local, "rec", None)

    def phase(self, name: str, fn: Any) -> Any:
        """Wrap ``fn`` so its duration lands in the current record under ``name``."""

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            rec = self.current()
            if rec is None:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                rec[name] = rec.get(name, 0.0) + (t1 - t0)
                rec[f"{name}_end"] = time.time()

        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapped

    def task(self, kind: str, fn: Any, describe: Any, after: Any = None) -> Any:
        """Wrap a whole tick or step: start/end wall times, total, and the phases inside.

        Records nest: an eager tick runs inside the step that wrote the outcome, so the step's
        record is set aside while the tick runs and its later phases (the wake-up when the
        tick was busy) land in it again. ``after(rec)`` adds fields once the call returned."""

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            rec: dict[str, Any] = {"k": kind, "start": time.time(), **describe(*args, **kwargs)}
            outer = self.current()
            self.local.rec = rec
            t0 = time.perf_counter()
            result = None
            try:
                result = fn(*args, **kwargs)
                return result
            finally:
                rec["total"] = time.perf_counter() - t0
                rec["end"] = time.time()
                rec["result"] = result if isinstance(result, str) else None
                if outer is not None:
                    # The outer call's total includes this one: say how much of it.
                    rec["nested_in"] = outer["k"]
                    outer[f"nested_{kind}"] = outer.get(f"nested_{kind}", 0.0) + rec["total"]
                if after is not None:
                    after(rec)
                self.local.rec = outer
                self.emit(rec)

        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapped


class _Profiles:
    """One cProfile.Profile per (process, kind), enabled only while a tick or step runs."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._profiles: dict[str, cProfile.Profile] = {}
        self._calls: dict[str, int] = {}
        self._wall: dict[str, float] = {}
        self._seen: dict[str, int] = {}
        self._pid = os.getpid()
        self._last_dump = time.monotonic()

    def _reset_after_fork(self) -> None:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._profiles.clear()
            self._calls.clear()
            self._wall.clear()
            self._seen.clear()

    #: Calls per process and kind left out of the profile: the first ones import modules,
    #: build engines and connect, which is start-up cost, not per-step cost.
    SKIP_FIRST = int(os.environ.get("BENCH_PROFILE_SKIP", "3"))

    def wrap(self, kind: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self._reset_after_fork()
            seen = self._seen.get(kind, 0)
            self._seen[kind] = seen + 1
            if seen < self.SKIP_FIRST:
                return fn(*args, **kwargs)
            prof = self._profiles.get(kind)
            if prof is None:
                prof = self._profiles[kind] = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            try:
                return fn(*args, **kwargs)
            finally:
                prof.disable()
                self._wall[kind] = self._wall.get(kind, 0.0) + time.perf_counter() - t0
                self._calls[kind] = self._calls.get(kind, 0) + 1
                if time.monotonic() - self._last_dump > 2.0:
                    self.dump()

        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapped

    def dump(self) -> None:
        if self._pid != os.getpid():
            return
        self._last_dump = time.monotonic()
        for kind, prof in self._profiles.items():
            base = os.path.join(self.directory, f"{kind}-{os.getpid()}")
            prof.dump_stats(base + ".prof")
            with open(base + ".json", "w") as fh:
                json.dump({"calls": self._calls.get(kind, 0), "wall": self._wall.get(kind, 0)}, fh)


def _instrument() -> None:
    from ductor_celery.coordinator import loop
    from ductor_celery.runtime import runtime, tick_task
    from ductor_celery.runtime.dispatch import Dispatcher
    from ductor_celery.store import attempts, tick_store

    # Innermost first: the phase timers, then cProfile around the whole tick/step, then the
    # task timer (so a record's total includes the profiler's own overhead when both are on).
    timers_dir = os.environ.get("BENCH_TIMERS_DIR")
    profile_dir = os.environ.get("BENCH_PROFILE_DIR")
    timers = _Timers(timers_dir) if timers_dir else None

    if timers is not None:
        # (module, attribute, phase name). The package moves on; a phase whose function is
        # gone is skipped (the breakdown then lacks it) rather than breaking the workers.
        for owner, attr, name in (
            # The tick's transaction: checkout, BEGIN and its SET LOCAL; then the COMMIT
            # (a carried tick's checkout is in its load, in autocommit, with no BEGIN).
            (getattr(tick_store, "SqlTickTransaction", object), "__enter__", "tx_begin"),
            (tick_store, "load_on", "load_tick"),
            (loop, "compute_tick", "compute_tick"),
            (tick_store, "commit_on", "commit_tick"),
            # A carried tick's commit alone, in autocommit (docs/tick-without-transaction.md).
            (tick_store, "commit_alone", "commit_tick"),
            (getattr(tick_store, "SqlTickTransaction", object), "__exit__", "tx_end"),
            (tick_task, "delete_outbox", "delete_outbox"),
            (Dispatcher, "send", "send"),
            (attempts, "claim", "claim"),
            (attempts, "finish", "finish"),
            (runtime.Runtime, "wake", "wake"),
        ):
            if hasattr(owner, attr):
                setattr(owner, attr, timers.phase(name, getattr(owner, attr)))
            else:
                sys.stderr.write(f"bench_app: no {owner.__name__}.{attr}; phase not timed\n")
        # When the first message of a tick or step (the step message, the wake-up) reached
        # Redis: later publishes in the same call are Celery's task-sent events.
        from kombu import Producer

        publish = Producer.publish

        def first_publish(self_: Any, *args: Any, **kwargs: Any) -> Any:
            result = publish(self_, *args, **kwargs)
            rec = timers.current() if timers is not None else None
            if rec is not None:
                rec["publishes"] = rec.get("publishes", 0) + 1
                rec.setdefault("first_publish_end", time.time())
            return result

        Producer.publish = first_publish  # type: ignore[method-assign]
        # The step function itself (what a user's code costs; here value + 1).
        step = ductor._steps["bench.echo"]
        step.fn = timers.phase("fn", step.fn)

    run_tick = runtime.run_tick
    execute_attempt = runtime.execute_attempt
    if profile_dir:
        profiles = _Profiles(profile_dir)
        run_tick = profiles.wrap("tick", run_tick)
        execute_attempt = profiles.wrap("step", execute_attempt)
        atexit.register(profiles.dump)

        @worker_process_shutdown.connect(weak=False)
        def _dump_profiles(**_: Any) -> None:
            profiles.dump()

    if timers is not None:
        run_tick = timers.task("tick", run_tick, _describe_tick, _tick_recomputes)
        execute_attempt = timers.task(
            "step", execute_attempt, lambda _rt, _step, token, **_kw: {"token": token}
        )
    if timers is not None:
        _instrument_inline_steps(timers)
    # The tick runs on the coordinator queue (runtime's task) and eagerly in step workers
    # (wherever the hook imported it from): replace every module-level reference.
    _replace_everywhere(runtime.run_tick, run_tick)
    _replace_everywhere(runtime.execute_attempt, execute_attempt)


def _instrument_inline_steps(timers: _Timers) -> None:
    """A step record for each inline attempt (runtime/inline.py), which no message brought:
    ``execute_attempt`` runs only for a message's attempt, and a run whose first tick ran on a
    step worker runs every step inline, so without this its path has ticks and no steps. The
    package has no public hook there: this wraps ``steps._run_claimed`` (run, record, tick),
    which runs both a message's attempt (inside ``execute_attempt``'s record, the same token:
    passed through) and each inline one (a record of its own, ``inline``). Skipped, with a
    note, when the package no longer has it."""
    from ductor_celery.runtime import steps

    original = getattr(steps, "_run_claimed", None)
    if original is None:
        sys.stderr.write("bench_app: no steps._run_claimed; inline steps not timed\n")
        return

    def describe(_rt: Any, _engine: Any, _step: Any, claimed: Any, *_a: Any, **_k: Any) -> Any:
        return {"token": claimed.token, "inline": True}

    inline = timers.task("step", original, describe)

    def run_claimed(*args: Any, **kwargs: Any) -> Any:
        rec = timers.current()
        claimed = args[3] if len(args) > 3 else kwargs["claimed"]
        if rec is not None and rec.get("k") == "step" and rec.get("token") == claimed.token:
            return original(*args, **kwargs)  # a message's attempt: execute_attempt's record
        return inline(*args, **kwargs)

    run_claimed.__wrapped__ = original  # type: ignore[attr-defined]
    steps._run_claimed = run_claimed


def _tick_stats() -> Any:
    from ductor_celery.runtime import tick_task

    return getattr(tick_task, "TICK_STATS", None)


def _describe_tick(_rt: Any, run_id: str, *_args: Any, **kwargs: Any) -> dict[str, Any]:
    """A tick record: the run, whether a step worker ran it eagerly, and the process's
    recompute counter before it (``_tick_recomputes`` turns that into this tick's count)."""
    stats = _tick_stats()
    return {
        "run": run_id,
        "eager": bool(kwargs.get("eager", False)),
        "_c0": getattr(stats, "conflicts", 0),
    }


def _tick_recomputes(rec: dict[str, Any]) -> None:
    stats = _tick_stats()
    rec["conflicts"] = getattr(stats, "conflicts", 0) - rec.pop("_c0", 0)


def _replace_everywhere(original: Any, replacement: Any) -> None:
    """Point every ``ductor_celery`` module attribute that is ``original`` at ``replacement``
    (``from .tick_task import run_tick`` copies the reference into the importing module)."""
    if replacement is original:
        return
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("ductor_celery"):
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, replacement)


if os.environ.get("BENCH_TIMERS_DIR") or os.environ.get("BENCH_PROFILE_DIR"):
    _instrument()
