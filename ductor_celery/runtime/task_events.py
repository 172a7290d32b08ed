"""Celery's view of an attempt run inline (runtime/inline.py), which has no message of its own:
Celery's current task while it runs (``as_current_task``), and the task events Flower lists it
by (``TaskEvents``, buffered per process and thread, published by ``flush_events``)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from celery import signals
from celery._state import pop_current_task, push_current_task
from celery.app.task import Context
from celery.local import Proxy

from ..store.attempts import ClaimedAttempt

if TYPE_CHECKING:
    from .step_context import Step

log = logging.getLogger("ductor_celery.step")


@contextlib.contextmanager
def as_current_task(
    step: Step, claimed: ClaimedAttempt, hostname: str | None, queue: str
) -> Iterator[None]:
    """Inside an inline attempt, Celery's current task is the attempt's own step task and its
    request (``inline_request``) carries the attempt's token as id, as when a message
    delivers it: code that reads ``celery.current_task.request.id``, Celery's task log
    format, and the parent and root ids of tasks the step sends name this attempt, not the
    task whose message started the chain. The task is the registered object itself, not the
    proxy ``@app.task`` returns, as Celery's tracer pushes a delivered task."""
    task = step.task
    if task is None:  # a Step not registered on an app (a direct test call)
        yield
        return
    if isinstance(task, Proxy):
        task = task._get_current_object()
    stack = task.request_stack
    stack.push(inline_request(task.name, claimed, hostname, queue))
    push_current_task(task)
    try:
        yield
    finally:
        pop_current_task()
        stack.pop()


def inline_request(
    task_name: str, claimed: ClaimedAttempt, hostname: str | None, queue: str
) -> Context:
    """The request of an inline attempt, as Celery's tracer makes a delivered task's
    (``called_directly`` False), from the attempt alone.

    Not ``Task.push_request``, which copies every field of the request in force on that task
    into the new one: the carrying message's when the chain's message was of the same step
    (its reply-to, custom headers, correlation id), else Celery's default request, under
    which the step counted as called directly (tasks it sent named the carrying task as
    their parent). And not ``Context(**fields)``, whose search for custom headers (none of
    these fields is one) cost more than the rest (benchmarks/README.md, eleventh round);
    what it would make is what this makes (``test_task_events.py``)."""
    request = Context.__new__(Context)
    request.__dict__.update(
        id=claimed.token,
        task=task_name,
        args=[claimed.token],
        kwargs={},
        hostname=hostname,
        delivery_info={"routing_key": queue},
        root_id=claimed.token,
        correlation_id=claimed.token,
        retries=0,
        called_directly=False,
        headers=None,
    )
    return request


class TaskEvents:
    """Celery task events for an attempt that has no message of its own (Flower's view).

    Sent only when the app sends task events (``worker_send_task_events``, which ``Ductor``
    turns on unless the user configured it), over one event dispatcher per process and
    thread. Events are buffered and published together (Celery's batched ``task.multi``
    events, which Flower and every event receiver read): ``task-started`` at once after a slow
    step (or first in a chain, unless that step ran quickly last time in this process), with
    the previous attempt's ``task-succeeded``; after a quick one at most every
    ``inline.EVENTS_AT_MOST_EVERY_S`` (``InlineChain.flush_events_now``); the rest at the
    chain's end, or, when the thread published less than ``PUBLISH_AT_MOST_EVERY_S`` before,
    that long after it, with the next chains' (``flush_events(soon=True)``). An event that
    cannot be sent is dropped: events are a view, never the truth.

    An attempt whose start is not published at once sends one event, not two: its
    ``task-succeeded`` carries what its ``task-started`` would have (name, args, the time it
    started). Buffered, the start would have gone out with the success in any case, after
    the step; Flower's view of the task is the same (``celery.events.state`` keeps every
    field of an event), and a quick chain sends half the events.
    """

    def __init__(
        self, app: Any, hostname: str | None, claimed: ClaimedAttempt, enabled: bool
    ) -> None:
        """``enabled``: whether the app sends task events (``events_enabled``, which a chain
        reads once, not at every step)."""
        self.app = app
        self.hostname = hostname
        self.claimed = claimed
        self.enabled = enabled
        self.started_at = 0.0
        #: When it started (wall clock), while its start is not sent: it goes with its end.
        self._start_untold: float | None = None

    def started(self, flush: bool = True) -> None:
        """``flush``: publish it now (with what is buffered); else told with its end."""
        self.started_at = time.monotonic()
        if not self.enabled:
            return
        if flush:
            self._send("task-started", **self._identity())
            flush_events(self.app, self.hostname)
        else:
            self._start_untold = time.time()

    def finished(self, outcome: str) -> None:
        self._ended("task-succeeded", result=repr(outcome))

    def failed(self, exc: BaseException) -> None:
        """The attempt's run raised through the worker (its outcome is written, or left to
        its timeout): Flower shows it failed, not started forever, or not at all."""
        self._ended("task-failed", exception=repr(exc)[:500])

    def _ended(self, kind: str, **fields: Any) -> None:
        """Its end, telling its start too when that was not sent."""
        if not self.enabled:
            return
        if self._start_untold is not None:
            fields.update(self._identity(started=self._start_untold))
        self._send(kind, runtime=time.monotonic() - self.started_at, **fields)

    def _identity(self, **more: Any) -> dict[str, Any]:
        """What ``task-received`` and ``task-started`` tell Flower about the task."""
        claimed = self.claimed
        return {
            "name": claimed.step,
            "args": repr([claimed.token]),
            "kwargs": repr({"run_id": claimed.run_id, "node": claimed.node}),
            "root_id": claimed.token,
            "retries": 0,
            **more,
        }

    def _send(self, kind: str, **fields: Any) -> None:
        _send(self.app, self.hostname, kind, self.claimed.token, fields)


def tick_done(
    app: Any,
    hostname: str | None,
    *,
    task_id: str,
    name: str,
    args: list[Any],
    began: float,
    result: str,
) -> None:
    """The events of a tick task Celery sends none for (``send_events=False``: a run's start
    message, ``ductor.first_tick``), as one ``task-succeeded`` that also carries what its
    ``task-received`` and ``task-started`` would (name, args, their time ``began``): Flower
    lists it as before. Celery's own three are sent by the worker's main process, about 0.6 ms
    of its CPU per run, and that process also hands every message to the pool, so it held a
    run's throughput back (benchmarks/README.md, tenth round); this one is buffered with the
    chain's own and goes out with its next flush. Dropped if it cannot be sent."""
    if not events_enabled(app):
        return
    fields = {
        "name": name,
        "args": repr(args),
        "kwargs": repr({}),
        "root_id": task_id,
        "retries": 0,
        "received": began,
        "started": began,
        "result": repr(result),
        "runtime": time.time() - began,
    }
    _send(app, hostname, "task-succeeded", task_id, fields)


#: A chain that ends within this long of its thread's last publish leaves its events to a
#: publish that long after the last (``flush_events(soon=True)``): a process running quick
#: runs one after another publishes once for several, not once a run (each publish costs the
#: worker about 0.2 ms, and the broker a message). Flower sees them at most this late.
PUBLISH_AT_MOST_EVERY_S = 0.05


class _Buffer:
    """This thread's task events: Celery's dispatcher, which buffers them until ``flush``,
    and when it last published. A publish put off (``publish_soon``) is made by a timer
    thread, so every use of the dispatcher, which is not thread-safe (its connection), is
    under ``lock``."""

    def __init__(self, key: tuple[int, int, str | None], dispatcher: Any) -> None:
        self.key = key
        self.dispatcher = dispatcher
        self.lock = threading.Lock()
        self.published_at = -math.inf
        #: Events were buffered since the last publish.
        self.pending = False
        #: The timer of a publish put off, until it is made (or made by another publish).
        self.later: threading.Timer | None = None
        #: A send or publish failed: the next event makes a new dispatcher (and connection).
        self.broken = False

    def send(self, kind: str, task_id: str, fields: dict[str, Any]) -> None:
        with self.lock:
            try:
                self.dispatcher.send(kind, uuid=task_id, **fields)
            except Exception as exc:  # noqa: BLE001 - a view only
                self.broken = True
                log.debug("task event for %s not sent: %s", task_id, exc)
            else:
                self.pending = True

    def publish(self) -> None:
        with self.lock:
            self._publish()

    def publish_soon(self) -> None:
        """Now if the last publish is ``PUBLISH_AT_MOST_EVERY_S`` old, else that long after it
        (one timer for whatever is buffered meanwhile); nothing when nothing is buffered."""
        with self.lock:
            if not self.pending or self.later is not None:
                return
            wait = self.published_at + PUBLISH_AT_MOST_EVERY_S - time.monotonic()
            if wait <= 0:
                self._publish()
                return

            def publish_later() -> None:
                with self.lock:
                    if self.later is timer:  # not made by another publish meanwhile
                        self._publish()

            timer = threading.Timer(wait, publish_later)
            timer.daemon = True
            self.later = timer
            _put_off.add(self)
            try:
                timer.start()
            except RuntimeError as exc:  # no thread to be had (a process's thread limit)
                log.debug("task events published at once: no timer (%s)", exc)
                self._publish()

    def _publish(self) -> None:
        if self.later is not None:
            self.later.cancel()  # this publish takes what it would have
            self.later = None
            _put_off.discard(self)
        if not self.pending:
            return
        self.pending = False
        self.published_at = time.monotonic()
        try:
            self.dispatcher.flush()
        except Exception as exc:  # noqa: BLE001 - a view: never fail the attempt for it
            self.broken = True
            log.debug("task events not sent: %s", exc)


def _send(app: Any, hostname: str | None, kind: str, task_id: str, fields: dict[str, Any]) -> None:
    """One task event into this thread's buffer; dropped (and the dispatcher made anew next
    time) if it cannot be: a view, never a reason to fail the attempt or the tick."""
    try:
        buffer = _buffer(app, hostname)
    except Exception as exc:  # noqa: BLE001 - a view only
        log.debug("task event for %s not sent: %s", task_id, exc)
        return
    buffer.send(kind, task_id, fields)


def flush_events(app: Any, hostname: str | None, soon: bool = False) -> None:
    """Publish the task events buffered so far: at once (a slow step's start, a chain that
    stops on an error, a start message forwarded), or with ``soon`` at a chain's end, where
    they may wait up to ``PUBLISH_AT_MOST_EVERY_S`` to go out with the next chains'."""
    found = getattr(_local, "buffer", None)
    if found is None or found.key != _key(app, hostname):
        return
    if soon:
        found.publish_soon()
    else:
        found.publish()


@contextlib.contextmanager
def publishing_after(app: Any, hostname: str | None) -> Iterator[None]:
    """Publish what is buffered when the block ends: soon when it ends normally (a chain's
    end, ``flush_events(soon=True)``), at once when it raises (the process may be on its
    way out, and a timer's thread with it)."""
    try:
        yield
    except BaseException:
        flush_events(app, hostname)
        raise
    flush_events(app, hostname, soon=True)


def publish_put_off(**_: Any) -> None:
    """Make every publish put off in this process now: its worker (or pool process) is
    stopping, and the timer's thread would not outlive it (Celery's
    ``worker_process_shutdown`` and ``worker_shutdown``)."""
    for buffer in list(_put_off):
        buffer.publish()


_local = threading.local()
#: The buffers of this process with a publish put off (``publish_put_off``).
_put_off: set[_Buffer] = set()
signals.worker_process_shutdown.connect(publish_put_off, weak=False)
signals.worker_shutdown.connect(publish_put_off, weak=False)


def _forget_after_fork() -> None:
    """A forked child never touches its parent's buffers: their connections are the
    parent's, their locks may have been held by a thread that did not come along, and their
    timers did not. It makes its own (``_buffer``'s key has the pid)."""
    _put_off.clear()  # the child's copy of the set
    _local.__dict__.pop("buffer", None)


os.register_at_fork(after_in_child=_forget_after_fork)


def events_enabled(app: Any) -> bool:
    """Whether ``app`` sends task events (``worker_send_task_events``)."""
    return bool(app.conf.get("worker_send_task_events"))


def _key(app: Any, hostname: str | None) -> tuple[int, int, str | None]:
    return (os.getpid(), id(app), hostname)


def _buffer(app: Any, hostname: str | None) -> _Buffer:
    """This thread's event buffer (a forked child makes its own: the key has the pid), made
    anew after a failure. Its dispatcher buffers task events until ``flush``."""
    key = _key(app, hostname)
    found: _Buffer | None = getattr(_local, "buffer", None)
    if found is None or found.key != key or found.broken:
        if found is not None and found.key[0] == key[0]:
            found.publish()  # what another app's (or a broken one's) chain left
        dispatcher = app.events.Dispatcher(
            app.connection_for_write(),
            hostname=hostname,
            buffer_while_offline=False,
            buffer_group=["task"],
            buffer_limit=64,
        )
        _local.buffer = found = _Buffer(key, dispatcher)
    return found
