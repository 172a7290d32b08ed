"""The runs list's query parameters, checked the way ``list_runs`` checks its arguments.

A problem is a ``BadRequest`` naming the parameter: the JSON API answers it with 400 and
``{"error": ...}``, the pages show it above the list.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from ..call_checks import check_list_filter
from ..engine.tags import tag_problem, tags_problem
from ..limits import MAX_LIST_LIMIT
from .timeparse import parse_time

#: The runs list's parameters, as ``GET /api/runs`` and ``GET /`` take them.
LIST_PARAMS = ("status", "workflow", "workflow_id", "since", "until", "limit", "cursor")
#: The repeatable tag filter, ``tag=key:value`` (docs/tags.md): every one must match.
TAG_PARAM = "tag"
DEFAULT_LIMIT = 50
_INT = re.compile(r"^[+-]?\d{1,9}$")


class BadRequest(ValueError):
    """A request the console refuses before doing anything: answered with 400."""


def _single(params: Mapping[str, Sequence[str]], name: str) -> str | None:
    values = params.get(name) or []
    if len(values) > 1:
        raise BadRequest(f"{name} is given {len(values)} times (give it once)")
    value = values[0] if values else ""
    return value if value != "" else None  # an empty form field means "any"


def list_query(
    params: Mapping[str, Sequence[str]], now: datetime, *, strict: bool
) -> dict[str, Any]:
    """The ``list_runs`` keyword arguments the query names, every one checked.

    ``strict`` (the JSON API): an unknown parameter is refused, so a typo never silently
    lists everything.
    """
    if strict:
        unknown = sorted(set(params) - {*LIST_PARAMS, TAG_PARAM})
        if unknown:
            known = ", ".join((*LIST_PARAMS, TAG_PARAM))
            raise BadRequest(f"unknown query parameter {unknown[0]!r} (known: {known})")
    found = {name: _single(params, name) for name in LIST_PARAMS}
    limit = DEFAULT_LIMIT
    if found["limit"] is not None:
        if not _INT.match(found["limit"]):
            raise BadRequest(
                f"limit must be an integer between 1 and {MAX_LIST_LIMIT}, "
                f"got {found['limit'][:40]!r}"
            )
        limit = int(found["limit"])
    kwargs: dict[str, Any] = {
        "status": found["status"],
        "workflow": found["workflow"],
        "workflow_id": found["workflow_id"],
        "limit": limit,
        "cursor": found["cursor"],
        "since": None,
        "until": None,
        "tags": tag_filter(params.get(TAG_PARAM) or []),
    }
    try:
        for bound in ("since", "until"):
            text = found[bound]
            if text is not None:
                kwargs[bound] = parse_time(text, bound, now)
        # The client's own checks, so the console refuses exactly what list_runs refuses.
        check_list_filter(
            kwargs["status"],
            kwargs["workflow"],
            limit,
            kwargs["since"],
            kwargs["until"],
            kwargs["cursor"],
            kwargs["workflow_id"],
        )
    except (ValueError, TypeError) as exc:
        raise BadRequest(str(exc)) from None
    return kwargs


def tag_filter(values: Sequence[str]) -> dict[str, str]:
    """``tag=key:value`` parameters as ``list_runs(tags=...)``: split on the first ``:`` (a
    value may hold more), empty ones ignored (an empty form field); BadRequest naming one
    without ``:``, a bad key or value, or a key given twice (no run could match both)."""
    found: dict[str, str] = {}
    for text in values:
        if text == "":
            continue
        key, colon, value = text.partition(":")
        if not colon:
            raise BadRequest(f"tag {text[:100]!r} is not key:value")
        if key in found:
            raise BadRequest(f"tag key {key[:100]!r} is given twice (a run has one value per key)")
        problem = tag_problem(key, value)
        if problem is not None:
            raise BadRequest(f"tag {text[:100]!r}: {problem}")
        found[key] = value
    problem = tags_problem(found, "tag filter")
    if problem is not None:
        raise BadRequest(problem)
    return found
