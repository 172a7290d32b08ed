"""What runs inside a step worker: the Step object, StepContext, and one attempt's execution."""

from __future__ import annotations

import logging
import os
import socket
import traceback
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..definition.retry import ConcurrencyLimit, RetryPolicy
from ..engine.payloads import json_problem
from ..errors import NonRetryableError
from ..store import attempts, wakes
from ..store.db import with_retry
from ..store.outbox import delete_outbox

if TYPE_CHECKING:
    from .runtime import Runtime

log = logging.getLogger("ductor_celery.step")

#: How long a worker keeps trying to write a finished attempt's outcome to the database.
FINISH_DEADLINE_S = 600.0


@dataclass
class Step:
    """A ``@ductor.step`` function: a real Celery task named ``name`` on the steps queue.

    Calling the object calls the function directly (handy in unit tests).
    """

    name: str
    fn: Callable[..., Any]
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    timeout: float | None = None
    heartbeat_timeout: float | None = None
    queue: str | None = None
    concurrency: ConcurrencyLimit | None = None
    task: Any = None  # the Celery task, set when registered

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<ductor step {self.name}>"


class StepContext:
    """What a step function gets first: who it is, and a way to heartbeat and patch context."""

    def __init__(
        self,
        *,
        run_id: str,
        workflow_id: str,
        node: str,
        branch: int | None,
        attempt: int,
        input: Any = None,
        context: Mapping[str, Any],
        heartbeat_fn: Callable[[Any], None] | None = None,
        input_fn: Callable[[], Any] | None = None,
    ) -> None:
        self.run_id = run_id
        self.workflow_id = workflow_id
        self.node = node
        self.branch = branch
        self.attempt = attempt
        self._input = input
        self._input_fn = input_fn
        self.context: Mapping[str, Any] = _ReadOnly(context)
        self._patch: dict[str, Any] = {}
        self._heartbeat_fn = heartbeat_fn

    @property
    def input(self) -> Any:
        """The run's input, read from the database on first use (it can be a large list
        that a scatter hands out item by item; most steps never need it whole)."""
        if self._input_fn is not None:
            self._input, self._input_fn = self._input_fn(), None
        return self._input

    @property
    def idempotency_key(self) -> str:
        """Stable across retries of the same node and branch of the same run."""
        branch = "" if self.branch is None else f":{self.branch}"
        return f"{self.run_id}:{self.node}{branch}"

    def heartbeat(self, details: Any = None) -> None:
        if self._heartbeat_fn is not None:
            self._heartbeat_fn(details)

    def patch(self, mapping: Mapping[str, Any]) -> None:
        """Merge ``mapping`` into the run context when this attempt succeeds."""
        if not isinstance(mapping, Mapping):
            raise TypeError(f"ctx.patch takes a mapping, got {type(mapping).__name__}")
        self._patch.update(mapping)

    @property
    def patch_value(self) -> dict[str, Any] | None:
        return dict(self._patch) if self._patch else None


class _ReadOnly(Mapping[str, Any]):
    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Any:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return repr(self._data)


def _is_non_retryable(step: Step, exc: BaseException) -> bool:
    return isinstance(exc, NonRetryableError) or (
        bool(step.retry.non_retryable) and isinstance(exc, step.retry.non_retryable)
    )


def worker_identity(hostname: str | None) -> str:
    """Who claims: host and pid for people, plus a nonce that makes each claim unique."""
    return f"{(hostname or socket.gethostname())[:150]}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


def _heartbeat(engine: Any, token: str, details: Any, limit: int) -> None:
    """A heartbeat is a hint: a database blip or odd details must not fail the user's step."""
    value, problem = json_problem(details, "heartbeat details", min(limit, 65536))
    if problem is not None:
        log.warning("attempt %s: %s; recording the heartbeat without them", token, problem)
    try:
        attempts.heartbeat(engine, token, value)
    except Exception as exc:  # noqa: BLE001
        log.warning("heartbeat for %s not recorded: %s", token, exc)


def _wake_needed(engine: Any, run_id: str) -> bool:
    try:
        return with_retry(lambda: wakes.request_wake(engine, run_id), what="request wake-up")
    except Exception as exc:  # noqa: BLE001 - a wake-up is a hint: send it when unsure
        log.warning("wake-up bookkeeping for run %s failed (%s); waking anyway", run_id, exc)
        return True


def execute_attempt(rt: Runtime, step: Step, token: str, hostname: str | None = None) -> str:
    """Claim, run, record, wake. Returns what happened (for logs and tests)."""
    engine = rt.engine()
    me = worker_identity(hostname)
    limit = rt.settings.max_payload_bytes
    claimed = with_retry(lambda: attempts.claim(engine, token, me), what="claim attempt")
    if claimed is None:
        log.info("attempt %s already claimed or closed; message ignored", token)
        return "duplicate"
    ctx = StepContext(
        run_id=claimed.run_id,
        workflow_id=claimed.workflow_id,
        node=claimed.node,
        branch=claimed.branch,
        attempt=claimed.attempt,
        input_fn=lambda: with_retry(
            lambda: attempts.run_input(engine, claimed.run_id), what="read run input"
        ),
        context=claimed.context,
        heartbeat_fn=lambda details: _heartbeat(engine, token, details, limit),
    )
    outcome = "succeeded"
    output: Any = None
    patch: Any = None
    error: dict[str, Any] | None = None
    retryable = True
    try:
        result = step.fn(ctx, **claimed.args)
    except Exception as exc:  # noqa: BLE001 - a step's failure is data, not a crash
        outcome = "failed"
        retryable = not _is_non_retryable(step, exc)
        error = {
            "type": type(exc).__qualname__,
            "message": str(exc)[:4000],
            "traceback": traceback.format_exc()[-8000:],
        }
    else:
        output, problem = json_problem(result, f"step {step.name!r} result", limit)
        if problem is None:
            patch, problem = json_problem(
                ctx.patch_value, f"step {step.name!r} context patch", limit
            )
        if problem is not None:
            outcome, retryable, output, patch = "failed", False, None, None
            error = {"type": "InvalidResult", "message": problem}
            log.error("attempt %s: %s", token, problem)
    written, granted = with_retry(
        lambda: attempts.finish(
            engine,
            token,
            outcome=outcome,
            output=output,
            error=error,
            retryable=retryable,
            patch=patch,
            leased=step.concurrency is not None,
        ),
        what="record attempt outcome",
        deadline_s=FINISH_DEADLINE_S,
    )
    if granted:
        # This attempt's lease went to a waiting attempt: send its step message now (the
        # sweeper relays it if we die first), then clear the outbox rows.
        rt.dispatcher.send(granted)
        with_retry(lambda: delete_outbox(engine, [r.id for r in granted]), what="clear outbox")
    # Coalesced: when a wake-up of the run is already queued, its tick will see this result.
    if _wake_needed(engine, claimed.run_id):
        rt.wake(claimed.run_id)
    return outcome if written else "closed"
