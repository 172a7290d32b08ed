"""The one rule for payloads (inputs, arguments, results, patches, signals, heartbeat details):
JSON that both databases store exactly, and at most ``ductor_max_payload_bytes`` once
serialized as UTF-8. Client, worker and tick all apply it. Typed values (``datetime``,
``Decimal``, ``UUID``, pydantic models, dataclasses...) are checked and returned in their
tagged form (``ductor_celery.values``): what is stored, resolved and measured is that JSON.

"Stored exactly" is stricter than ``json.dumps`` succeeding: PostgreSQL's jsonb refuses NaN and
Infinity, ``\\u0000`` and text that is not valid UTF-8 (a lone surrogate), and a value nested
deeper than ``limits.MAX_JSON_DEPTH`` could not be decoded again by every reader. The check is
total: whatever the value, it returns a verdict and never raises (a user's result nested 3,000
deep must fail its attempt, not the worker).
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from .limits import MAX_JSON_DEPTH
from .values import (
    VALUE_KEY,
    decimal_text_problem,
    encode_default,
    encoding_problem,
    envelope_kind,
    is_typed,
)

#: ``\u0000`` in the serialized text, not preceded by an escaping backslash (``"\\u0000"``,
#: a literal backslash followed by ``u0000``, is harmless text).
_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")

#: The check's serializer, built once: typed values become their envelopes (``default`` is
#: called only for values JSON has no type for, so plain JSON pays nothing for it).
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, default=encode_default)

#: Longest path shown in a message; deeper paths keep their tail.
_PATH_WIDTH = 120


class JsonCheck(NamedTuple):
    """The verdict on one payload."""

    #: The value normalized through JSON (tuples become lists, keys strings, typed values
    #: their envelopes); ``None`` when refused.
    value: Any
    #: What is wrong, naming the payload; ``None`` when the value is accepted.
    problem: str | None = None
    #: Refused for its size alone (``PayloadTooLarge``); otherwise for its content
    #: (``PayloadNotSerializable``).
    too_large: bool = False
    #: The JSON text the value was checked as, when accepted (``ensure_ascii=False``, the
    #: default separators, no NaN), for a caller that needs the value's JSON (its size, a
    #: query parameter) instead of encoding the value once more. ``value`` encodes to this
    #: very text again, except where two keys of one dict were the same once made strings
    #: (``1`` and ``"1"``): the text holds both, ``value`` the last, as PostgreSQL's jsonb
    #: reads that text too. So the text is never shorter than the value's own encoding, and
    #: never the bytes of a blob (``blobs.large_text`` encodes a value it offloads itself).
    text: str | None = None


#: A further check of an accepted value, given its JSON text and normalized value: what is
#: wrong with it, or None (``definition.blobrefs.reserved_key_problem`` at the doors).
DoorCheck = Callable[[str, Any], str | None]


def check_json(value: Any, what: str, limit: int, *, door: DoorCheck | None = None) -> JsonCheck:
    """Whether ``value`` can be stored exactly as JSON of at most ``limit`` UTF-8 bytes.

    ``door``: the value comes from outside ductor (a client's input or payload) and must
    also pass this check (the key ductor reserves for references to large values is refused
    there: a reference in a row is always one ductor wrote; a step's result is checked for
    it in ``runtime/step_errors.py``).

    Cost on the accepted path: one ``json.dumps`` and one ``json.loads`` (both in C), an
    encode to UTF-8, and a walk over containers only when the text holds more than
    ``MAX_JSON_DEPTH`` brackets (fewer brackets cannot nest deeper).
    """
    try:
        return _check(value, what, limit, door)
    except Exception as exc:  # noqa: BLE001 - total: a user's dict subclass may raise anything
        return JsonCheck(None, storable_text(f"{what} is not JSON-serializable: {_describe(exc)}"))


def refusal(value: Any, what: str, limit: int) -> tuple[Any, dict[str, Any] | None]:
    """``value`` normalized through JSON and ``None``, or ``None`` and the stored error of
    its refusal, typed as the client's exceptions are: ``PayloadTooLarge`` for its size,
    ``PayloadNotSerializable`` for its content."""
    checked = check_json(value, what, limit)
    return checked.value, refusal_error(checked)


def refusal_error(checked: JsonCheck) -> dict[str, Any] | None:
    """The stored error of a refused check, typed as ``refusal`` types it, or None."""
    if checked.problem is None:
        return None
    kind = "PayloadTooLarge" if checked.too_large else "PayloadNotSerializable"
    return {"type": kind, "message": checked.problem}


def json_problem(value: Any, what: str, limit: int) -> tuple[Any, str | None]:
    """``value`` normalized through JSON, or ``None`` and a problem that names ``what``."""
    checked = check_json(value, what, limit)
    return checked.value, checked.problem


#: Integers within this bound take the scalar path (``_scalar_text``); a larger one goes the
#: whole way, where an integer too long to print (``sys.set_int_max_str_digits``) is refused.
_PLAIN_INT_BOUND = 10**18


def _scalar_text(value: Any) -> str | None:
    """The JSON text of a plain scalar (``None``, a ``bool``, a bounded ``int``, a finite
    ``float``; exactly those types, no subclass), which JSON reads back as the very same
    value: nothing in it to walk, escape, measure as UTF-8 or decode again. ``None`` for any
    other value. Many steps return one of these (a count, a flag, an id); a batch checks
    each of its items' results."""
    kind = type(value)
    if value is None:
        return "null"
    if kind is bool:
        return "true" if value else "false"
    if kind is int:
        return int.__repr__(value) if -_PLAIN_INT_BOUND < value < _PLAIN_INT_BOUND else None
    if kind is float:
        return float.__repr__(value) if math.isfinite(value) else None
    return None


def _too_large(what: str, size: int, limit: int) -> JsonCheck | None:
    """The refusal of a payload of ``size`` bytes over ``limit``, or None."""
    if size <= limit:
        return None
    return JsonCheck(None, f"{what} is {size} bytes, over ductor_max_payload_bytes={limit}", True)


def _check(value: Any, what: str, limit: int, door: DoorCheck | None) -> JsonCheck:
    scalar = _scalar_text(value)
    if scalar is not None:
        # ASCII, and no key: no byte count, NUL or reserved key to look for.
        return _too_large(what, len(scalar), limit) or JsonCheck(value, text=scalar)
    try:
        # ensure_ascii=False: the text's UTF-8 encoding is what is measured, and encoding it
        # is what finds a lone surrogate.
        text = _ENCODER.encode(value)
        # An ASCII text's bytes are its characters (no copy to measure it); any other is
        # encoded, which is also what finds a lone surrogate, and the copy dropped at once.
        size = len(text) if text.isascii() else len(text.encode("utf-8"))
    except Exception as exc:  # noqa: BLE001 - TypeError, ValueError, RecursionError, ...
        return _refused(value, what, exc)
    if "\\u0000" in text and _NUL.search(text):
        return _refused(value, what, None)
    if (too_large := _too_large(what, size, limit)) is not None:
        return too_large
    normalized = json.loads(text)
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _deeper_than(
        normalized, MAX_JSON_DEPTH
    ):
        return _refused(value, what, None)
    # A Decimal sent already encoded (JSON from the CLI or the console) is bounded as one
    # given as an object is; the walk runs only when the text names the kind at all.
    if '"decimal"' in text and (found := _unbounded_decimal(normalized)) is not None:
        return JsonCheck(None, storable_text(f"{what} is not JSON-serializable: {found}"))
    if door is not None and (problem := door(text, normalized)) is not None:
        return JsonCheck(None, storable_text(f"{what} is not JSON-serializable: {problem}"))
    return JsonCheck(normalized, text=text)


def _unbounded_decimal(value: Any) -> str | None:
    """The first decimal envelope in encoded JSON past the bounds, with its path."""
    stack: list[tuple[Any, str]] = [(value, "$")]
    while stack:
        item, path = stack.pop()
        if envelope_kind(item) == "decimal":
            if (problem := decimal_text_problem(item[VALUE_KEY])) is not None:
                return f"{problem} at {_short(path)}"
        elif isinstance(item, dict | list):
            stack += [child for (_, child) in reversed(list(_children(item, path)))]
    return None


class JsonTextError(ValueError):
    """A text a person typed or sent that is no strict JSON; the message names the field."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (JSON has no NaN or Infinity)")


def _json_int(digits: str) -> int:
    limit = sys.get_int_max_str_digits()
    if limit and len(digits.lstrip("-")) > limit:
        raise ValueError(f"an integer of {len(digits.lstrip('-'))} digits (at most {limit})")
    return int(digits)


def loads_strict(text: str, what: str) -> Any:
    """JSON text from a person (the CLI's ``--input`` and ``--payload``, the console's fields
    and bodies), read strictly: no NaN or Infinity, no integer too long to read, at most
    MAX_JSON_DEPTH levels. ``JsonTextError`` naming ``what`` otherwise, on one line."""
    too_deep = f"{what} is nested too deeply (at most {MAX_JSON_DEPTH} levels)"
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_int=_json_int)
    except RecursionError:
        raise JsonTextError(too_deep) from None
    except ValueError as exc:  # JSONDecodeError too
        first = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        raise JsonTextError(f"{what} is not valid JSON: {first or type(exc).__name__}") from None
    if _deeper_than(value, MAX_JSON_DEPTH):
        raise JsonTextError(too_deep)
    return value


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether decoded JSON nests lists and dicts more than ``limit`` levels (iteratively)."""
    level = [value] if type(value) is dict or type(value) is list else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        below: list[Any] = []
        for container in level:
            items = container.values() if type(container) is dict else container
            below += [x for x in items if type(x) is dict or type(x) is list]
        level = below
    return False


def _refused(value: Any, what: str, exc: Exception | None) -> JsonCheck:
    """The refusal, naming the first offending value and where it is (the failure path only,
    so it may walk the whole value)."""
    found = _first_problem(value)
    detail = found if found is not None else _describe(exc) if exc else "cannot be stored"
    return JsonCheck(None, storable_text(f"{what} is not JSON-serializable: {detail}"))


def _first_problem(value: Any) -> str | None:
    """The first value that JSON (as PostgreSQL stores it) cannot hold, with its path."""
    stack: list[tuple[Any, str, int]] = [(value, "$", 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, dict | list | tuple):
            if depth + 1 > MAX_JSON_DEPTH:
                return f"it is nested deeper than {MAX_JSON_DEPTH} levels"
            children = list(_children(item, path))
            for key, _ in children:
                if key is not None and (problem := _scalar_problem(key)) is not None:
                    return f"key {_show(key)} at {_short(path)}: {problem}"
            stack += [(child, where, depth + 1) for (_, (child, where)) in reversed(children)]
        elif is_typed(item):
            # A model or dataclass may hold the problem inside: walk its encoded form.
            if (problem := encoding_problem(item)) is not None:
                return f"{problem} at {_short(path)}"
            stack.append((encode_default(item), path, depth))
        elif (problem := _scalar_problem(item)) is not None:
            return f"{problem} at {_short(path)}"
    return None


def _children(item: Any, path: str) -> Iterator[tuple[Any, tuple[Any, str]]]:
    """(dict key or None, (child, its path)) of a container."""
    if isinstance(item, dict):
        for key, child in item.items():
            yield key, (child, f"{path}.{key}" if isinstance(key, str) else f"{path}[{_show(key)}]")
    else:
        for index, child in enumerate(item):
            yield None, (child, f"{path}[{index}]")


def _scalar_problem(item: Any) -> str | None:
    """Why a non-container value (or a dict key) cannot be stored, or ``None``."""
    if item is None or isinstance(item, bool):
        return None
    if isinstance(item, str):
        if "\x00" in item:
            return "a NUL character (\\x00) in text"
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:
            return "a lone surrogate in text (not valid UTF-8)"
        return None
    if isinstance(item, int):
        try:
            int.__repr__(item)
        except ValueError:
            return f"an integer of more than {sys.get_int_max_str_digits()} digits"
        return None
    if isinstance(item, float):
        return None if math.isfinite(item) else f"{item!r} (JSON has no NaN or Infinity)"
    return f"a value of type {type(item).__name__}"


def _show(key: Any) -> str:
    """A key for a message: ``repr`` escapes NUL and surrogates; a huge int has none."""
    try:
        return _short(repr(key))
    except Exception:  # noqa: BLE001
        return f"<{type(key).__name__}>"


def _short(text: str) -> str:
    return text if len(text) <= _PATH_WIDTH else "…" + text[-_PATH_WIDTH:]


def _describe(exc: BaseException) -> str:
    """``Type: message``, even when the exception's ``__str__`` raises."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001
        message = "<unprintable>"
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def storable_text(message: str) -> str:
    """Text both databases accept: NUL and lone surrogates escaped. An exception's message, a
    traceback or a driver's error can carry either, and a refused error would leave the
    attempt (or the node) it belongs to without one."""
    return message.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")
