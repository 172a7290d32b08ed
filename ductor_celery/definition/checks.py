"""Checks of the builder's raw node settings, each raising a DefinitionError naming the node.

Every value is checked against limits.py before it reaches a spec: one accepted here and
unusable later (an infinite timeout, a 300-character id) would make every tick of the run raise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import DefinitionError
from ..limits import MAX_BATCH_SIZE, duration_problem, id_problem, int_problem, is_number
from ..payloads import check_json
from .blobrefs import reserved_key_in
from .retry import ConcurrencyLimit, RateLimit, RetryPolicy
from .spec import BATCH_ARG, RESERVED_SIGNAL_PREFIX, ConcurrencySpec, RateLimitSpec
from .validate import short


def refuse(where: str, field: str, problem: str | None) -> None:
    """Raise the DefinitionError for ``problem`` (from limits.py), naming node and field."""
    if problem is not None:
        raise DefinitionError(f"{where}: {field} {problem}")


def check_timeout(where: str, field: str, value: Any) -> None:
    """``None`` (no timeout) or a positive, finite number of seconds of at most ten years."""
    if value is not None:
        refuse(where, field, duration_problem(value))


#: Templates are not held to ductor_max_payload_bytes here (the definition is no payload).
_NO_SIZE_LIMIT = 1 << 62


def check_literals(template: Any, where: str, field: str) -> Any:
    """A template (``args``, a child's ``input``, the ``output``) as JSON normalizes it (tuples
    become lists), so a spec in memory holds what its stored form reads back as. Refused when
    its literals are no JSON both databases store exactly: NaN or Infinity (pydantic would
    store them as ``null``), NUL, a lone surrogate, an int too long to print, a non-JSON type,
    or nesting deeper than MAX_JSON_DEPTH. The definition is stored as JSON, and what the
    template resolves to is a payload (an argument set counts as one level)."""
    checked = check_json(template, f"{where}: {field}", _NO_SIZE_LIMIT)
    if checked.problem is not None:
        raise DefinitionError(checked.problem)
    # A literal reference would be trusted as ductor's own and read another run's blob.
    reserved = reserved_key_in(checked.value)
    if reserved is not None:
        raise DefinitionError(f"{where}: {field}: {reserved}")
    return checked.value


def check_when(when: Any, where: str) -> None:
    if when is not None and not isinstance(when, str | bool):
        raise DefinitionError(
            f"{where}: when must be a path such as '$.input.flag' or True/False, got {short(when)}"
        )


def after_ids(after: Any, where: str) -> tuple[str, ...]:
    if after is None:
        return ()
    if isinstance(after, str):
        return (after,)
    deps = tuple(after) if isinstance(after, Iterable) else None
    if deps is None or not all(isinstance(dep, str) for dep in deps):
        raise DefinitionError(
            f"{where}: after must be a node id or a list of node ids, got {short(after)}"
        )
    return deps


def signal_problem(name: Any) -> str | None:
    """Why ``name`` cannot be waited for, or ``None``. A reserved name could never be sent
    (``signal()`` refuses it), so a node waiting for one would wait forever."""
    problem = id_problem(name)
    if problem is not None:
        return problem
    if name.startswith(RESERVED_SIGNAL_PREFIX):
        return f"must not start with {RESERVED_SIGNAL_PREFIX!r} (reserved), got {short(name)}"
    return None


def check_events(events: Any, mode: Any, where: str) -> tuple[str, ...]:
    """The event-set's signal names as a tuple, after checking them and ``mode``."""
    if isinstance(events, str | bytes) or not isinstance(events, list | tuple):
        # A bare string would otherwise be iterated: events="abc" waiting for "a", "b", "c".
        raise DefinitionError(
            f"{where}: events must be a list of signal names (events=['paid']), got {short(events)}"
        )
    if not events:
        raise DefinitionError(f"{where}: event_set needs at least one event")
    for index, name in enumerate(events):
        refuse(where, f"events[{index}]", signal_problem(name))
    duplicates = sorted({name for name in events if events.count(name) > 1})
    if duplicates:
        raise DefinitionError(f"{where}: events lists {duplicates[0]!r} more than once")
    if isinstance(mode, int) and not isinstance(mode, bool):
        if not 1 <= mode <= len(events):
            raise DefinitionError(
                f"{where}: mode={short(mode)} must be between 1 and the number of events "
                f"({len(events)})"
            )
    elif mode not in ("all", "any"):
        raise DefinitionError(f"{where}: mode must be 'all', 'any' or a number, got {short(mode)}")
    return tuple(events)


def check_over(over: Any, where: str) -> None:
    if not isinstance(over, str) or not over.startswith(("$.input", "$.nodes.")):
        raise DefinitionError(
            f"{where}: over={short(over)} must be a path to a list under $.input or "
            "$.nodes.<id>.output (they never change while the scatter runs)"
        )


def check_tolerance(raw: dict[str, Any], where: str) -> None:
    if raw["tolerated_failures"] is not None and raw["tolerated_failure_ratio"] is not None:
        raise DefinitionError(
            f"{where}: give tolerated_failures or tolerated_failure_ratio, not both"
        )
    refuse(where, "max_parallel", int_problem(raw["max_parallel"], minimum=1))
    if raw["tolerated_failures"] is not None:
        refuse(where, "tolerated_failures", int_problem(raw["tolerated_failures"], minimum=0))
    ratio = raw["tolerated_failure_ratio"]
    if ratio is not None and not (is_number(ratio) and 0 <= ratio <= 1):  # nan fails 0 <= nan
        raise DefinitionError(
            f"{where}: tolerated_failure_ratio must be a number between 0 and 1, got {short(ratio)}"
        )


def check_scatter_options(raw: dict[str, Any], where: str) -> None:
    if raw["step"] is None:
        raise DefinitionError(f"{where}: scatter needs a step to run for each item")
    check_over(raw["over"], where)
    check_tolerance(raw, where)
    refuse(where, "batch_size", int_problem(raw["batch_size"], minimum=1, maximum=MAX_BATCH_SIZE))
    item_arg = raw["item_arg"]
    if item_arg is not None:
        if not isinstance(item_arg, str) or not item_arg.isidentifier():
            raise DefinitionError(
                f"{where}: item_arg must be an argument name, got {short(item_arg)}"
            )
        if item_arg == BATCH_ARG:
            raise DefinitionError(
                f"{where}: item_arg: the argument name {BATCH_ARG!r} is reserved (batch attempts)"
            )
        args = raw["args"]
        # args that are no mapping are refused, with their own message, by the caller.
        if isinstance(args, Mapping) and item_arg in args:
            raise DefinitionError(
                f"{where}: item_arg {item_arg!r} is also given in args; rename one of them"
            )


def check_batch_lease(batch_size: int, concurrency: ConcurrencySpec | None, where: str) -> None:
    """A batch is one attempt holding one lease, so its key cannot differ per item."""
    if batch_size > 1 and concurrency is not None and concurrency.key.startswith("$.item"):
        raise DefinitionError(
            f"{where}: batch_size={batch_size} runs a batch of items as one attempt under one "
            f"concurrency lease, so the step's concurrency key {concurrency.key!r} cannot read "
            "$.item (use batch_size=1, or a key that is the same for every item)"
        )


def check_batch_rate(batch_size: int, rate: RateLimitSpec | None, where: str) -> None:
    """A batch is one attempt taking one token, so its rate key cannot differ per item."""
    if batch_size > 1 and rate is not None and (rate.key or "").startswith("$.item"):
        raise DefinitionError(
            f"{where}: batch_size={batch_size} runs a batch of items as one attempt taking one "
            f"rate-limit token, so the rate key {rate.key!r} cannot read $.item (use "
            "batch_size=1, or a key that is the same for every item)"
        )


def step_name(fn: Callable[..., Any], name: object) -> str:
    """The name ``@ductor.step`` registers ``fn`` under: ``name`` if given, else the function's
    module and qualified name, which every worker importing the module derives alike."""
    if not callable(fn):
        raise DefinitionError(not_a_function(fn))
    if name is not None:
        refuse(f"step {short(name)}", "name", id_problem(name))
        assert isinstance(name, str)
        return name
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<lambda>" in qualname:
        # A lambda's "<lambda>" is shared by every lambda of its module, and a partial or a
        # callable object has no qualified name at all: only the user can name them.
        raise DefinitionError(
            f"step {short(fn)} has no name a worker can find it by (a lambda, a "
            "functools.partial or a callable object): give it one, "
            "@ductor.step(name='orders.charge')"
        )
    derived = f"{module}.{qualname}"
    problem = id_problem(derived)
    if problem is not None:
        raise DefinitionError(
            f"step {short(derived)}: its name {problem}; give a shorter one with "
            "@ductor.step(name=...)"
        )
    return derived


def not_a_function(fn: object) -> str:
    hint = " (to name a step write @ductor.step(name=...))" if isinstance(fn, str) else ""
    return f"@ductor.step takes a function fn(ctx, **args), got {short(fn)}{hint}"


def check_step_options(
    step: str,
    *,
    retry: object,
    timeout: object,
    heartbeat_timeout: object,
    queue: object,
    concurrency: object,
    schedule_to_start_timeout: object = None,
    rate_limit: object = None,
) -> None:
    """The options of ``@ductor.step``, checked when the function is decorated."""
    where = f"step {step!r}"
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise DefinitionError(f"{where}: retry= takes a RetryPolicy(...), got {short(retry)}")
    check_timeout(where, "timeout", timeout)
    check_timeout(where, "heartbeat_timeout", heartbeat_timeout)
    check_timeout(where, "schedule_to_start_timeout", schedule_to_start_timeout)
    if queue is not None:
        refuse(where, "queue", id_problem(queue))
    if concurrency is not None and not isinstance(concurrency, ConcurrencyLimit):
        raise DefinitionError(
            f"{where}: concurrency= takes a ConcurrencyLimit(key, limit), got {short(concurrency)}"
        )
    if rate_limit is not None and not isinstance(rate_limit, RateLimit):
        raise DefinitionError(
            f"{where}: rate_limit= takes a RateLimit('N/s', key=...), got {short(rate_limit)}"
        )
