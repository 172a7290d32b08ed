"""RetryPolicy, the user-facing retry settings of a step, and the backoff math; the step's
other limits (ConcurrencyLimit, RateLimit)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from ..errors import DefinitionError
from ..limits import (
    MAX_ATTEMPTS,
    MAX_BACKOFF,
    MAX_INT,
    MAX_LEASE_KEY_LENGTH,
    duration_problem,
    int_problem,
    is_number,
    show,
)
from .paths import parse_path
from .spec import ConcurrencySpec, RateLimitSpec, RetrySpec, RunConcurrencySpec

#: The values of ``RetryPolicy.on_exhausted``.
ON_EXHAUSTED = ("fail", "pause")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a failing step is retried.

    Attempt ``n`` (1-based) that fails is retried after
    ``min(initial_interval * backoff ** (n - 1), max_interval)`` seconds, until ``max_attempts``
    attempts have run. Exceptions listed in ``non_retryable`` (and ``NonRetryableError``) fail
    the node at once.
    """

    max_attempts: int = 3
    initial_interval: float = 1.0
    backoff: float = 2.0
    max_interval: float = 60.0
    non_retryable: tuple[type[BaseException], ...] = ()
    #: Each backoff is spread by up to this fraction either way (0.1: +-10%), so many runs
    #: failing together do not retry in lockstep. The spread of an attempt is fixed by its
    #: token (the tick stays a pure function of its inputs).
    jitter: float = 0.0
    #: When the node has used ``max_attempts`` (or timed out on its last one): ``"fail"`` the
    #: node and the run, or ``"pause"`` the run with the node failed and its error kept, so
    #: the code can be fixed and deployed; ``resume`` then runs the node again with a fresh
    #: budget. A non-retryable error fails the node either way (retrying cannot help).
    on_exhausted: Literal["fail", "pause"] = "fail"

    def __post_init__(self) -> None:
        # Checked here, where the user wrote them: a nan or an infinite interval accepted now
        # would make every tick of every run using the policy raise when it schedules a retry.
        problem = int_problem(self.max_attempts, minimum=1, maximum=MAX_ATTEMPTS)
        if problem is not None:
            raise DefinitionError(f"RetryPolicy.max_attempts {problem}")
        for name in ("initial_interval", "max_interval"):
            problem = duration_problem(getattr(self, name), allow_zero=True)
            if problem is not None:
                raise DefinitionError(f"RetryPolicy.{name} {problem}")
        backoff = self.backoff
        # No math.isfinite: it raises OverflowError on an int too large for a float; nan and
        # inf fail the comparisons anyway.
        if not (is_number(backoff) and 1 <= backoff <= MAX_BACKOFF):
            raise DefinitionError(
                f"RetryPolicy.backoff must be a number between 1 and {MAX_BACKOFF:g}, "
                f"got {show(backoff)}"
            )
        if not (is_number(self.jitter) and 0 <= self.jitter <= 1):
            raise DefinitionError(
                f"RetryPolicy.jitter must be a fraction between 0 and 1, got {show(self.jitter)}"
            )
        if self.on_exhausted not in ON_EXHAUSTED:
            raise DefinitionError(
                f"RetryPolicy.on_exhausted must be one of {', '.join(map(repr, ON_EXHAUSTED))}, "
                f"got {show(self.on_exhausted)}"
            )
        if not isinstance(self.non_retryable, tuple | list):  # e.g. a bare ValueError
            raise DefinitionError(
                "RetryPolicy.non_retryable takes a tuple of exception classes, "
                f"got {self.non_retryable!r}"
            )
        # A list is taken as the tuple it stands for (the policy stays hashable).
        object.__setattr__(self, "non_retryable", tuple(self.non_retryable))
        for exc in self.non_retryable:
            if not (isinstance(exc, type) and issubclass(exc, BaseException)):
                raise DefinitionError(
                    f"RetryPolicy.non_retryable takes exception classes, got {exc!r}"
                )

    def to_spec(self) -> RetrySpec:
        return RetrySpec(
            max_attempts=self.max_attempts,
            initial_interval=self.initial_interval,
            backoff=self.backoff,
            max_interval=self.max_interval,
            non_retryable=tuple(f"{e.__module__}.{e.__qualname__}" for e in self.non_retryable),
            jitter=float(self.jitter),
            on_exhausted="pause" if self.on_exhausted == "pause" else "fail",
        )


def backoff_delay(retry: RetrySpec, failed_attempt: int, spread: float = 0.5) -> float:
    """Seconds to wait after attempt number ``failed_attempt`` (1-based) failed.

    ``spread`` (0 to 1, 0.5 the middle) places the delay within the policy's jitter: with
    ``jitter=0.1``, 0 gives 90% of the backoff and 1 gives 110%."""
    exponent = max(failed_attempt - 1, 0)
    # Cap the exponent so a large attempt count cannot overflow the float.
    try:
        delay = retry.initial_interval * retry.backoff ** min(exponent, 64)
    except OverflowError:  # a huge backoff overflows even under the cap
        delay = float("inf") if retry.initial_interval > 0 else 0.0
    delay = float(min(delay, retry.max_interval))
    if retry.jitter and delay > 0:
        delay *= 1 + retry.jitter * (2 * min(max(spread, 0.0), 1.0) - 1)
    return delay


@dataclass(frozen=True)
class ConcurrencyLimit:
    """At most ``limit`` attempts of a step with the same resolved ``key`` run at once.

    ``key`` is a path (``$.input.customer``, ``$.item.sku`` in a scatter) or a literal string
    (one limit shared by every attempt of the step). Enforced with lease rows: an attempt runs
    only while it holds one of the key's ``limit`` slots (see docs/leases.md).
    """

    key: str
    limit: int

    def __post_init__(self) -> None:
        key = self.key
        if not isinstance(key, str) or not key or "\x00" in key:
            raise DefinitionError(
                f"ConcurrencyLimit.key must be a path or a non-empty string, got {show(key)}"
            )
        if len(key) > MAX_LEASE_KEY_LENGTH:
            raise DefinitionError(
                f"ConcurrencyLimit.key must be at most {MAX_LEASE_KEY_LENGTH} characters, "
                f"got {len(key)}"
            )
        if int_problem(self.limit, minimum=1) is not None:
            # Bools are refused: ConcurrencyLimit(key, True) is a slip, not a limit of one.
            raise DefinitionError(
                f"ConcurrencyLimit.limit must be >= 1 and an integer of at most {MAX_INT}, "
                f"got {show(self.limit)}"
            )

    def to_spec(self) -> ConcurrencySpec:
        return ConcurrencySpec(key=self.key, limit=self.limit)


#: The periods a rate may be given in: ``"N/s"``, ``"N/m"``, ``"N/h"``.
RATE_PERIODS = {"s": 1, "m": 60, "h": 3600}
_RATE = re.compile(r"(\d+)/([smh])")


@dataclass(frozen=True)
class RateLimit:
    """At most N attempts of a step per second, minute or hour per resolved ``key``, across
    every worker: ``RateLimit("10/s", key="$.input.customer")``.

    A bucket of N tokens per key value that refills over the period; each attempt takes one
    when a worker claims it. Without ``key``, one bucket for the step. See
    docs/flow-control.md.
    """

    rate: str
    key: str | None = None

    def __post_init__(self) -> None:
        match = _RATE.fullmatch(self.rate) if isinstance(self.rate, str) else None
        if match is None:
            raise DefinitionError(
                f"RateLimit rate must be 'N/s', 'N/m' or 'N/h' (N a whole number), "
                f"got {show(self.rate)}"
            )
        if int(match.group(1)) < 1 or int(match.group(1)) > MAX_INT:
            raise DefinitionError(
                f"RateLimit rate {self.rate!r}: N must be at least 1 and at most {MAX_INT}"
            )
        key = self.key
        if key is None:
            return
        if not isinstance(key, str) or not key.startswith("$."):
            raise DefinitionError(
                f"RateLimit key must be a path such as '$.input.customer' (or None for one "
                f"bucket per step), got {show(key)}"
            )
        if len(key) > MAX_LEASE_KEY_LENGTH:
            raise DefinitionError(
                f"RateLimit key must be at most {MAX_LEASE_KEY_LENGTH} characters, got {len(key)}"
            )
        try:
            path = parse_path(key)
        except DefinitionError as exc:
            raise DefinitionError(f"RateLimit key: {exc}") from None
        if path.root == "secret":
            raise DefinitionError(
                f"RateLimit key {key!r}: a secret cannot key a bucket (keys are stored)"
            )

    @property
    def limit(self) -> int:
        return int(self.rate.split("/")[0])

    @property
    def period(self) -> int:
        """The period in seconds."""
        return RATE_PERIODS[self.rate.split("/")[1]]

    def to_spec(self) -> RateLimitSpec:
        return RateLimitSpec(limit=self.limit, period=self.period, key=self.key)  # type: ignore[arg-type]


#: What a run beyond ``RunConcurrency.limit`` does.
RUN_CONCURRENCY_STRATEGIES = ("queue", "cancel_in_progress", "cancel_newest")


@dataclass(frozen=True)
class RunConcurrency:
    """At most ``limit`` open runs of a workflow per value of ``key``:
    ``Workflow("sync", concurrency=RunConcurrency(key="$.input.customer", limit=1))``.

    ``key`` is a ``$.input`` path (resolved against each run's input) or a literal string (one
    group for every run). ``strategy``: ``"queue"`` (a run beyond the limit waits ``pending``
    for one to end), ``"cancel_in_progress"`` (the oldest open run of the key is cancelled to
    make room, and the new one starts once it has ended) or ``"cancel_newest"`` (the new run is
    cancelled at once, its error saying why). See docs/flow-control.md.
    """

    key: str
    limit: int = 1
    strategy: str = "queue"

    def __post_init__(self) -> None:
        key = self.key
        if not isinstance(key, str) or not key or "\x00" in key:
            raise DefinitionError(
                f"RunConcurrency.key must be a $.input path or a non-empty string, got {show(key)}"
            )
        if len(key) > MAX_LEASE_KEY_LENGTH:
            raise DefinitionError(
                f"RunConcurrency.key must be at most {MAX_LEASE_KEY_LENGTH} characters, "
                f"got {len(key)}"
            )
        if key.startswith("$"):
            try:
                path = parse_path(key)
            except DefinitionError as exc:
                raise DefinitionError(f"RunConcurrency.key: {exc}") from None
            if path.root != "input" or key.startswith("!"):
                raise DefinitionError(
                    f"RunConcurrency.key {key!r}: a run's key is read from its input when it "
                    "starts, so it must be a $.input path (or a literal string)"
                )
        if int_problem(self.limit, minimum=1) is not None:
            raise DefinitionError(
                f"RunConcurrency.limit must be >= 1 and an integer of at most {MAX_INT}, "
                f"got {show(self.limit)}"
            )
        if self.strategy not in RUN_CONCURRENCY_STRATEGIES:
            raise DefinitionError(
                "RunConcurrency.strategy must be 'queue', 'cancel_in_progress' or "
                f"'cancel_newest', got {show(self.strategy)}"
            )

    def to_spec(self) -> RunConcurrencySpec:
        return RunConcurrencySpec(key=self.key, limit=self.limit, strategy=self.strategy)  # type: ignore[arg-type]


def priority_problem(value: object) -> str | None:
    """Why ``value`` is not a priority (an integer 0..9, higher first), or None."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 9:
        return f"priority must be an integer from 0 to 9 (higher first), got {show(value)}"
    return None
