"""ductor's queues on RabbitMQ: declared as quorum queues, published to with confirms.

On Redis (and Celery's in-memory transport) nothing here changes anything: a queue there is a
list with no arguments, and every publish goes through the app's own producer pool as before.

On RabbitMQ (an ``amqp://``, ``amqps://`` or ``pyamqp://`` broker URL):

* ductor's own queues (``ductor_steps_queue``, ``ductor_coord_queue`` and every step's
  ``queue=``) are durable **quorum** queues (``x-queue-type: quorum``): replicated, and a
  message is confirmed only once it is on disk. ``ductor_classic_queues = True`` declares
  classic queues instead, with ``x-max-priority`` so message priorities work on them; quorum
  queues before RabbitMQ 4.0 refuse ``x-max-priority`` and have no priorities (ductor's database
  ordering is what orders work there).
* The declaration is put into ``app.amqp.queues`` under the queue's name, so every side of
  Celery that resolves a queue by name uses it: ``send_task(queue=name)`` (ductor's
  dispatcher, or any other task routed there) declares that queue, and ``celery worker -Q
  ductor-steps`` consumes it, and Celery sees the quorum queue and turns global QoS off, which
  quorum queues refuse. A queue the app declares itself in ``task_queues`` is left as it is:
  the user's declaration wins. The user's other queues are never touched.
* ductor's publishes (step messages, wake-ups, first ticks) use **publisher confirms**: the
  dispatcher deletes an outbox row only after its message was sent, so a send must mean the
  broker has the message. Without a confirm, a message in flight when the broker stops is lost
  silently, and only the sweeper's slow paths (``ductor_resend_unclaimed_after``, a lost
  wake-up) would bring the run back. The confirming connections are ductor's own pool (kombu's
  global pools, keyed by the connection's options and reset after a fork like the app's), not
  a setting of the whole app: the app's other publishes (the user's tasks, task events, remote
  control) keep the app's connections and their cost. A confirm costs a round trip per
  message: 500 wake-ups to a quorum queue on loopback took 0.73 ms a message confirmed,
  0.46 ms not (README, "With RabbitMQ"); on a disk that syncs, a confirm waits for the sync.

A queue that exists already with other arguments (a classic queue made before, by an older
ductor or by Celery's ``task_create_missing_queues``) makes RabbitMQ close the channel with
PRECONDITION_FAILED "inequivalent arg 'x-queue-type'"; ``QueueMismatch`` says which queue and
what to do, on the publishing side, in the worker that would consume it (before it starts
consuming), and in ``ductor doctor``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from celery import bootsteps

from ..errors import QueueMismatch
from ..settings import Settings

log = logging.getLogger("ductor_celery.broker")

#: Run priorities (flow control) go 0..9, higher first; a classic queue holds that many levels.
MAX_PRIORITY = 9
#: Seconds a publish waits for the broker's confirm before it fails (then the outbox row stays
#: and the sweeper sends it again): milliseconds normally; a broker that blocks publishers
#: (a memory or disk alarm) must not hold a tick forever.
CONFIRM_TIMEOUT_S = 10.0
#: Broker URL schemes that mean RabbitMQ (kombu's ``amqp`` driver).
AMQP_SCHEMES = ("amqp", "amqps", "pyamqp", "librabbitmq")

_MISMATCH = re.compile(
    r"(inequivalent|invalid) arg '([^']+)' for queue '([^']*)' in vhost '([^']*)'"
)


def is_amqp_url(url: Any) -> bool:
    """True for a RabbitMQ broker URL (the first of a failover list decides)."""
    first = (url[0] if isinstance(url, list | tuple) and url else url) or ""
    return str(first).split(";", 1)[0].split("://", 1)[0].lower() in AMQP_SCHEMES


def queue_arguments(classic: bool) -> dict[str, Any]:
    """How ductor declares its queues on RabbitMQ."""
    if classic:
        return {"x-max-priority": MAX_PRIORITY}
    return {"x-queue-type": "quorum"}


def describe_mismatch(exc: BaseException, classic: bool) -> QueueMismatch | None:
    """``QueueMismatch`` for RabbitMQ's PRECONDITION_FAILED about a queue's arguments (in
    ``exc`` or any exception it was raised from), else None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        found = _MISMATCH.search(text) if "PRECONDITION_FAILED" in text else None
        if found is not None:
            _, arg, queue, vhost = found.groups()
            reply = text[text.index("PRECONDITION_FAILED") :].strip().rstrip("\"')")
            return QueueMismatch(_mismatch_message(queue, vhost, arg, reply, classic))
        current = current.__cause__ or current.__context__
    return None


def _mismatch_message(queue: str, vhost: str, arg: str, reply: str, classic: bool) -> str:
    wanted = queue_arguments(classic)
    kind = "classic queue" if classic else "quorum queue"
    vhost_flag = "" if vhost == "/" else f" -p {vhost}"
    fixes = (
        f"delete the queue so that ductor declares it anew (stop its workers, then "
        f"'rabbitmqctl delete_queue {queue}{vhost_flag}'; what was on it is only hints: "
        f"ductor resends lost step messages and wake-ups from its database)"
    )
    if classic:
        other = "or set ductor_classic_queues = False to use quorum queues"
    else:
        other = (
            "or set ductor_classic_queues = True to keep classic queues (declared with "
            f"x-max-priority {MAX_PRIORITY}: one made without it must still be deleted once)"
        )
    return (
        f"RabbitMQ refused ductor's queue {queue!r} (vhost {vhost!r}): it exists already with "
        f"other arguments ({reply}). ductor declares it as a {kind} {wanted}. Either {fixes}, "
        f"{other}."
    )


class BrokerQueues:
    """ductor's queue declarations and confirming producers for one app (see the module)."""

    def __init__(self, app: Any, settings: Settings, names: Callable[[], Iterable[str]]) -> None:
        self.app = app
        self.settings = settings
        #: Every queue ductor's messages travel on (``Runtime.ductor_queues``).
        self._names = names
        self._amqp: bool | None = None
        #: The key of ductor's confirming producer pool (``producer``), made once.
        self._pool_key: Any = None

    def names(self) -> list[str]:
        """ductor's queues, in a stable order."""
        return sorted(self._names())

    @property
    def amqp(self) -> bool:
        """Whether the broker is RabbitMQ: kombu's ``amqp`` driver, as Celery itself tells
        (read at first use, once the app is configured; no connection is made)."""
        if self._amqp is None:
            try:
                conn = self.app.connection_for_write()
                try:
                    self._amqp = conn.transport.driver_type == "amqp"
                finally:
                    conn.release()
            except Exception:  # noqa: BLE001 - an unknown transport: judge by the URL
                self._amqp = is_amqp_url(self.app.conf.broker_url)
        return self._amqp

    def arguments(self) -> dict[str, Any]:
        return queue_arguments(self.settings.classic_queues)

    def hook(self) -> None:
        """Make the app's queue table declare ductor's queues as ductor does whenever Celery
        makes one of them by its name (``Queues.new_missing``): ``send_task(queue=
        "ductor-steps")`` or a step task's ``apply_async`` in a process where ductor has not
        published yet, ``celery worker -Q ductor-steps``. Called once the app is configured;
        nothing is read from the broker or the configuration until a queue is looked up."""
        amqp = self.app.amqp
        if getattr(amqp.queues_cls, "_ductor_queues", None) is self:
            return
        amqp.queues_cls = _ductor_queues_class(amqp.queues_cls, self)
        built = amqp.__dict__.get("queues")  # a table made before this call: the same, on it
        if built is not None and not isinstance(built, amqp.queues_cls):
            built.__class__ = _ductor_queues_class(type(built), self)

    def declares(self, name: str) -> bool:
        """Whether ductor declares the queue of that name itself (RabbitMQ only)."""
        return self.amqp and name in set(self._names())

    def install(self) -> None:
        """Put ductor's declarations into ``app.amqp.queues`` (RabbitMQ only; idempotent).

        Called before ductor's first publish in a process and by a worker before it starts
        consuming (``QueuesBootstep``): replaces what Celery made of a name by itself (a
        classic queue for ``-Q ductor-steps``, in its consuming set too), never a queue the app
        declared in ``task_queues``."""
        if not self.amqp:
            return
        self.hook()
        queues = self.app.amqp.queues
        done: set[str] = queues.__dict__.setdefault("_ductor_installed", set())
        wanted = [name for name in self._names() if name not in done]
        if not wanted:
            return
        own = _declared_by_app(self.app.conf.task_queues)
        consuming = queues.consume_from
        for name in wanted:
            done.add(name)
            if name in own:
                continue
            queue = queues.new_missing(name)  # the exchange and binding Celery would give it
            queue.queue_arguments = self.arguments()
            queues[name] = queue  # the app's defaults apply (not x-max-priority on quorum)
            if consuming is not None and name in consuming:
                consuming[name] = queue

    @contextmanager
    def producer(self) -> Iterator[Any]:
        """A producer for ductor's messages: on RabbitMQ, from a pool of connections in
        confirm mode; elsewhere the app's own pool (``producer_or_acquire``)."""
        if not self.amqp:
            with self.app.producer_or_acquire() as producer:
                yield producer
            return
        self.install()
        from kombu import pools

        # kombu keys its global pools by the connection's parameters, transport options
        # included: this is a pool of its own, next to the app's, and kombu empties it in a
        # forked child (billiard's after-fork hooks) as it does the app's. The key is a
        # connection never opened (the pool opens clones of it), made once: making one at
        # every publish cost a quarter of a first tick's send (kombu tries to import
        # librabbitmq at each).
        if self._pool_key is None:
            options = {"confirm_publish": True}
            self._pool_key = self.app.connection_for_write(transport_options=options)
        pool = pools.producers[self._pool_key]
        producer = pool.acquire(block=True, timeout=self.app.conf.broker_pool_acquire_timeout)
        try:
            yield producer
        except Exception as exc:
            # The channel may be one RabbitMQ closed (PRECONDITION_FAILED, a nack, a confirm
            # that never came): close the connection before it goes back to the pool, which
            # then reconnects it when it is next used.
            with _suppressed():
                producer.__connection__.close()
            mismatch = describe_mismatch(exc, self.settings.classic_queues)
            if mismatch is not None:
                log.error("%s", mismatch)
                raise mismatch from exc
            raise
        finally:
            producer.release()

    def publish_options(self) -> dict[str, Any]:
        """Extra ``send_task`` options for ductor's publishes."""
        return {"confirm_timeout": CONFIRM_TIMEOUT_S} if self.amqp else {}

    def check(
        self, connection: Any, names: Iterable[str], *, create: bool = True
    ) -> dict[str, str | QueueMismatch]:
        """Declare the named queues on ``connection`` as ductor declares them: "declared" for
        each, or ``QueueMismatch`` for one RabbitMQ refuses; with ``create=False`` a queue
        that does not exist yet is left so ("missing") instead of made."""
        self.install()
        queues = self.app.amqp.queues
        found: dict[str, str | QueueMismatch] = {}
        for name in names:
            queue = queues.get(name)
            if queue is None:
                continue
            if not create and not _exists(connection, name):
                found[name] = "missing"
                continue
            channel = connection.channel()
            try:
                queue.bind(channel).declare()
                found[name] = "declared"
            except Exception as exc:
                mismatch = describe_mismatch(exc, self.settings.classic_queues)
                if mismatch is None:
                    raise
                found[name] = mismatch
            finally:
                with _suppressed():
                    channel.close()
        return found


def _exists(connection: Any, name: str) -> bool:
    """Whether a queue of that name is on the broker (a passive declare: changes nothing)."""
    channel = connection.channel()
    try:
        channel.queue_declare(queue=name, passive=True)
        return True
    except connection.channel_errors as exc:
        if getattr(exc, "reply_code", None) == 404:  # NOT_FOUND
            return False
        raise
    finally:
        with _suppressed():
            channel.close()


def _ductor_queues_class(base: type, broker: BrokerQueues) -> type:
    """``base`` (Celery's ``Queues``), making ductor's queues with ductor's arguments."""

    class DuctorQueues(base):  # type: ignore[misc]
        _ductor_queues = broker

        def new_missing(self, name: str) -> Any:
            queue = super().new_missing(name)
            if broker.declares(name):
                queue.queue_arguments = broker.arguments()
            return queue

        def __setitem__(self, name: str, queue: Any) -> None:
            super().__setitem__(name, queue)
            # task_queue_max_priority gives every queue x-max-priority, which RabbitMQ 3.x
            # refuses on a quorum queue: not on ductor's.
            arguments = queue.queue_arguments or {}
            if arguments.get("x-queue-type") == "quorum" and broker.declares(name):
                arguments.pop("x-max-priority", None)

    DuctorQueues.__name__ = DuctorQueues.__qualname__ = f"Ductor{base.__name__}"
    return DuctorQueues


def _declared_by_app(task_queues: Any) -> set[str]:
    """The names of the queues the app's ``task_queues`` declares (a list of Queues, or a
    mapping of names to options)."""
    if not task_queues:
        return set()
    if isinstance(task_queues, Mapping):
        return {str(name) for name in task_queues}
    return {str(getattr(q, "name", q)) for q in task_queues}


@contextmanager
def _suppressed() -> Iterator[None]:
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - cleanup after a failure already being raised
        log.debug("cleanup failed: %s", exc)


class QueuesBootstep(bootsteps.StartStopStep):  # type: ignore[misc]
    """A worker's side of ``BrokerQueues``, on RabbitMQ.

    ``__init__`` runs after Celery has chosen the queues to consume (``-Q``) and before the
    consumer is made, so the consumer declares ductor's queues as ductor does, and Celery's
    quorum queue detection (global QoS off) sees them. ``start`` runs before the consumer's
    (Celery's Consumer step comes last) and declares the ductor queues this worker consumes
    once: a queue of another type stops the worker with ``QueueMismatch`` (the queue, the two
    ways out) instead of Celery's bare PRECONDITION_FAILED. A broker that cannot be reached
    is left to the consumer, which retries as it always does."""

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        rt = getattr(worker.app, "_ductor_runtime", None)
        self.queues: BrokerQueues | None = None if rt is None else rt.queues
        if self.queues is not None and self.queues.amqp:
            self.queues.install()

    def start(self, worker: Any) -> None:
        queues = self.queues
        if queues is None or not queues.amqp:
            return
        app = worker.app
        ours = set(queues.names())
        consumed = [name for name in app.amqp.queues.consume_from or {} if name in ours]
        if not consumed:
            return
        conn = app.connection_for_write()
        try:
            try:
                conn.ensure_connection(max_retries=1)
            except Exception as exc:  # noqa: BLE001 - the consumer reconnects and says so
                log.debug("queue check skipped, broker unreachable: %s", exc)
                return
            for found in queues.check(conn, consumed).values():
                if isinstance(found, QueueMismatch):
                    log.critical("%s", found)
                    raise found
        finally:
            conn.release()
