"""The console's actions: each one a call of the facade, the same call the CLI makes.

``run_action(ductor, run_id, action, body, actor)`` checks the body's shape (a JSON object
with the action's keys only), then calls ``Ductor.pause`` / ``approve`` / ``signal`` ... with
the acting token's name (``actor_kwargs``); every check of the values themselves, and of the
run's state, is the client's own, so an action the run does not allow raises the same
``InvalidOperation`` as ``ductor pause``. ``ACTION_ROLES`` says which role each action needs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..engine.kinds import AuditSource
from ..payloads import JsonTextError, loads_strict
from ..store.audit import acting_as
from .params import BadRequest
from .tokens import Role

if TYPE_CHECKING:
    from ..ductor import Ductor

#: Each action's body keys: (required, optional). ``by`` of approve/reject is still accepted,
#: for scripts written before named tokens, and ignored: who acts is the token's name.
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
#: The least role each action needs: every run action is an operator's. The admin's own ones
#: (bulk controls, schedules, prune) go here, with Role.ADMIN, when the console offers them.
ACTION_ROLES: dict[str, Role] = dict.fromkeys(ACTIONS, Role.OPERATOR)


def parse_json(text: str, what: str) -> Any:
    """Strict JSON (payloads.loads_strict); BadRequest naming ``what`` otherwise."""
    try:
        return loads_strict(text, what)
    except JsonTextError as exc:
        raise BadRequest(str(exc)) from None


def json_body(raw: bytes) -> Any:
    """A request's JSON body (``None`` when empty), read strictly; BadRequest otherwise."""
    if not raw.strip():
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("the body is not UTF-8 text") from None
    return parse_json(text, "the body")


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


def actor_kwargs(action: str, actor: str | None) -> dict[str, Any]:
    """Who acts, as keyword arguments of the action's Ductor call (every call in ``CALLS``
    receives them): the acting token's name as ``by=``, the actor of its audit entry."""
    return {"by": actor}


def _redrive(d: Ductor, run_id: str, body: Mapping[str, Any], who: dict[str, Any]) -> None:
    extra = _optional(body, "from_node", "input")
    accepted = inspect.signature(d.redrive).parameters
    missing = [k for k in extra if k not in accepted]
    if missing:
        raise BadRequest(f"this ductor cannot redrive with {missing[0]!r}")
    d.redrive(run_id, **extra, **who)


#: Each action's Ductor call: (ductor, run id, checked body, actor_kwargs) -> anything.
CALLS: dict[str, Callable[[Ductor, str, Mapping[str, Any], dict[str, Any]], Any]] = {
    "pause": lambda d, r, b, who: d.pause(r, reason=b.get("reason"), **who),
    "resume": lambda d, r, b, who: d.resume(r, **who),
    "cancel": lambda d, r, b, who: d.cancel(r, reason=b.get("reason"), **who),
    "terminate": lambda d, r, b, who: d.terminate(r, reason=b.get("reason"), **who),
    "redrive": _redrive,
    "approve": lambda d, r, b, who: d.approve(r, b["node"], comment=b.get("comment"), **who),
    "reject": lambda d, r, b, who: d.reject(r, b["node"], comment=b.get("comment"), **who),
    "signal": lambda d, r, b, who: d.signal(
        r, b["name"], b.get("payload"), idempotency_key=b.get("idempotency_key"), **who
    ),
}


def run_action(d: Ductor, run_id: str, action: str, body: Any, actor: str | None) -> None:
    """Check the body's shape, then make the action's client call as ``actor`` (the acting
    token's name), which raises ductor's own errors: InvalidOperation, RunNotFound,
    PayloadTooLarge ..."""
    checked = check_body(action, body)
    with acting_as(AuditSource.WEB):  # the audit log's source of what this request does
        CALLS[action](d, run_id, checked, actor_kwargs(action, actor))
