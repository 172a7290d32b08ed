"""A step's heartbeats and its look at the cancel flag: hints, never the step's failure. A
database blip, odd details or an outage must not fail the user's step, nor turn a step that
heartbeats in a loop into a loop of connection attempts."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..store import attempts
from ..store.db import ValuesRefused
from .step_errors import describe, payload_of

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

log = logging.getLogger("ductor_celery.step")

#: After a heartbeat that failed to reach the database, the next is not tried before this.
HEARTBEAT_PAUSE_S = 1.0


class HeartbeatPause:
    """After a heartbeat that did not reach the database, the step's next heartbeats within
    ``HEARTBEAT_PAUSE_S`` are skipped: a step that heartbeats in a loop must not turn into a
    loop of connection attempts and warnings while the database is away (a failover, a
    restart). Short: once the database is back, a heartbeat must get through well within the
    step's ``heartbeat_timeout``."""

    def __init__(self) -> None:
        self._until = 0.0

    def skip(self) -> bool:
        return time.monotonic() < self._until

    def failed(self) -> None:
        self._until = time.monotonic() + HEARTBEAT_PAUSE_S


def heartbeat(
    engine: Engine,
    token: str,
    details: Any,
    limit: int,
    redact: Callable[[Any], Any] = lambda value: value,
    pause: HeartbeatPause | None = None,
) -> bool:
    """A heartbeat is a hint: a database blip or odd details must not fail the user's step,
    and details the database refuses must not cost the heartbeat itself. ``redact``: the
    attempt's secrets out of the (encoded) details. ``pause``: the attempt's, to skip
    heartbeats for a while after one that failed. Returns whether the attempt should stop
    (its run's cancel requested, or the attempt closed)."""
    if pause is not None and pause.skip():
        return False  # unknown: a heartbeat after the pause asks again
    value, problem = payload_of(details, "heartbeat details", min(limit, 65536))
    value = redact(value)
    if problem is not None:
        log.warning("attempt %s: %s; recording the heartbeat without them", token, problem)
    try:
        stop = record_heartbeat(engine, token, value)
    except Exception as exc:  # noqa: BLE001
        log.warning("heartbeat for %s not recorded: %s", token, describe(exc))
        if pause is not None:
            pause.failed()
        return False  # unknown: the next heartbeat asks again
    return stop


def record_heartbeat(engine: Engine, token: str, details: Any) -> bool:
    try:
        return attempts.heartbeat(engine, token, details)
    except ValuesRefused as refused:
        if details is None:
            raise
        log.warning(
            "attempt %s: heartbeat details refused by the database (%s); recorded without them",
            token,
            refused.cause,
        )
        return attempts.heartbeat(engine, token, None)


def should_stop(engine: Engine, token: str) -> bool:
    """``ctx.cancelled``'s look at the attempt row; a database blip reads as "go on"."""
    try:
        return attempts.should_stop(engine, token)
    except Exception as exc:  # noqa: BLE001
        log.warning("attempt %s: cancel flag not read: %s", token, describe(exc))
        return False
