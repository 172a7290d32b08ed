"""Send outbox rows through Celery after commit, and wake-ups of runs."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..engine.kinds import DispatchKind
from ..store.outbox import OutboxRow
from .broker import MAX_PRIORITY, BrokerQueues
from .failpoints import failpoint

log = logging.getLogger("ductor_celery.dispatch")

TICK_TASK_NAME = "ductor.tick"
#: A run's first tick, on the steps queue (eager ticks: ``Runtime.wake_started``).
FIRST_TICK_TASK_NAME = "ductor.first_tick"


#: A step message's header naming more attempts of its run's scatter that the message carries
#: (a bundle: runtime/inline.py, ``InlineChain.bundle``). Old workers ignore it; those
#: attempts are then re-sent after ``ductor_resend_unclaimed_after``, as after a lost message.
HELD_HEADER = "ductor_held"
#: The most attempts a message's header may name besides its own (the parser's bound: a tick
#: bundles at most ``inline.HOLD_MAX`` - 1).
MAX_CARRIED = 63


class _Unsent:
    """Celery's event dispatcher for a publish that leaves out its ``task-sent`` event: Celery
    hands that event to the ``event_dispatcher`` a ``send_task`` names
    (``AMQP.send_task_message``), and this one publishes nothing."""

    def publish(self, *_args: Any, **_kwargs: Any) -> None:
        return None


#: ``send_task(event_dispatcher=UNSENT)``: no ``task-sent`` event after this message.
UNSENT = _Unsent()


class _UnlessDeclared(list[Any]):
    """A publish's ``declare`` list that is empty, as kombu reads it (``if declare:``), while
    the producer's connection has every entity in it declared already: kombu's own cache of
    declarations, ``Connection.declared_entities``, keyed by the entity's hash, which kombu
    empties when the connection closes, is replaced or reconnects. It is read at each try of
    the publish, so a retry on a new connection declares the queue again, as kombu would."""

    def __init__(self, entity: Any, connection: Any) -> None:
        super().__init__([entity])
        self._connection = connection

    def __bool__(self) -> bool:
        cache = self._connection.declared_entities
        return cache is None or any(hash(entity) not in cache for entity in self)


def declared(producer: Any, app: Any, queue: str) -> dict[str, Any]:
    """``send_task`` options that have kombu declare ``queue`` only when its cache says this
    producer's connection has not declared it yet (``_UnlessDeclared``); none when that cannot
    be told (no kombu connection, a queue Celery does not know, one kombu never caches).

    Celery has every publish declare its queue, and kombu checks its cache behind a retrying
    wrapper it makes anew each time (with a copy of the queue): a sixth of a publish's CPU on
    RabbitMQ (a ``send_task`` 0.39 against 0.33 ms). The first publish on a connection, and
    a retry after a reconnect, still declare it, so a client that starts runs before any
    worker ran creates it as before."""
    connection = getattr(producer, "connection", None)
    if getattr(connection, "declared_entities", None) is None:
        return {}
    queue_entity = app.amqp.queues.get(queue)
    if queue_entity is None or not queue_entity.can_cache_declaration:
        return {}
    return {"declare": _UnlessDeclared(queue_entity, connection)}


@dataclass(frozen=True, slots=True)
class CarriedBranches:
    """The attempts a bundled step message carries besides its own (``HELD_HEADER``): more
    branches of one scatter node of one run, of the message's step, with no message of their
    own. The worker taking the message claims and runs them after its own attempt."""

    run_id: str
    node: str
    tokens: tuple[str, ...]
    #: The run's priority (0..9), for the messages they get if handed back.
    priority: int = 0


def carried_branches(value: Any) -> CarriedBranches | str | None:
    """A message's ``HELD_HEADER`` read back: None when there is none, or why it is malformed
    (a message not written by ductor; its own attempt still runs). The ids' characters are
    the task's to check (``runtime._id_problem``), as for the message's own token."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return f"is a {type(value).__name__}, not an object"
    run_id, node, tokens = value.get("run_id"), value.get("node"), value.get("tokens")
    priority = value.get("priority", 0)
    if not isinstance(run_id, str) or not isinstance(node, str) or not run_id or not node:
        return "names no run id and node"
    if not isinstance(tokens, list) or not 0 < len(tokens) <= MAX_CARRIED:
        return f"holds no list of 1 to {MAX_CARRIED} tokens"
    if not all(isinstance(t, str) for t in tokens):
        return "holds a token that is not a string"
    if type(priority) is not int or not 0 <= priority <= MAX_PRIORITY:
        return f"has a priority outside 0..{MAX_PRIORITY}"
    return CarriedBranches(run_id, node, tuple(tokens), priority)


#: A wake-up's header naming a scatter node whose branches the waking step worker has just run
#: quickly (an eager tick that found the run busy): the coordinator's tick then sends that
#: node's new branches bundled, as the worker's own tick would have (``QuickBranches``).
QUICK_HEADER = "ductor_quick"


@dataclass(frozen=True, slots=True)
class QuickBranches:
    """Branches of ``node`` of ``step``, routed to ``queue``, that ran quickly on a step worker
    (under ``inline.HOLD_IF_QUICKER_S``): a tick may send their messages bundled."""

    step: str
    node: str
    queue: str

    def header(self) -> dict[str, str]:
        return {"step": self.step, "node": self.node, "queue": self.queue}


def quick_branches(value: Any) -> QuickBranches | None:
    """A wake-up's ``QUICK_HEADER`` read back; None when there is none or it is not one ductor
    wrote (a hint: a wake-up without it is an ordinary one)."""
    if not isinstance(value, dict):
        return None
    step, node, queue = (value.get(k) for k in ("step", "node", "queue"))
    for field in (step, node, queue):
        if not isinstance(field, str) or not 0 < len(field) <= 300:
            return None
    return QuickBranches(str(step), str(node), str(queue))


def first_tick_id(run_id: str) -> str:
    """The task id of a run's first-tick message."""
    return f"{run_id}:first_tick"


def held_header(row: OutboxRow) -> dict[str, Any]:
    """A bundled step row's ``HELD_HEADER``: what ``carried_branches`` reads back."""
    return {
        "run_id": row.run_id,
        "node": row.payload["node"],
        "tokens": list(row.payload["held"]),
        "priority": int(row.payload.get("priority") or 0),
    }


class Dispatcher:
    """Publishes step messages and wake-ups. A hint channel: losing a message loses nothing.

    ``queues`` gives the producers (on RabbitMQ, with publisher confirms, and ductor's queue
    declarations in place: runtime/broker.py); without it, the app's own producer pool."""

    def __init__(
        self, app: Any, steps_queue: str, coord_queue: str, queues: BrokerQueues | None = None
    ) -> None:
        self.app = app
        self.steps_queue = steps_queue
        self.coord_queue = coord_queue
        self.queues = queues

    def _producer(self) -> Any:
        if self.queues is None:
            return self.app.producer_or_acquire()
        return self.queues.producer()

    def _options(self) -> dict[str, Any]:
        return {} if self.queues is None else self.queues.publish_options()

    def broker_priority(self, priority: int) -> int:
        """A run's priority (0..9, higher first) as the broker reads a message's: the same on
        RabbitMQ; reversed on Redis, whose kombu transport serves priority 0 first (its
        ``priority_steps``, by default [0, 3, 6, 9], bucket them)."""
        amqp = self.queues is not None and self.queues.amqp
        return priority if amqp else MAX_PRIORITY - priority

    def send(self, rows: list[OutboxRow]) -> None:
        if not rows:
            return
        #: Runs whose attempts a revoke with terminate kills: the first-tick message of each,
        #: if it is still running that run's inline chain, is killed too (``first_tick_id``).
        killed: dict[str, None] = {}
        #: Task ids revoked with terminate by these rows (no id twice).
        terminated: set[str] = set()
        options = self._options()
        with self._producer() as producer:
            for sent, row in enumerate(rows):
                if sent:
                    # Fault tests: die with part of a tick's messages sent (the sweeper sends
                    # the rest from the outbox).
                    failpoint("mid_dispatch")
                if row.kind == DispatchKind.STEP:
                    token = row.payload["token"]
                    held = row.payload.get("held")
                    queue = row.queue or self.steps_queue
                    self.app.send_task(
                        row.task,
                        args=[token],
                        # The token as task id: `revoke` can name it, and Flower shows it.
                        task_id=token,
                        queue=queue,
                        serializer="json",
                        producer=producer,
                        argsrepr=repr([token]),
                        kwargsrepr=repr({"run_id": row.run_id, "node": row.payload.get("node")}),
                        priority=self.broker_priority(int(row.payload.get("priority") or 0)),
                        headers=None if not held else {HELD_HEADER: held_header(row)},
                        **options,
                        **declared(producer, self.app, queue),
                    )
                elif row.kind == DispatchKind.REVOKE:
                    # Drops the message if it is still queued; a step already running finishes
                    # (its attempt is closed, so its outcome is discarded), unless the revoke
                    # terminates (terminate, a run deadline): then its worker kills it. The
                    # token is an attempt's, or the carrier an attempt with no message of its
                    # own runs under (coordinator/rows.py, ``carrier_revokes``).
                    terminate = bool(row.payload.get("terminate"))
                    self.app.control.revoke(row.payload["token"], terminate=terminate)
                    if terminate:
                        killed[row.run_id] = None
                        terminated.add(row.payload["token"])
                elif row.kind == DispatchKind.WAKEUP:
                    self._wake(row.run_id, producer, options)
                else:  # written by a newer version of ductor: leave a trace, do not crash
                    log.error("unknown outbox kind %r for run %s", row.kind, row.run_id)
        for run_id in killed:
            # An attempt run inline has no message of its own to kill by its token; one that
            # a first tick started runs inside that message, whose id the run's id gives. Only
            # that run's attempts ever run in it (an inline chain never leaves its run), and a
            # message already finished is not killed again. The attempt's recorded carrier
            # names that message too; this covers attempts claimed by a worker that records
            # none (an older version, during a rolling upgrade).
            if first_tick_id(run_id) not in terminated:
                self.app.control.revoke(first_tick_id(run_id), terminate=True)

    def wake(self, run_id: str, quick: QuickBranches | None = None) -> None:
        """A wake-up of the run on the coordinator queue; ``quick``: a hint for its tick
        (``QUICK_HEADER``)."""
        with self._producer() as producer:
            self._wake(run_id, producer, self._options(), quick)

    def first_tick(self, run_id: str, priority: int = 0) -> None:
        """Send a run just started to the step workers, whose first tick runs its first step
        in the same process (``steps.first_tick``). Its task id names the run, so that a
        terminate can kill it while it runs that run's attempts (``send``).

        No ``task-sent`` event follows it, whatever ``task_send_sent_event`` says
        (``UNSENT``): the run is in ductor's own views from the moment ``start`` returns, and
        Flower lists the message by the one event its first tick sends
        (``task_events.tick_done``). That event was one more publish for every run, which
        on RabbitMQ waits for its own confirm: with it, steps/s over RabbitMQ were 0.89x a raw
        task's, without it 0.95x (benchmarks/README.md, twentieth round)."""
        with self._producer() as producer:
            self.app.send_task(
                FIRST_TICK_TASK_NAME,
                args=[run_id],
                task_id=first_tick_id(run_id),
                queue=self.steps_queue,
                serializer="json",
                producer=producer,
                priority=self.broker_priority(priority),
                event_dispatcher=UNSENT,
                **self._options(),
                **declared(producer, self.app, self.steps_queue),
            )

    def wake_many(self, run_ids: list[str]) -> None:
        if not run_ids:
            return
        options = self._options()
        with self._producer() as producer:
            for run_id in run_ids:
                self._wake(run_id, producer, options)

    def _wake(
        self,
        run_id: str,
        producer: Any,
        options: dict[str, Any],
        quick: QuickBranches | None = None,
    ) -> None:
        self.app.send_task(
            TICK_TASK_NAME,
            args=[run_id],
            queue=self.coord_queue,
            serializer="json",
            producer=producer,
            headers=None if quick is None else {QUICK_HEADER: quick.header()},
            **options,
            **declared(producer, self.app, self.coord_queue),
        )
