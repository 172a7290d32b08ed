"""What a step function is and what it gets: the ``Step`` object (a ``@ductor.step``
function) and ``StepContext`` (``ctx``: who it is, its input, secrets, heartbeats, patches,
tags)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..definition.retry import ConcurrencyLimit, RateLimit, RetryPolicy
from ..engine.tags import MAX_TAGS, StepTags, tag_problem
from ..errors import InvalidTag, NonRetryableError, SecretNotFound, StepCancelled
from ..values import ValueNotDecodable, decode, decode_lenient
from .secrets import check_name

#: ``ctx.cancelled`` reads its attempt row at most this often (a step may poll it in a loop).
CANCEL_LOOK_INTERVAL_S = 1.0


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
    #: Not claimed within this many seconds of its dispatch: the attempt times out.
    schedule_to_start_timeout: float | None = None
    #: At most N attempts per period per key, counted at claim (docs/flow-control.md).
    rate_limit: RateLimit | None = None

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
        heartbeat_fn: Callable[[Any], bool | None] | None = None,
        input_fn: Callable[[], Any] | None = None,
        secret_fn: Callable[[str], str] | None = None,
        cancelled_fn: Callable[[], bool] | None = None,
        cancelled: bool = False,
        undone_fn: Callable[[], int] | None = None,
    ) -> None:
        self.run_id = run_id
        self.workflow_id = workflow_id
        self.node = node
        self.branch = branch
        self.attempt = attempt
        self._input = input
        self._input_fn = input_fn
        # Typed values rebuilt (a class this process cannot import stays as its JSON); most
        # runs keep no context (a batch makes a context per item).
        self.context: Mapping[str, Any] = _ReadOnly(decode_lenient(context) if context else {})
        self._patch: dict[str, Any] = {}
        self._tags: dict[str, str] = {}
        self._heartbeat_fn = heartbeat_fn
        self._secret_fn = secret_fn
        self._cancelled_fn = cancelled_fn
        self._stop = cancelled
        self._looked = -math.inf
        self._undone_fn = undone_fn
        self._key: str | None = None

    @property
    def input(self) -> Any:
        """The run's input, read from the database on first use (it can be a large list
        that a scatter hands out item by item; most steps never need it whole)."""
        if self._input_fn is not None:
            try:
                self._input, self._input_fn = decode(self._input_fn()), None
            except ValueNotDecodable as exc:
                # The same input fails the same way on every attempt: no retry.
                raise NonRetryableError(f"the run's input cannot be decoded: {exc}") from None
        return self._input

    def secret(self, name: str) -> str:
        """The secret ``name`` from ``ductor_secret_provider``, read in this worker; its value
        is redacted (``***``) from everything this attempt writes and from log lines.
        Raises ``SecretNotFound`` (the attempt fails without retry) if there is none, and
        ``InvalidSecretName`` (a ``ValueError``; no retry either) unless ``name`` is ASCII
        letters, digits and ``_``, not starting with a digit, at most 100 characters."""
        check_name(name)
        if self._secret_fn is None:
            raise SecretNotFound(f"secret {name!r} is not available outside a step worker")
        return self._secret_fn(name)

    @property
    def idempotency_key(self) -> str:
        """Stable across retries of the same node and branch of the same run:
        ``"<run>:<node>[:<branch>]"``. A node that a saga undid and a redrive runs again gets
        ``"#<n>"`` appended (``n`` = 1 + times undone), and so does its next compensation: the
        rerun charge is a new charge and its refund a new refund (docs/compensation.md)."""
        if self._key is None:
            branch = "" if self.branch is None else f":{self.branch}"
            # Only a step node (no branch) can have been undone: read it once, on first use.
            undone = self._undone_fn() if self._undone_fn and self.branch is None else 0
            self._key = f"{self.run_id}:{self.node}{branch}" + (f"#{undone + 1}" if undone else "")
        return self._key

    def heartbeat(self, details: Any = None) -> None:
        """Record that the attempt is alive (``details``: how far it got). Raises
        ``StepCancelled`` once the run's cancel is requested (learned in the same round trip
        as the heartbeat's write) or the attempt was closed: let it propagate."""
        if self._heartbeat_fn is not None and self._heartbeat_fn(details):
            self._stop = True
        if self._stop:
            raise StepCancelled(f"run {self.run_id} was cancelled: attempt {self.attempt} stops")

    @property
    def cancelled(self) -> bool:
        """True once the run's cancel is requested (or the attempt was closed): the step
        should stop soon. Read from the database at most once a second; a heartbeat refreshes
        it too."""
        if not self._stop and self._cancelled_fn is not None:
            now = time.monotonic()
            if now - self._looked >= CANCEL_LOOK_INTERVAL_S:
                self._looked = now
                self._stop = self._cancelled_fn()
        return self._stop

    def patch(self, mapping: Mapping[str, Any]) -> None:
        """Merge ``mapping`` into the run context when this attempt succeeds."""
        if not isinstance(mapping, Mapping):
            raise TypeError(f"ctx.patch takes a mapping, got {type(mapping).__name__}")
        self._patch.update(mapping)

    @property
    def patch_value(self) -> dict[str, Any] | None:
        return dict(self._patch) if self._patch else None

    def tag(self, key: str, value: str) -> None:
        """Tag the run ``key: value`` when this attempt succeeds (docs/tags.md); a failed
        attempt's tags are dropped. Keys and values are strings of 1..100 characters;
        setting a key again replaces its value. Raises ``InvalidTag`` (a ``ValueError``; the
        attempt fails without retry if it propagates) for a bad tag, or a 21st key in one
        attempt. A tag that would be the run's 21st is dropped by the tick (its history says
        so); the attempt still succeeds."""
        problem = tag_problem(key, value)
        if problem is None and key not in self._tags and len(self._tags) >= MAX_TAGS:
            problem = f"ctx.tag: at most {MAX_TAGS} tags per run, this attempt set {MAX_TAGS}"
        if problem is not None:
            raise InvalidTag(problem)
        self._tags[key] = value

    @property
    def tags_value(self) -> StepTags | None:
        """The tags set, as they travel with the outcome: ``[[key, value], ...]`` in the
        order each key was first set (engine/tags.py)."""
        return [[k, v] for k, v in self._tags.items()] if self._tags else None


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
