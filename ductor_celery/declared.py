"""The declared classes: every pydantic model and dataclass this process may rebuild a value
into, by the path its envelopes name (``module:Qual.Name``, ``values.class_path``).

Data never chooses code. Only the app's code adds to this registry: ``register_type``
(``Ductor.register_type``), and the parameter and return annotations of its registered steps
(``declare_annotations``); the classes their fields name come with them. Nothing is ever
imported because a value names it: ``values`` decoding asks ``declared(path)``, and an envelope
of a class not found here stays the plain dict it was sent as.
"""

from __future__ import annotations

import dataclasses
import threading
import typing
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

#: Every model and dataclass this process may rebuild, by the path its envelopes name
#: (``module:Qual.Name``). Only the app's code adds to it (``register_type``, and the annotations
#: of its registered steps); data never does, and nothing is imported to fill it.
_declared: dict[str, type] = {}
_declared_lock = threading.Lock()


def _carried(cls: Any) -> bool:
    """Whether ``cls`` is a class values may carry as an envelope (a model or a dataclass)."""
    return isinstance(cls, type) and (issubclass(cls, BaseModel) or dataclasses.is_dataclass(cls))


def register_type(cls: type) -> None:
    """Declare a pydantic model or dataclass that values may carry: an envelope naming it is
    rebuilt into it. The classes its fields are annotated with are declared with it (a
    ``Shipment`` field ``to: Point`` declares ``Point``): the app wrote those names, not data.
    Raises ``TypeError`` for anything else."""
    if not _carried(cls):
        raise TypeError(
            f"register_type() takes a pydantic model or dataclass class, got {cls!r:.200}"
        )
    _declare(_classes_in(cls))


def declare_annotations(fn: Callable[..., Any]) -> None:
    """Declare the models and dataclasses named in ``fn``'s parameter and return annotations
    (``order: Order``, ``-> list[Receipt]``, ``Optional[Point]``...), and those of their fields.
    Annotations that cannot be resolved declare nothing (the step's arguments then are not
    converted either; ``runtime.arguments`` logs it)."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - a forward reference that does not resolve
        hints = getattr(fn, "__annotations__", None) or {}
        if not isinstance(hints, dict):
            return
    found: dict[str, type] = {}
    for hint in hints.values():
        if not isinstance(hint, str):
            found.update(_classes_in(hint))
    _declare(found)


def declared(path: str) -> type | None:
    """The class declared under ``path``, or ``None``."""
    return _declared.get(path)


def _declare(classes: dict[str, type]) -> None:
    if classes:
        with _declared_lock:
            _declared.update(classes)


def _classes_in(annotation: Any) -> dict[str, type]:
    """Every model and dataclass an annotation names, with those their fields name, by path."""
    found: dict[str, type] = {}
    seen: set[int] = set()
    todo = [annotation]
    while todo:
        hint = todo.pop()
        if id(hint) in seen or len(seen) > 10_000:
            continue
        seen.add(id(hint))
        todo.extend(a for a in typing.get_args(hint) if not isinstance(a, str))
        if not _carried(hint):
            continue
        found[f"{hint.__module__}:{hint.__qualname__}"] = hint
        todo.extend(_field_annotations(hint))
    return found


def _field_annotations(cls: type) -> list[Any]:
    if issubclass(cls, BaseModel):
        return [f.annotation for f in cls.model_fields.values() if f.annotation is not None]
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - a forward reference that does not resolve
        hints = {f.name: f.type for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return [h for h in hints.values() if not isinstance(h, str)]
