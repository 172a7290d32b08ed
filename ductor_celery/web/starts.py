"""``POST /api/workflows/{name}/runs``: start a run over HTTP, with an operator's token.

The body is a JSON object with any of ``START_KEYS``; an ``Idempotency-Key`` header makes the
start happen once per key and workflow (``Client.start_request``: the run and the key's
``eec_start_request`` row commit together), so a repeat, finished run or not, returns the run
the key started. Every check of the values is the client's own, as ``ductor start`` makes them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..call_checks import check_id
from ..engine.kinds import AuditSource
from ..store.audit import acting_as
from ..store.db import retry_deadline
from ..store.start_requests import RequestKey
from ..views import RunHandle
from .console import REQUEST_RETRY_S
from .params import BadRequest

if TYPE_CHECKING:
    from ..ductor import Ductor

#: The body's keys, each optional.
START_KEYS = ("input", "workflow_id", "delay", "priority", "tags")
IDEMPOTENCY_HEADER = "Idempotency-Key"


def check_start_body(body: Any) -> dict[str, Any]:
    """The body's values by key (absent and ``null`` alike left out); BadRequest for a body
    that is no JSON object or has another key."""
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise BadRequest(f"the body of a start must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(START_KEYS))
    if unknown:
        raise BadRequest(f"a start takes no key {unknown[0]!r} (keys: {', '.join(START_KEYS)})")
    return {k: v for k, v in body.items() if v is not None}


def idempotency_key(value: str | None) -> str | None:
    """The ``Idempotency-Key`` header's value, checked as an id (1..200 characters, no NUL:
    a ValueError naming the header otherwise, a 400)."""
    return None if value is None else check_id(value, IDEMPOTENCY_HEADER)


def start_run(
    d: Ductor, workflow: str, body: Any, key: str | None, actor: str | None
) -> tuple[RunHandle, bool]:
    """Start ``workflow`` as the body says, as ``actor`` (the token's name; audit source
    ``web``). Returns (handle, created): not created when the key started a run before, or an
    open run of the workflow id was there (the start returned it, as ``start()`` does). A bad
    ``priority`` (not an integer 0..9) is the client's ValueError, a 400. A database that
    cannot be reached within ``REQUEST_RETRY_S`` is ``StoreUnavailable``, a 503."""
    values = check_start_body(body)
    request = RequestKey.api(workflow, key) if key is not None else None
    with acting_as(AuditSource.WEB), retry_deadline(REQUEST_RETRY_S):
        return d.client.start_request(
            request,
            workflow,
            values.get("input"),
            values.get("workflow_id"),
            delay=values.get("delay"),
            by=actor,
            priority=values.get("priority"),
            tags=values.get("tags"),
        )
