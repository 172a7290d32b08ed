"""Celery glue: registers the tick task and step tasks on the app and holds per-process state."""

from __future__ import annotations

import keyword
import logging
import threading
from typing import Any

from sqlalchemy.engine import Connection, Engine

from ..definition.spec import WorkflowSpec
from ..settings import Settings
from ..store import blobs, runs
from ..store.db import get_engine
from .broker import BrokerQueues, QueuesBootstep
from .dispatch import (
    FIRST_TICK_TASK_NAME,
    HELD_HEADER,
    QUICK_HEADER,
    TICK_TASK_NAME,
    CarriedBranches,
    Dispatcher,
    carried_branches,
    quick_branches,
)
from .failpoints import failpoint
from .metrics import MetricsBootstep
from .poison import PoisonGuard
from .step_context import Step
from .steps import execute_attempt, first_tick
from .sweeper import SweeperBootstep
from .tick_task import run_tick

log = logging.getLogger("ductor_celery.runtime")


class Runtime:
    """Everything a worker process needs to run ticks and steps for one Celery app.

    The modules it calls into take it as a ``ports.WorkerPort`` (the few members they use),
    so none of them imports this module back (tests/unit/test_runtime_layers.py)."""

    def __init__(self, app: Any, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self._specs: dict[str, WorkflowSpec] = {}
        self._steps: dict[str, Step] = {}
        #: ductor's queues on the broker (RabbitMQ: quorum queues, confirms; runtime/broker.py).
        self.queues = BrokerQueues(app, settings, self.ductor_queues)
        self.dispatcher = Dispatcher(
            app, settings.steps_queue, settings.coord_queue, queues=self.queues
        )
        self._specs_lock = threading.Lock()
        self._schema_ready = False
        self.failpoint = failpoint
        app._ductor_runtime = self
        # Registered on the app by name (Celery finds them there); nothing keeps a reference.
        self._register_tick_task()
        self._register_first_tick_task()
        if SweeperBootstep not in app.steps["worker"]:
            app.steps["worker"].add(SweeperBootstep)
        if MetricsBootstep not in app.steps["worker"]:
            app.steps["worker"].add(MetricsBootstep)
        if QueuesBootstep not in app.steps["worker"]:
            app.steps["worker"].add(QueuesBootstep)
        if PoisonGuard not in app.steps["consumer"]:
            app.steps["consumer"].add(PoisonGuard)

    def engine(self) -> Engine:
        engine = get_engine(self.settings.database_url, prepare=self.settings.database_prepare)
        blobs.configure(engine, self.settings.offload_bytes)
        if self.settings.embedded and not self._schema_ready:
            self._ensure_embedded_schema()
        return engine

    def _ensure_embedded_schema(self) -> None:
        """The embedded SQLite default needs no ``ductor migrate``: it migrates on first use."""
        with self._specs_lock:
            if not self._schema_ready:
                from ..store.migrate import upgrade

                upgrade(self.settings.database_url)
                self._schema_ready = True

    def wake(self, run_id: str) -> None:
        self.dispatcher.wake(run_id)

    def tick_here(self, run_id: str) -> str:
        """One tick of the run in this process, waiting for the run's lock as the coordinator
        does (a client applying a control before its call returns)."""
        return run_tick(self, run_id)

    def wake_started(self, run_id: str) -> None:
        """The first wake-up of a run just started: with eager ticks, to the step workers, the
        first of which to take it ticks the run and runs its first step itself
        (``steps.first_tick``); otherwise to the coordinator, as every other wake-up."""
        if self.settings.eager_ticks:
            self.dispatcher.first_tick(run_id)
        else:
            self.dispatcher.wake(run_id)

    def remember_spec(self, spec: WorkflowSpec) -> None:
        with self._specs_lock:
            self._specs[spec.spec_hash] = spec

    def spec_for(self, spec_hash: str, conn: Connection | None = None) -> WorkflowSpec:
        """A pinned definition: from this process's cache, else read (on ``conn`` if given)."""
        spec = self._specs.get(spec_hash)
        if spec is None:
            spec = runs.load_definition(conn if conn is not None else self.engine(), spec_hash)
            if spec is None:
                raise LookupError(f"workflow definition {spec_hash} is not in the database")
            self.remember_spec(spec)
        return spec

    def consumes_coord_queue(self, app: Any) -> bool:
        consume_from = getattr(app.amqp.queues, "consume_from", None)
        if not consume_from:
            return bool(app.conf.get("ductor_sweeper", False))
        return self.settings.coord_queue in consume_from

    def _register_tick_task(self) -> Any:
        rt = self

        @self.app.task(  # type: ignore[untyped-decorator]
            name=TICK_TASK_NAME,
            bind=True,
            queue=self.settings.coord_queue,
            ignore_result=True,
            serializer="json",
            acks_late=True,
            shared=False,
        )
        def tick(task: Any, run_id: str) -> str:
            problem = _id_problem(run_id, RUN_ID_CHARS)
            if problem is not None:
                log.warning("tick message with a run id that %s dropped: %.200r", problem, run_id)
                return "malformed"
            quick = quick_branches(task.request.get(QUICK_HEADER))
            # The plain value: Celery's task-succeeded event (Flower) shows its repr.
            return str(run_tick(rt, run_id, quick=quick))

        return tick

    def _register_first_tick_task(self) -> Any:
        rt = self

        @self.app.task(  # type: ignore[untyped-decorator]
            name=FIRST_TICK_TASK_NAME,
            bind=True,
            queue=self.settings.steps_queue,
            ignore_result=True,
            serializer="json",
            acks_late=True,
            reject_on_worker_lost=True,
            shared=False,
            send_events=False,
        )
        def first(task: Any, run_id: str) -> str:
            problem = _id_problem(run_id, RUN_ID_CHARS)
            if problem is not None:
                log.warning("start message with a run id that %s dropped: %.200r", problem, run_id)
                return "malformed"
            request = task.request
            return str(
                first_tick(
                    rt, run_id, request.hostname, _delivered_from(request), _task_id(request)
                )
            )

        return first

    def register_step(self, step: Step) -> Any:
        rt = self

        def run(task: Any, token: str) -> str:
            problem = _id_problem(token, TOKEN_CHARS)
            if problem is not None:
                log.warning("step message with a token that %s dropped: %.200r", problem, token)
                return "malformed"
            request = task.request
            return execute_attempt(
                rt,
                step,
                token,
                hostname=request.hostname,
                queue=_delivered_from(request),
                carrier=_task_id(request),
                held=_carried(request, token),
            )

        # Celery compiles a signature checker named after the task function with exec
        # (celery.utils.functional.head_from_fun), when the app is finalized: a name that is
        # not an identifier ("<lambda>") stops every worker from starting, and a partial has
        # no name at all. Borrow the step function's name only when it is safe to.
        fn_name = getattr(step.fn, "__name__", None)
        run.__name__ = (
            fn_name
            if isinstance(fn_name, str)
            and fn_name.isidentifier()
            and not keyword.iskeyword(fn_name)
            else "step"
        )
        run.__doc__ = getattr(step.fn, "__doc__", None)
        task = self.app.task(
            name=step.name,
            bind=True,
            queue=step.queue or self.settings.steps_queue,
            ignore_result=True,
            serializer="json",
            acks_late=True,
            reject_on_worker_lost=True,
            shared=False,
        )(run)
        step.task = task
        self._steps[step.name] = step
        return task

    def ductor_queues(self) -> set[str]:
        """The queues ductor's own messages travel on (PoisonGuard looks after these)."""
        return {self.settings.steps_queue, self.settings.coord_queue} | {
            s.queue for s in self._steps.values() if s.queue
        }

    def step_named(self, name: str) -> Step | None:
        """The step registered under a task name in this process (inline steps run only
        what this worker could have run from a message)."""
        return self._steps.get(name)


#: The widest token and run id the tables hold (a longer one names nothing).
TOKEN_CHARS = 300
RUN_ID_CHARS = 64


def _id_problem(value: Any, limit: int) -> str | None:
    """Why a message's token or run id cannot name a row, or None: checked before any query,
    so a forged message is one warning line, not a database error's traceback."""
    if not isinstance(value, str):
        return f"is not a string ({type(value).__name__})"
    if not value or len(value) > limit:
        return f"has {len(value)} characters (1 to {limit})"
    if "\x00" in value or any("\ud800" <= ch <= "\udfff" for ch in value):
        return "holds a NUL or a lone surrogate"
    return None


def _task_id(request: Any) -> str | None:
    """The message's task id, which a revoke names: the attempts its process runs record it
    as their carrier (store/schema.py). None for a call with no message, or an id the column
    cannot hold (nothing is recorded: a terminate then reaches the step by its heartbeat)."""
    task_id = getattr(request, "id", None)
    if not isinstance(task_id, str) or _id_problem(task_id, TOKEN_CHARS) is not None:
        return None
    return task_id


def _carried(request: Any, token: str) -> CarriedBranches | None:
    """The attempts a bundled step message carries besides its own (``HELD_HEADER``); a
    malformed header is one warning line, and the message's own attempt still runs."""
    carried = carried_branches(request.get(HELD_HEADER))
    if carried is not None and not isinstance(carried, str):
        problems = [_id_problem(carried.run_id, RUN_ID_CHARS)]
        problems += [_id_problem(t, TOKEN_CHARS) for t in carried.tokens]
        carried = next((f"holds an id that {p}" for p in problems if p is not None), carried)
    if not isinstance(carried, str | None) and any(
        not t.startswith(f"{carried.run_id}:") for t in carried.tokens
    ):
        carried = "holds a token of another run"
    if isinstance(carried, str):
        log.warning("step message %s has a %s header that %s; ignored", token, HELD_HEADER, carried)
        return None
    return carried


def _delivered_from(request: Any) -> str | None:
    """The queue a step message came from: its routing key, which is the queue's name for
    the queues ductor declares (a message run eagerly or by hand has none)."""
    info = getattr(request, "delivery_info", None) or {}
    key = info.get("routing_key")
    return key if isinstance(key, str) and key else None
