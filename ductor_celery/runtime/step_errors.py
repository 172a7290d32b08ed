"""Making anything a step does into text and JSON the database accepts: the stored error of
an exception, a one-line cause, a payload checked without ever raising, and whether an
exception fails its node without retry. All of it total: a step's broken ``__str__`` or odd
value must never stop its attempt's outcome from being written."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

from ..definition.blobrefs import reserved_key_problem
from ..errors import NonRetryableError
from ..payloads import JsonCheck, check_json, storable_text
from .secrets import redact_known

#: The longest exception message and traceback tail kept in an attempt's error, and the
#: longest database or exception cause quoted in a message.
MESSAGE_CHARS = 4000
TRACEBACK_CHARS = 8000
CAUSE_CHARS = 500


def is_non_retryable(exc: BaseException, non_retryable: frozenset[str]) -> bool:
    """``NonRetryableError``, or an exception whose class or one of its bases is listed (by
    qualified name, as the definition stores them) in the node's retry policy."""
    if isinstance(exc, NonRetryableError):
        return True
    return bool(non_retryable) and any(
        f"{cls.__module__}.{cls.__qualname__}" in non_retryable for cls in type(exc).__mro__
    )


def guarded(make: Callable[[], str], fallback: str) -> str:
    """``make()``, or ``fallback`` if it raises anything at all.

    Formatting a step's exception runs the user's code (``__str__``) while that exception is
    being handled; whatever it raises, even ``SystemExit``, is a broken ``__str__``, and must
    not stop the attempt's outcome from being written.
    """
    try:
        return make()
    except BaseException:  # noqa: BLE001
        return fallback


def error_of(exc: BaseException, redact: Callable[[str], str]) -> dict[str, str]:
    """The stored error of a raised exception; building it cannot fail. ``redact``: the
    attempt's secrets out of the message and traceback, before they are cut to size (a secret
    the cut went through would leave a fragment no redaction finds)."""
    name = guarded(lambda: storable_text(str(type(exc).__qualname__))[:200], "BaseException")
    message = guarded(
        lambda: storable_text(redact(str(exc))[:MESSAGE_CHARS]), f"<unprintable {name}>"
    )
    trace = guarded(
        lambda: storable_text(
            redact("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))[
                -TRACEBACK_CHARS:
            ]
        ),
        f"<unprintable traceback of {name}>",
    )
    return {"type": name, "message": message, "traceback": trace}


def payload_of(
    value: Any, what: str, limit: int, *, refs_allowed: bool = False
) -> tuple[Any, str | None]:
    """The value normalized through JSON and None, or None and the problem
    (``checked_payload``)."""
    checked = checked_payload(value, what, limit, refs_allowed=refs_allowed)
    return checked.value, checked.problem


def checked_payload(value: Any, what: str, limit: int, *, refs_allowed: bool = False) -> JsonCheck:
    """``check_json``'s verdict on a value a step produced (its JSON text included), made
    total here as well: whatever the check raises (a RecursionError on a value nested
    thousands deep, a user's container misbehaving) is the problem.

    ``refs_allowed``: the value was put together by ductor from values already checked one by
    one (a batch's list of item results, where a large item is ductor's own reference), so
    the reserved key is not refused in it."""
    try:
        # The reserved key is looked for in the JSON text the check makes anyway: a result
        # is walked only when the key appears in it at all.
        return check_json(value, what, limit, door=None if refs_allowed else reserved_key_problem)
    except Exception as exc:  # noqa: BLE001
        return JsonCheck(None, f"{what} is not JSON-serializable: {describe(exc)}")


def describe(exc: BaseException) -> str:
    """``Type: message`` on one line, short and storable, even when ``__str__`` raises."""
    name = guarded(lambda: type(exc).__name__, "BaseException")
    # Redacted before its whitespace is folded and it is cut: the log filter would miss a
    # secret changed by either.
    text = guarded(lambda: " ".join(redact_known(str(exc)).split()), "<unprintable>")
    return storable_text(f"{name}: {text}" if text else name)[:CAUSE_CHARS]
