"""The console's actions: each one a call of the facade, the same call the CLI makes.

``run_action(ductor, run_id, action, body)`` checks the body's shape (a JSON object with the
action's keys only), then calls ``Ductor.pause`` / ``approve`` / ``signal`` ...; every check of
the values themselves, and of the run's state, is the client's own, so an action the run does
not allow raises the same ``InvalidOperation`` as ``ductor pause``.
"""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..limits import MAX_JSON_DEPTH
from .params import BadRequest

if TYPE_CHECKING:
    from ..ductor import Ductor

#: Each action's body keys: (required, optional).
ACTION_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "pause": ((), ("reason",)),
    "resume": ((), ()),
    "cancel": ((), ("reason",)),
    "terminate": ((), ("reason",)),
    "redrive": ((), ("from_node", "input")),
    "approve": (("node",), ("by", "comment")),
    "reject": (("node",), ("by", "comment")),
    "signal": (("name",), ("payload", "idempotency_key")),
}
ACTIONS = tuple(ACTION_KEYS)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (JSON has no NaN or Infinity)")


def _json_int(digits: str) -> int:
    limit = sys.get_int_max_str_digits()
    if limit and len(digits.lstrip("-")) > limit:
        raise ValueError(f"an integer of {len(digits.lstrip('-'))} digits (at most {limit})")
    return int(digits)


def _depth(value: Any) -> int:
    """How deeply lists and dicts nest in ``value`` (iteratively: no recursion limit)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            todo.extend((v, level + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_json(text: str, what: str) -> Any:
    """Strict JSON (no NaN or Infinity, no integer too long to read, at most MAX_JSON_DEPTH
    levels); BadRequest naming ``what`` otherwise."""
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_int=_json_int)
    except RecursionError:
        raise BadRequest(f"{what} is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except ValueError as exc:
        first = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        raise BadRequest(f"{what} is not valid JSON: {first}") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise BadRequest(f"{what} is nested too deeply (at most {MAX_JSON_DEPTH} levels)")
    return value


def check_body(action: str, body: Any) -> dict[str, Any]:
    """The body as the action's keyword arguments; BadRequest for a wrong shape."""
    if action not in ACTION_KEYS:
        raise BadRequest(f"unknown action {action!r} (one of: {', '.join(ACTIONS)})")
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise BadRequest(f"the body of {action} must be a JSON object, got {type(body).__name__}")
    required, optional = ACTION_KEYS[action]
    unknown = sorted(set(body) - set(required) - set(optional))
    if unknown:
        allowed = ", ".join((*required, *optional)) or "none"
        raise BadRequest(f"{action} takes no key {unknown[0]!r} (keys: {allowed})")
    for key in required:
        if body.get(key) in (None, ""):
            raise BadRequest(f"{action} needs {key!r}")
    return dict(body)


def _optional(body: Mapping[str, Any], *keys: str) -> dict[str, Any]:
    return {k: body[k] for k in keys if body.get(k) is not None}


def _redrive(d: Ductor, run_id: str, body: Mapping[str, Any]) -> None:
    extra = _optional(body, "from_node", "input")
    accepted = inspect.signature(d.redrive).parameters
    missing = [k for k in extra if k not in accepted]
    if missing:
        raise BadRequest(f"this ductor cannot redrive with {missing[0]!r}")
    d.redrive(run_id, **extra)


CALLS: dict[str, Callable[[Ductor, str, Mapping[str, Any]], Any]] = {
    "pause": lambda d, r, b: d.pause(r, reason=b.get("reason")),
    "resume": lambda d, r, b: d.resume(r),
    "cancel": lambda d, r, b: d.cancel(r, reason=b.get("reason")),
    "terminate": lambda d, r, b: d.terminate(r, reason=b.get("reason")),
    "redrive": _redrive,
    "approve": lambda d, r, b: d.approve(r, b["node"], by=b.get("by"), comment=b.get("comment")),
    "reject": lambda d, r, b: d.reject(r, b["node"], by=b.get("by"), comment=b.get("comment")),
    "signal": lambda d, r, b: d.signal(
        r, b["name"], b.get("payload"), idempotency_key=b.get("idempotency_key")
    ),
}


def run_action(d: Ductor, run_id: str, action: str, body: Any) -> None:
    """Check the body's shape, then make the action's client call (which raises ductor's own
    errors: InvalidOperation, RunNotFound, PayloadTooLarge ...)."""
    CALLS[action](d, run_id, check_body(action, body))
