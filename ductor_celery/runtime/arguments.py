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

from ..values import (
    REBUILD_ERRORS,
    ValueNotDecodable,
    decode,
    decode_as_data,
    error_summary,
    validation_summary,
)

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


def prepare(
    fn: Callable[..., Any], step: str, args: Mapping[str, Any], *, plain: bool = False
) -> dict[str, Any]:
    """The keyword arguments to call ``fn`` with: decoded, then converted where annotated.
    Total: whatever an argument holds, it is converted or refused (``ArgumentRefused``);
    nothing a value's class does while it is rebuilt (SystemExit included) leaves here.
    ``plain``: the arguments hold no envelope (their JSON says so), so decoding them would
    give them back as they are, and is skipped."""
    converters = converters_for(fn)
    out: dict[str, Any] = {}
    for name, value in args.items():
        adapter = converters.get(name)
        try:
            out[name] = _argument(value, adapter, plain=plain)
        except ArgumentRefused as exc:
            raise ArgumentRefused(f"step {step!r} parameter {name!r}: {exc}") from None
        except REBUILD_ERRORS as exc:  # a validator of the user's own that raised
            raise ArgumentRefused(
                f"step {step!r} parameter {name!r}: converting it raised {error_summary(exc)}"
            ) from None
    return out


def _argument(value: Any, adapter: TypeAdapter[Any] | None, *, plain: bool = False) -> Any:
    if adapter is None:
        if plain:
            return value
        try:
            return decode(value)
        except ValueNotDecodable as exc:
            raise ArgumentRefused(str(exc)) from None
    # The annotation rebuilds what decoding does not: a model or dataclass envelope of a class
    # not declared here (written by a client where it lives elsewhere) arrives as its data.
    decoded = value if plain else decode_as_data(value)
    try:
        return adapter.validate_python(decoded)
    except ValidationError as exc:
        raise ArgumentRefused(
            f"the argument does not convert to {_type_name(adapter)}: {validation_summary(exc)}"
        ) from None


def _type_name(adapter: TypeAdapter[Any]) -> str:
    core = getattr(adapter, "_type", None)
    name = getattr(core, "__name__", None)
    return name if isinstance(name, str) else repr(core)
