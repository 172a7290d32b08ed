"""A malformed message on ductor's queues is logged and dropped, never the worker's end.

Celery's consumer turns a few shapes of broken task message into a log line and drops them
(unknown task, undecodable body, a message that is not a task), but not all: a body that is
not the ``[args, kwargs, embed]`` triple, an empty or binary body, a ``timelimit`` header that
is not a pair, or a task name that is not a string raise out of the consumer's handler, and
the worker stops with "Unrecoverable error". The message was never acknowledged, so the
broker hands it to the next worker, which stops too: one forged message takes down every
worker on the queue. Headers without an ``id`` raise ``KeyError``, which kombu's Redis
transport counts as a connection error: the worker reconnects, is handed the message again,
and loops forever.

``PoisonGuard`` (a consumer bootstep) wraps the consumer's task handler for messages that
arrive on ductor's queues: a message whose envelope is not a well-formed task message, or that
makes Celery's handler raise anything but a genuine connection error, is logged and rejected
without requeue. A well-formed message takes Celery's own path unchanged, and messages on the
user's other queues are not touched. Dropping a step or tick message loses nothing: the
database is the truth, and the sweeper re-sends what a lost message would have done.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from celery import bootsteps

log = logging.getLogger("ductor_celery.poison")


def envelope_problem(message: Any) -> str | None:
    """What is wrong with a task message's envelope, or None if Celery can handle it."""
    headers = message.headers
    if headers is not None and not isinstance(headers, Mapping):
        return f"headers are a {type(headers).__name__}, not a mapping"
    if not headers or "task" not in headers:
        return None  # protocol 1 or not a task message: Celery's own checks drop those
    name, task_id = headers.get("task"), headers.get("id")
    if not isinstance(name, str) or not name:
        return f"task name {name!r} is not a string"
    if not isinstance(task_id, str) or not task_id:
        return f"task id {task_id!r} is not a string"
    timelimit = headers.get("timelimit")
    if timelimit is not None and not (isinstance(timelimit, list | tuple) and len(timelimit) == 2):
        return f"timelimit {timelimit!r} is not a (soft, hard) pair"
    try:
        body = message.decode()
    except Exception:  # noqa: BLE001 - Celery's handler reports decode errors itself
        return None
    if not (isinstance(body, list | tuple) and len(body) == 3):
        return "body is not an [args, kwargs, embed] triple"
    args, kwargs, embed = body
    if not isinstance(args, list | tuple) or not isinstance(kwargs, Mapping):
        return "body's args are not a list or its kwargs not a mapping"
    if embed is not None and not isinstance(embed, Mapping):
        return "body's embed is not a mapping"
    return None


class PoisonGuard(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer bootstep: guards the task handler of every consumer loop (reconnects too)."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        if getattr(c, "_ductor_poison_guard", False):
            return
        rt = getattr(c.app, "_ductor_runtime", None)
        if rt is None:
            return
        c._ductor_poison_guard = True
        original: Callable[..., Callable[[Any], Any]] = c.create_task_handler

        def create_task_handler(*args: Any, **kwargs: Any) -> Callable[[Any], Any]:
            # Once per consumer loop, not per message: the steps are registered by then.
            return guarded(c, frozenset(rt.ductor_queues()), original(*args, **kwargs))

        c.create_task_handler = create_task_handler


def guarded(c: Any, queues: frozenset[str], handler: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``handler``, with malformed messages on ductor's queues dropped instead of raised."""
    # kombu's Redis transport counts KeyError as a connection error: a header lookup failing on
    # a forged message must not look like a lost broker.
    connection_errors = tuple(e for e in c.connection_errors if e is not KeyError)

    def on_task_received(message: Any) -> Any:
        if _queue_of(message) not in queues:
            return handler(message)
        problem = envelope_problem(message)
        if problem is None:
            try:
                return handler(message)
            except connection_errors:
                raise
            except Exception as exc:  # noqa: BLE001 - the message, not the worker, is broken
                problem = f"{type(exc).__name__}: {exc}"
        _drop(c, message, problem)
        return None

    return on_task_received


def _queue_of(message: Any) -> str | None:
    info = getattr(message, "delivery_info", None) or {}
    key = info.get("routing_key")
    return key if isinstance(key, str) else None


def _drop(c: Any, message: Any, problem: str) -> None:
    log.error(
        "malformed message on queue %r dropped (%s); nothing was run: %s",
        _queue_of(message),
        problem[:500],
        _describe(message),
    )
    if not getattr(message, "acknowledged", False):
        try:
            message.reject_log_error(log, c.connection_errors, requeue=False)
        except Exception as exc:  # noqa: BLE001 - a broker blip: it is redelivered and dropped again
            log.warning("could not reject a malformed message: %s", exc)


def _describe(message: Any) -> str:
    headers = message.headers if isinstance(message.headers, Mapping) else {}
    return (
        f"task={str(headers.get('task'))[:200]!r} id={str(headers.get('id'))[:200]!r} "
        f"content_type={getattr(message, 'content_type', None)!r} "
        f"body={str(getattr(message, 'body', b''))[:200]!r}"
    )
