"""RetryPolicy, the user-facing retry settings of a step, and the backoff math."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import DefinitionError
from .spec import ConcurrencySpec, RetrySpec


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

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise DefinitionError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_interval < 0 or self.max_interval < 0:
            raise DefinitionError("RetryPolicy intervals must be >= 0")
        if self.backoff < 1:
            raise DefinitionError(f"RetryPolicy.backoff must be >= 1, got {self.backoff}")
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
        )


def backoff_delay(retry: RetrySpec, failed_attempt: int) -> float:
    """Seconds to wait after attempt number ``failed_attempt`` (1-based) failed."""
    exponent = max(failed_attempt - 1, 0)
    # Cap the exponent so a large attempt count cannot overflow the float.
    try:
        delay = retry.initial_interval * retry.backoff ** min(exponent, 64)
    except OverflowError:  # a huge backoff overflows even under the cap
        delay = float("inf") if retry.initial_interval > 0 else 0.0
    return float(min(delay, retry.max_interval))


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
        if not isinstance(self.key, str) or not self.key:
            raise DefinitionError(
                f"ConcurrencyLimit.key must be a path or string, got {self.key!r}"
            )
        if not isinstance(self.limit, int) or self.limit < 1:
            raise DefinitionError(f"ConcurrencyLimit.limit must be >= 1, got {self.limit!r}")

    def to_spec(self) -> ConcurrencySpec:
        return ConcurrencySpec(key=self.key, limit=self.limit)
