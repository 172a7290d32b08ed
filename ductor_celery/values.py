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

Encoding happens where a value enters ductor (``engine.payloads.check_json``: a run's input,
a signal's payload, a step's result, context patch and heartbeat details, a definition's
literals); what is stored, resolved by paths and measured against the size limit is the
encoded JSON. Decoding happens where a value leaves for user code: a step's arguments,
``ctx.input``, ``ctx.context``, and ``RunView``/``NodeView``.

Encoding is idempotent (an encoded value is plain JSON and encodes to itself), so every layer
may check a value again without knowing whether it was checked before. The price: a plain
dict shaped exactly like an envelope (the two keys ``__type__`` and ``__value__``, with one of
the names above) reads back as that type, as it does in kombu. Any other dict, ``__type__``
key or not, reads back as itself.

Models and dataclasses are rebuilt from their import path: the class must be importable by
``module:qualname`` (not defined inside a function), and is checked to be that kind of class
before it is called.
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import json
import uuid
from collections.abc import Callable
from datetime import date, datetime, time
from decimal import Decimal
from typing import Any

from pydantic import BaseModel

TYPE_KEY = "__type__"
VALUE_KEY = "__value__"
_ENVELOPE_KEYS = frozenset((TYPE_KEY, VALUE_KEY))


class ValueNotEncodable(TypeError):
    """A value of a type the encoding has no form for, or a class it could not rebuild."""


class ValueNotDecodable(ValueError):
    """An envelope whose value cannot be rebuilt here (its class is not importable, its data
    does not validate)."""


def _envelope(kind: str, value: Any) -> dict[str, Any]:
    return {TYPE_KEY: kind, VALUE_KEY: value}


# -- encoding ------------------------------------------------------------------------------------


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
    Decimal: lambda v: _envelope("decimal", str(v)),
    uuid.UUID: lambda v: _envelope("uuid", {"hex": v.hex}),
    bytes: _encode_bytes,
}

_class_paths: dict[type, str] = {}


def class_path(cls: type) -> str:
    """``module:qualname`` of a class that can be imported back by it (cached per class)."""
    path = _class_paths.get(cls)
    if path is not None:
        return path
    module, qualname = cls.__module__, cls.__qualname__
    if "<locals>" in qualname:
        raise ValueNotEncodable(
            f"{qualname} is defined inside a function: ductor rebuilds a model or dataclass "
            "by its import path, so define it at module level"
        )
    try:
        found = _import_class(module, qualname)
    except ValueNotDecodable as exc:
        raise ValueNotEncodable(str(exc)) from None
    if found is not cls:
        raise ValueNotEncodable(
            f"{module}:{qualname} does not import back as the class itself; ductor rebuilds a "
            "model or dataclass by its import path"
        )
    path = f"{module}:{qualname}"
    _class_paths[cls] = path
    return path


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


def _import_class(module: str, qualname: str) -> Any:
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception as exc:  # noqa: BLE001 - ImportError, AttributeError, an import's own error
        raise ValueNotDecodable(
            f"class {module}:{qualname} cannot be imported here ({type(exc).__name__}: {exc})"
        ) from None
    return found


def _class_of(path: Any, kind: str, fits: Callable[[Any], bool]) -> Any:
    if not isinstance(path, str) or ":" not in path:
        raise ValueNotDecodable(f"a {kind} envelope without a 'module:Class' path")
    module, qualname = path.split(":", 1)
    cls = _import_class(module, qualname)
    if not (isinstance(cls, type) and fits(cls)):
        raise ValueNotDecodable(f"{path} is not a {kind} class")
    return cls


def _decode_model(value: Any) -> Any:
    if not isinstance(value, dict):
        raise ValueNotDecodable("a pydantic envelope without its class and data")
    cls = _class_of(value.get("class"), "pydantic model", lambda c: issubclass(c, BaseModel))
    try:
        # The JSON validator, as the data is ``model_dump(mode="json")``: it reads ISO dates,
        # base64 and the like back even in strict models.
        return cls.model_validate_json(json.dumps(value.get("data")))
    except Exception as exc:  # noqa: BLE001 - a ValidationError, or the model's own validator
        raise ValueNotDecodable(
            f"{value['class']}: the stored data does not validate: {exc}"
        ) from None


#: What ``_decode`` does with an envelope it cannot rebuild: ``None`` raises.
_Fallback = Callable[[dict[str, Any]], Any] | None


def _decode_dataclass(value: Any, lenient: _Fallback) -> Any:
    if not isinstance(value, dict) or not isinstance(value.get("fields"), dict):
        raise ValueNotDecodable("a dataclass envelope without its class and fields")
    cls = _class_of(value.get("class"), "dataclass", dataclasses.is_dataclass)
    fields = {k: _decode(v, lenient) for k, v in value["fields"].items()}
    init = {f.name for f in dataclasses.fields(cls) if f.init}
    try:
        obj = cls(**{k: v for k, v in fields.items() if k in init})
        for name, field_value in fields.items():
            if name not in init:
                object.__setattr__(obj, name, field_value)
    except Exception as exc:  # noqa: BLE001 - the dataclass's own __init__/__post_init__
        raise ValueNotDecodable(
            f"{value['class']}: rebuilding it raised {type(exc).__name__}: {exc}"
        ) from None
    return obj


_SCALAR_DECODERS: dict[str, Callable[[Any], Any]] = {
    "datetime": datetime.fromisoformat,
    "date": date.fromisoformat,
    "time": time.fromisoformat,
    "decimal": Decimal,
    "uuid": lambda v: uuid.UUID(hex=v["hex"]),
    "bytes": lambda v: v.encode("utf-8"),
    "base64": lambda v: base64.b64decode(v.encode("ascii")),
}

#: Every ``__type__`` name this version reads back.
KINDS = frozenset(_SCALAR_DECODERS) | {"pydantic", "dataclass"}


def envelope_kind(value: Any) -> str | None:
    """The kind of an envelope, or ``None`` for any other value."""
    if type(value) is dict and len(value) == 2 and value.keys() == _ENVELOPE_KEYS:
        kind = value[TYPE_KEY]
        if isinstance(kind, str) and kind in KINDS:
            return kind
    return None


def truthy(value: Any) -> bool:
    """Python's truth of the value an encoded value stands for (``Decimal("0")`` and ``b""``
    are false, as they are in Python), without importing any class: a model or dataclass is
    true. For ``when`` conditions, which the tick evaluates on encoded values."""
    kind = envelope_kind(value)
    if kind is None or kind in ("pydantic", "dataclass"):
        return bool(value)
    try:
        return bool(_SCALAR_DECODERS[kind](value[VALUE_KEY]))
    except Exception:  # noqa: BLE001 - a malformed envelope is a non-empty object
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


def _decode_envelope(kind: str, value: Any, lenient: _Fallback) -> Any:
    if kind == "pydantic":
        return _decode_model(value)
    if kind == "dataclass":
        return _decode_dataclass(value, lenient)
    try:
        return _SCALAR_DECODERS[kind](value)
    except Exception as exc:  # noqa: BLE001 - malformed text in a stored envelope
        raise ValueNotDecodable(f"a {kind} envelope holding {value!r:.100}: {exc}") from None


def _decode(value: Any, lenient: _Fallback) -> Any:
    kind = type(value)
    if kind is dict:
        envelope = envelope_kind(value)
        if envelope is not None:
            try:
                return _decode_envelope(envelope, value[VALUE_KEY], lenient)
            except ValueNotDecodable:
                if lenient is None:
                    raise
                return lenient(value)
        out: dict[Any, Any] | None = None
        for key, item in value.items():
            if type(item) is dict or type(item) is list:
                decoded = _decode(item, lenient)
                if decoded is not item:
                    if out is None:
                        out = dict(value)
                    out[key] = decoded
        return value if out is None else out
    if kind is list:
        items: list[Any] | None = None
        for index, item in enumerate(value):
            if type(item) is dict or type(item) is list:
                decoded = _decode(item, lenient)
                if decoded is not item:
                    if items is None:
                        items = list(value)
                    items[index] = decoded
        return value if items is None else items
    return value


def decode(value: Any) -> Any:
    """The Python value of encoded JSON: envelopes rebuilt, everything else as it is (the same
    objects when nothing inside is an envelope). Raises ``ValueNotDecodable``."""
    return _decode(value, None)


def decode_lenient(value: Any) -> Any:
    """``decode`` for readers (run views): an envelope that cannot be rebuilt in this process
    (its class is not importable here) stays as its JSON instead of failing the read."""
    return _decode(value, _as_is)


def decode_as_data(value: Any) -> Any:
    """``decode``, but a model or dataclass that cannot be rebuilt here becomes its data (a
    dict, decoded in turn): for a parameter whose annotation rebuilds it instead."""
    return _decode(value, _its_data)


def _as_is(envelope: dict[str, Any]) -> Any:
    return envelope


def _its_data(envelope: dict[str, Any]) -> Any:
    data = envelope_fields(envelope)
    if data is envelope:  # a scalar envelope that does not parse: nothing to fall back on
        raise ValueNotDecodable(f"a {envelope[TYPE_KEY]} envelope that cannot be read")
    return _decode(data, _its_data)
