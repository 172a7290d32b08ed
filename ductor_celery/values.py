"""Typed values in JSON: the one tagged encoding every stored or sent value uses.

A value that JSON has no type for is stored as a two-key envelope, the markers kombu's own
JSON serializer uses (``kombu.utils.json``), so a value reads the same in either:

==============================  ===============  =============================================
Python value                    ``__type__``     ``__value__``
==============================  ===============  =============================================
``datetime``                    ``datetime``     ISO 8601 text (``isoformat()``)
``date``                        ``date``         ISO 8601 text
``time``                        ``time``         ISO 8601 text
``Decimal``                     ``decimal``      ``str(value)`` (every digit, the exponent kept)
``UUID``                        ``uuid``         ``{"hex": value.hex}``
``bytes``                       ``bytes`` /      UTF-8 text, or base64 text when not UTF-8
                                ``base64``       (or holding NUL, which jsonb cannot)
pydantic model                  ``pydantic``     ``{"class": "module:Qual.Name", "data": ...}``
                                                 (``data``: ``model_dump(mode="json")``)
dataclass instance              ``dataclass``    ``{"class": "module:Qual.Name", "fields":
                                                 {name: value}}`` (fields encoded in turn)
==============================  ===============  =============================================

Encoding happens where a value enters ductor (``payloads.check_json``: a run's input,
a signal's payload, a step's result, context patch and heartbeat details, a definition's
literals); what is stored, resolved by paths and measured against the size limit is the
encoded JSON. Decoding happens where a value leaves for user code: a step's arguments,
``ctx.input``, ``ctx.context``, and ``RunView``/``NodeView``.

Encoding is idempotent (an encoded value is plain JSON and encodes to itself), so every layer
may check a value again without knowing whether it was checked before. The price: a plain
dict shaped exactly like a well-formed scalar envelope (the two keys ``__type__`` and
``__value__``, a scalar kind above and text of that kind) reads back as that type, as it does
in kombu. Any other dict, ``__type__`` key or not, reads back as itself.

Data never chooses code. A model or dataclass envelope names its class (``module:qualname``,
not defined inside a function), and it is rebuilt only into a class this process declared
(``declared.py``): with ``register_type`` (``Ductor.register_type``), or by naming it in a
registered step's parameter or return annotations (``declare_annotations``); the classes their
fields name come with them. Nothing is ever imported because a value names it. An envelope of
an undeclared class, or one that does not hold what its kind says (base64 that is not base64,
a Decimal past the bounds, extra keys), stays the plain dict it was sent as. A Decimal is
bounded at the door (encoding refuses one past ``DECIMAL_MAX_DIGITS`` digits or an exponent
beyond ``DECIMAL_MAX_EXPONENT``) and again where it is decoded.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import json
import uuid
from collections.abc import Callable
from datetime import date, datetime, time
from decimal import Decimal
from typing import Any

from pydantic import BaseModel, ValidationError

# The classes a value may be rebuilt into are kept in ``declared.py``.
from .declared import declared

TYPE_KEY = "__type__"
VALUE_KEY = "__value__"
_ENVELOPE_KEYS = frozenset((TYPE_KEY, VALUE_KEY))


class ValueNotEncodable(TypeError):
    """A value of a type the encoding has no form for, a class it cannot name, or a Decimal
    past the bounds."""


class ValueNotDecodable(ValueError):
    """An envelope of a declared class whose data does not rebuild it (it does not validate,
    or the class's own ``__init__`` refuses it)."""


def _envelope(kind: str, value: Any) -> dict[str, Any]:
    return {TYPE_KEY: kind, VALUE_KEY: value}


# -- encoding ------------------------------------------------------------------------------------


#: Largest Decimal a value may carry: digits, and exponent either way. Past them a number
#: costs time to use (``int(Decimal("1e999999999"))`` computes for minutes), not to store.
DECIMAL_MAX_DIGITS = 1_000
DECIMAL_MAX_EXPONENT = 1_000


def decimal_problem(value: Decimal) -> str | None:
    """Why a Decimal is past the bounds, or ``None`` (NaN and the infinities are within)."""
    _, digits, exponent = value.as_tuple()
    if not isinstance(exponent, int):
        return None
    if len(digits) > DECIMAL_MAX_DIGITS:
        return f"a Decimal with {len(digits)} digits, over the limit of {DECIMAL_MAX_DIGITS:,}"
    if abs(exponent) > DECIMAL_MAX_EXPONENT or abs(value.adjusted()) > DECIMAL_MAX_EXPONENT:
        return f"a Decimal with exponent {value.adjusted()}, beyond +-{DECIMAL_MAX_EXPONENT:,}"
    return None


def decimal_text_problem(text: Any) -> str | None:
    """Why a decimal envelope's text stands for a Decimal past the bounds, or ``None`` (also
    for text that is no Decimal at all: that envelope is malformed, and stays a dict)."""
    if not isinstance(text, str):
        return None
    if len(text) > 2 * DECIMAL_MAX_DIGITS:
        return f"a Decimal written in {len(text):,} characters"
    try:
        return decimal_problem(Decimal(text))
    except ArithmeticError:
        return None


def _encode_decimal(value: Decimal) -> dict[str, Any]:
    problem = decimal_problem(value)
    if problem is not None:
        raise ValueNotEncodable(problem)
    return _envelope("decimal", str(value))


def _encode_bytes(value: bytes) -> dict[str, Any]:
    # Text when it is UTF-8 that PostgreSQL can hold (no NUL), as kombu does; base64 otherwise.
    if b"\x00" not in value:
        try:
            return _envelope("bytes", value.decode("utf-8"))
        except UnicodeDecodeError:
            pass
    return _envelope("base64", base64.b64encode(value).decode("ascii"))


#: Exact types first (a dict lookup); subclasses are found by ``isinstance`` below, datetime
#: before date since a datetime is a date.
_SCALARS: dict[type, Callable[[Any], dict[str, Any]]] = {
    datetime: lambda v: _envelope("datetime", v.isoformat()),
    date: lambda v: _envelope("date", v.isoformat()),
    time: lambda v: _envelope("time", v.isoformat()),
    Decimal: _encode_decimal,
    uuid.UUID: lambda v: _envelope("uuid", {"hex": v.hex}),
    bytes: _encode_bytes,
}


def class_path(cls: type) -> str:
    """``module:qualname``: the name an envelope gives a class, by which a process that
    declared the class (``register_type``, a step's annotations) rebuilds it."""
    qualname = cls.__qualname__
    if "<locals>" in qualname:
        raise ValueNotEncodable(
            f"{qualname} is defined inside a function: ductor names a model or dataclass by "
            "its module and qualified name, so define it at module level"
        )
    return f"{cls.__module__}:{qualname}"


def encode_default(value: Any) -> Any:
    """``json.dumps``'s ``default=``: the envelope of a typed value (called only for values
    JSON has no type for, so plain JSON costs nothing)."""
    encoder = _SCALARS.get(type(value))
    if encoder is not None:
        return encoder(value)
    if isinstance(value, BaseModel):
        data = value.model_dump(mode="json")
        return _envelope("pydantic", {"class": class_path(type(value)), "data": data})
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return _envelope("dataclass", {"class": class_path(type(value)), "fields": fields})
    for kind, encoder in _SCALARS.items():
        if isinstance(value, kind):
            return encoder(value)
    raise ValueNotEncodable(f"a value of type {type(value).__name__}")


def is_typed(value: Any) -> bool:
    """Whether ``value`` is one the encoding gives an envelope (not plain JSON)."""
    return (
        isinstance(value, tuple(_SCALARS))
        or isinstance(value, BaseModel)
        or (dataclasses.is_dataclass(value) and not isinstance(value, type))
    )


def encoding_problem(value: Any) -> str | None:
    """Why a typed value cannot be encoded, or ``None``."""
    try:
        encode_default(value)
    except ValueNotEncodable as exc:
        return str(exc)
    return None


_ENCODER = json.JSONEncoder(separators=(",", ":"), default=encode_default)


def encode(value: Any) -> Any:
    """``value`` as plain JSON (envelopes for typed values); tuples become lists."""
    return json.loads(_ENCODER.encode(value))


# -- decoding ------------------------------------------------------------------------------------


class _Malformed(Exception):  # noqa: N818 - internal signal, never raised out of this module
    """An envelope that is not what it says (an undeclared class, text that does not parse, a
    Decimal past the bounds): it stays the plain dict it was sent as."""


#: What a user's class may raise while it is rebuilt (a validator, ``__post_init__``), caught
#: so that decoding never ends a worker or a view: SystemExit included, KeyboardInterrupt not.
REBUILD_ERRORS = (Exception, SystemExit)


def _class_of(path: Any, fits: Callable[[type], bool]) -> Any:
    cls = declared(path) if isinstance(path, str) else None
    if cls is None or not fits(cls):
        raise _Malformed
    return cls


def _decode_model(value: Any) -> Any:
    if not isinstance(value, dict) or set(value) != {"class", "data"}:
        raise _Malformed
    cls = _class_of(value["class"], lambda c: issubclass(c, BaseModel))
    try:
        # The JSON validator, as the data is ``model_dump(mode="json")``: it reads ISO dates,
        # base64 and the like back even in strict models.
        return cls.model_validate_json(json.dumps(value["data"]))
    except REBUILD_ERRORS as exc:  # a ValidationError, or the model's own validator
        raise ValueNotDecodable(
            f"{value['class']}: the stored data does not rebuild it: {error_summary(exc)}"
        ) from None


def _decode_dataclass(value: Any, mode: _Mode) -> Any:
    if (
        not isinstance(value, dict)
        or set(value) != {"class", "fields"}
        or not isinstance(value["fields"], dict)
    ):
        raise _Malformed
    cls = _class_of(value["class"], dataclasses.is_dataclass)
    fields = {k: _decode(v, mode) for k, v in value["fields"].items()}
    init = {f.name for f in dataclasses.fields(cls) if f.init}
    try:
        obj = cls(**{k: v for k, v in fields.items() if k in init})
        for name, field_value in fields.items():
            if name not in init:
                object.__setattr__(obj, name, field_value)
    except REBUILD_ERRORS as exc:  # the dataclass's own __init__/__post_init__
        raise ValueNotDecodable(
            f"{value['class']}: rebuilding it raised {error_summary(exc)}"
        ) from None
    return obj


def validation_summary(exc: ValidationError) -> str:
    """pydantic's errors without the input values (a value may hold a secret)."""
    parts = []
    for error in exc.errors(include_url=False, include_input=False, include_context=False):
        where = ".".join(str(p) for p in error.get("loc", ())) or "value"
        parts.append(f"{where}: {error.get('msg', 'invalid')}")
    shown = "; ".join(parts[:5])
    return shown + (f" (and {len(parts) - 5} more)" if len(parts) > 5 else "")


def error_summary(exc: BaseException) -> str:
    """``Type: message`` of what a user's class raised while a value was rebuilt, pydantic's
    errors without their input values, and never more than a line's worth."""
    if isinstance(exc, ValidationError):
        return f"ValidationError: {validation_summary(exc)}"
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - an exception whose __str__ raises
        message = "<unprintable>"
    return f"{type(exc).__name__}: {message[:300]}"


def _decimal(text: Any) -> Decimal:
    if not isinstance(text, str) or len(text) > 2 * DECIMAL_MAX_DIGITS:
        raise _Malformed
    value = Decimal(text)
    if decimal_problem(value) is not None:
        raise _Malformed
    return value


def _text(kind: type[Any]) -> Callable[[Any], Any]:
    def parse(text: Any) -> Any:
        if not isinstance(text, str):
            raise _Malformed
        return kind.fromisoformat(text)

    return parse


def _uuid(value: Any) -> uuid.UUID:
    if not isinstance(value, dict) or set(value) != {"hex"} or not isinstance(value["hex"], str):
        raise _Malformed
    return uuid.UUID(hex=value["hex"])


def _utf8(text: Any) -> bytes:
    if not isinstance(text, str):
        raise _Malformed
    return text.encode("utf-8")


def _base64(text: Any) -> bytes:
    if not isinstance(text, str):
        raise _Malformed
    # validate=True: text that is not base64 is a malformed envelope, not b"" (the default
    # drops every character outside the alphabet).
    return base64.b64decode(text.encode("ascii"), validate=True)


#: Each scalar kind's reader: it raises on anything but the form its encoder writes.
_SCALAR_DECODERS: dict[str, Callable[[Any], Any]] = {
    "datetime": _text(datetime),
    "date": _text(date),
    "time": _text(time),
    "decimal": _decimal,
    "uuid": _uuid,
    "bytes": _utf8,
    "base64": _base64,
}

#: Every ``__type__`` name this version reads back.
KINDS = frozenset(_SCALAR_DECODERS) | {"pydantic", "dataclass"}


#: How an envelope's type key appears in any JSON text holding one.
_QUOTED_TYPE_KEY = json.dumps(TYPE_KEY)


def may_hold_envelope(text: str) -> bool:
    """Whether a value whose JSON is ``text`` may hold an envelope (its type key appears in
    it): when not, ``decode`` gives the value itself back."""
    return _QUOTED_TYPE_KEY in text


def envelope_kind(value: Any) -> str | None:
    """The kind of an envelope, or ``None`` for any other value."""
    if type(value) is dict and len(value) == 2 and value.keys() == _ENVELOPE_KEYS:
        kind = value[TYPE_KEY]
        if isinstance(kind, str) and kind in KINDS:
            return kind
    return None


def _scalar(kind: str, value: Any) -> Any:
    """A scalar envelope's value; ``_Malformed`` when it does not hold what its kind says."""
    try:
        return _SCALAR_DECODERS[kind](value)
    except _Malformed:
        raise
    except Exception:  # noqa: BLE001 - ValueError, binascii.Error, UnicodeEncodeError...
        raise _Malformed from None


def truthy(value: Any) -> bool:
    """Python's truth of the value an encoded value stands for (``Decimal("0")`` and ``b""``
    are false, as they are in Python), without rebuilding any class: a model or dataclass is
    true. For ``when`` conditions, which the tick evaluates on encoded values."""
    kind = envelope_kind(value)
    if kind is None or kind in ("pydantic", "dataclass"):
        return bool(value)
    try:
        return bool(_scalar(kind, value[VALUE_KEY]))
    except _Malformed:  # a malformed envelope is the non-empty dict it stays
        return True


def envelope_fields(value: Any) -> Any:
    """What a path reads inside an envelope: a model's data or a dataclass's fields (so
    ``$.input.order.total`` reads ``total`` of an encoded ``Order``); other values as they are."""
    kind = envelope_kind(value)
    if kind == "pydantic" and isinstance(value[VALUE_KEY], dict):
        return value[VALUE_KEY].get("data")
    if kind == "dataclass" and isinstance(value[VALUE_KEY], dict):
        return value[VALUE_KEY].get("fields")
    return value


class _Mode(enum.Enum):
    #: A declared class that does not rebuild raises ``ValueNotDecodable``.
    STRICT = enum.auto()
    #: It stays its envelope (readers: a run can always be shown).
    LENIENT = enum.auto()
    #: A model or dataclass envelope that does not rebuild (undeclared here, or its data does
    #: not validate) becomes its data, for a parameter whose annotation rebuilds it.
    AS_DATA = enum.auto()


def _decode_envelope(kind: str, envelope: dict[str, Any], mode: _Mode) -> Any:
    value = envelope[VALUE_KEY]
    try:
        if kind == "pydantic":
            return _decode_model(value)
        if kind == "dataclass":
            return _decode_dataclass(value, mode)
        return _scalar(kind, value)
    except _Malformed:
        if mode is _Mode.AS_DATA and kind in ("pydantic", "dataclass"):
            return _as_data(envelope)
        return envelope  # not what it claims to be: the plain dict it was sent as
    except ValueNotDecodable:
        if mode is _Mode.STRICT:
            raise
        return _as_data(envelope) if mode is _Mode.AS_DATA else envelope


def _as_data(envelope: dict[str, Any]) -> Any:
    data = envelope_fields(envelope)
    return envelope if data is envelope else _decode(data, _Mode.AS_DATA)


def _decode(value: Any, mode: _Mode) -> Any:
    kind = type(value)
    if kind is dict:
        envelope = envelope_kind(value)
        if envelope is not None:
            return _decode_envelope(envelope, value, mode)
        out: dict[Any, Any] | None = None
        for key, item in value.items():
            if type(item) is dict or type(item) is list:
                decoded = _decode(item, mode)
                if decoded is not item:
                    if out is None:
                        out = dict(value)
                    out[key] = decoded
        return value if out is None else out
    if kind is list:
        items: list[Any] | None = None
        for index, item in enumerate(value):
            if type(item) is dict or type(item) is list:
                decoded = _decode(item, mode)
                if decoded is not item:
                    if items is None:
                        items = list(value)
                    items[index] = decoded
        return value if items is None else items
    return value


def decode(value: Any) -> Any:
    """The Python value of encoded JSON: envelopes of the scalar kinds and of declared classes
    rebuilt; everything else as it is (the same objects when nothing inside is rebuilt),
    envelopes of undeclared classes and malformed envelopes included. Imports nothing.
    Raises ``ValueNotDecodable`` only for a declared class whose data does not rebuild."""
    return _decode(value, _Mode.STRICT)


def decode_lenient(value: Any) -> Any:
    """``decode`` for readers (run views, a step's context): never raises; an envelope that
    does not rebuild stays as its JSON, and so does a value that fails in any other way."""
    try:
        return _decode(value, _Mode.LENIENT)
    except REBUILD_ERRORS:  # RecursionError on a value nested past what was ever stored
        return value


def decode_as_data(value: Any) -> Any:
    """``decode``, but a model or dataclass that does not rebuild here becomes its data (a
    dict, decoded in turn): for a parameter whose annotation rebuilds it instead."""
    return _decode(value, _Mode.AS_DATA)
