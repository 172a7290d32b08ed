"""A step's arguments on their way into the call: decoded from their stored form, and each
annotated parameter validated and converted by pydantic (an ``order: Order`` parameter gets an
``Order``, a ``when: datetime`` parameter an ISO string's datetime).

The step function's signature is read once per function (``converters_for``), not per call.
Parameters without an annotation, or annotated ``Any`` or ``object``, get the decoded value as
it is. A value that does not convert is ``ArgumentRefused``: the attempt fails without retry
(the same arguments would fail the same way again) with a message naming the parameter and
never quoting the value (it may be a secret).
"""

from __future__ import annotations

import inspect
import logging
import threading
import typing
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import TypeAdapter, ValidationError

from ..values import ValueNotDecodable, decode, decode_as_data

log = logging.getLogger("ductor_celery.step")

Converters = Mapping[str, TypeAdapter[Any]]

_cache: dict[Callable[..., Any], Converters] = {}
_cache_lock = threading.Lock()

#: Annotations that ask for no conversion.
_AS_IS: tuple[Any, ...] = (Any, object, inspect.Parameter.empty)


class ArgumentRefused(Exception):
    """An argument that cannot be decoded or converted to its parameter's annotation."""


def converters_for(fn: Callable[..., Any]) -> Converters:
    """The pydantic adapter of each annotated keyword parameter of ``fn`` (its first
    parameter, the ``StepContext``, excluded), built once per function (a callable object
    that cannot be hashed, built per call)."""
    try:
        hash(fn)
    except TypeError:
        return _build(fn)
    found = _cache.get(fn)
    if found is None:
        with _cache_lock:
            found = _cache.get(fn)
            if found is None:
                found = _cache[fn] = _build(fn)
    return found


def _build(fn: Callable[..., Any]) -> Converters:
    try:
        params = list(inspect.signature(fn).parameters.values())[1:]
    except (TypeError, ValueError):
        return {}
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as exc:  # noqa: BLE001 - a forward reference that does not resolve
        log.warning(
            "step %r: its annotations cannot be resolved (%s); arguments are not converted",
            getattr(fn, "__qualname__", fn),
            exc,
        )
        return {}
    adapters: dict[str, TypeAdapter[Any]] = {}
    for param in params:
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        hint = hints.get(param.name, inspect.Parameter.empty)
        if any(hint is as_is for as_is in _AS_IS):
            continue
        try:
            adapters[param.name] = TypeAdapter(hint)
        except Exception as exc:  # noqa: BLE001 - a type pydantic has no schema for
            log.warning(
                "step %r: parameter %r annotated %r cannot be validated by pydantic (%s); "
                "its argument is passed as it is",
                getattr(fn, "__qualname__", fn),
                param.name,
                hint,
                exc,
            )
    return adapters


def prepare(fn: Callable[..., Any], step: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments to call ``fn`` with: decoded, then converted where annotated."""
    converters = converters_for(fn)
    out: dict[str, Any] = {}
    for name, value in args.items():
        adapter = converters.get(name)
        try:
            decoded = decode(value)
        except ValueNotDecodable as exc:
            if adapter is None:
                raise ArgumentRefused(f"step {step!r} parameter {name!r}: {exc}") from None
            # The annotation rebuilds it: a model whose stored path does not import here
            # (moved, or defined elsewhere in the client) still validates from its data.
            try:
                decoded = decode_as_data(value)
            except ValueNotDecodable:
                raise ArgumentRefused(f"step {step!r} parameter {name!r}: {exc}") from None
        if adapter is not None:
            try:
                decoded = adapter.validate_python(decoded)
            except ValidationError as exc:
                raise ArgumentRefused(
                    f"step {step!r} parameter {name!r}: the argument does not convert to "
                    f"{_type_name(adapter)}: {_summary(exc)}"
                ) from None
        out[name] = decoded
    return out


def _type_name(adapter: TypeAdapter[Any]) -> str:
    core = getattr(adapter, "_type", None)
    name = getattr(core, "__name__", None)
    return name if isinstance(name, str) else repr(core)


def _summary(exc: ValidationError) -> str:
    """pydantic's errors without the input values (an argument may hold a secret)."""
    parts = []
    for error in exc.errors(include_url=False, include_input=False, include_context=False):
        where = ".".join(str(p) for p in error.get("loc", ())) or "value"
        parts.append(f"{where}: {error.get('msg', 'invalid')}")
    shown = "; ".join(parts[:5])
    return shown + (f" (and {len(parts) - 5} more)" if len(parts) > 5 else "")
