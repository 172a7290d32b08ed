"""The checks of the public calls' arguments (start, controls, list_runs, wait...): each
refuses bad input with an error that names it, before anything is read or written. The
client, the console and the command line call the same ones."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

from . import limits
from .definition.blobrefs import reserved_key_problem
from .engine.kinds import CONTROL_ALLOWED, AuditAction, ControlKind, statuses_allowing
from .engine.status import RunStatus
from .errors import InvalidOperation, PayloadNotSerializable, PayloadTooLarge
from .payloads import check_json
from .store import audit, runs


def check_control(run_id: str, status: RunStatus, kind: ControlKind) -> None:
    """Refuse a control the run's status does not allow (``CONTROL_ALLOWED``, the table the
    coordinator applies controls by), saying in which statuses it is allowed."""
    if kind in CONTROL_ALLOWED[status]:
        return
    allowed = sorted(statuses_allowing(kind))
    raise InvalidOperation(
        f"cannot {kind.replace('_', '-')} run {run_id}: it is {status.value} "
        f"(allowed when {', '.join(s.value for s in allowed)})"
    )


def check_version(version: Any, also: str = "") -> int:
    """A workflow version number: an int >= 1 (TypeError / ValueError otherwise)."""
    alternatives = f" or {also}" if also else ""
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"version must be an integer{alternatives}, got {limits.show(version)}")
    if not 1 <= version <= limits.MAX_INT:
        raise ValueError(
            f"version must be between 1 and {limits.MAX_INT}{alternatives}, got {version}"
        )
    return version


def check_payload(value: Any, what: str, limit: int) -> Any:
    """Refuse a payload that cannot be stored exactly or is over the limit, naming it; return
    it as JSON. A value from a caller may not use the key of references to large values."""
    checked = check_json(value, what, limit, door=reserved_key_problem)
    if checked.problem is None:
        return checked.value
    if checked.too_large:
        raise PayloadTooLarge(checked.problem)
    raise PayloadNotSerializable(checked.problem)


def check_id(value: Any, what: str) -> str:
    """An identifier (workflow id, name, node, signal name, key): a str (TypeError otherwise)
    of 1..MAX_ID_LENGTH characters without NUL (ValueError otherwise), as the columns hold."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, got {type(value).__name__}")
    problem = limits.id_problem(value)
    if problem is not None:
        raise ValueError(f"{what} {problem}")
    return value


def check_target(target: Any) -> str:
    """A run id or workflow id."""
    return check_id(target, "target")


def check_text(
    value: Any, what: str, limit: int, setting: str = "ductor_max_payload_bytes"
) -> str | None:
    """Free text (a reason, a comment): ``None`` or a str without NUL or lone surrogates, of
    at most ``limit`` UTF-8 bytes (PayloadTooLarge naming ``setting`` otherwise)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string or None, got {type(value).__name__}")
    if "\x00" in value:
        raise ValueError(f"{what} must not contain NUL characters")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(
            f"{what} must not contain lone surrogates (it is not valid Unicode)"
        ) from None
    if size > limit:
        raise PayloadTooLarge(f"{what} is {size} bytes, over {setting}={limit}")
    return value


def check_timeout(timeout: Any) -> float | None:
    """``wait()``'s timeout: ``None`` (forever) or a finite number of seconds >= 0."""
    if timeout is None:
        return None
    if not limits.is_number(timeout):
        raise TypeError(
            f"timeout must be a number of seconds or None, got {type(timeout).__name__}"
        )
    try:
        seconds = float(timeout)  # an int too large for a float raises OverflowError
    except OverflowError:
        seconds = math.inf
    if not math.isfinite(seconds) or timeout < 0:
        raise ValueError(
            f"timeout must be a finite number of seconds >= 0, got {limits.show(timeout)} "
            "(use None to wait forever)"
        )
    return seconds


def check_list_args(status: Any, workflow: Any, limit: Any) -> str | None:
    """``list_runs``' filters; returns the status as its value."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be an integer, got {type(limit).__name__}")
    if not 1 <= limit <= limits.MAX_LIST_LIMIT:
        raise ValueError(f"limit must be between 1 and {limits.MAX_LIST_LIMIT}, got {limit}")
    if workflow is not None:
        check_id(workflow, "workflow")
    if status is None:
        return None
    if not isinstance(status, str):
        raise TypeError(f"status must be a string or None, got {type(status).__name__}")
    try:
        return RunStatus(status).value
    except ValueError:
        known = ", ".join(s.value for s in RunStatus)
        raise ValueError(f"unknown run status {status!r} (one of: {known})") from None


def check_time(value: Any, what: str) -> datetime | None:
    """A bound of ``list_runs``: ``None``, an aware datetime, or an ISO 8601 string with
    its offset (``2026-01-02T03:04:05Z``); a time without a zone is refused, not guessed."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(
                f"{what} {limits.show(value)} is not an ISO 8601 time (2026-01-02T03:04:05Z)"
            ) from None
    if not isinstance(value, datetime):
        raise TypeError(
            f"{what} must be a datetime or an ISO 8601 string, got {type(value).__name__}"
        )
    return check_aware(value, what)


def check_aware(value: datetime, what: str) -> datetime:
    """An aware datetime that is a time in UTC too, returned in UTC; ValueError naming
    ``what`` for a naive one or one past either end of the calendar in UTC
    (``0001-01-01T00:00+14:00``), which no database comparison could use."""
    problem = limits.time_problem(value)
    if problem is not None:
        raise ValueError(f"{what} {problem}")
    utc = limits.in_utc(value)
    assert utc is not None
    return utc


def check_list_filter(
    status: Any,
    workflow: Any,
    limit: Any,
    since: Any,
    until: Any,
    cursor: Any,
    workflow_id: Any,
) -> tuple[runs.RunFilter, runs.RunKey | None]:
    """Every argument of ``list_runs``, checked before any query: the filter and the key
    to continue after."""
    status_value = check_list_args(status, workflow, limit)
    if workflow_id is not None:
        check_id(workflow_id, "workflow_id")
    start, end = check_time(since, "since"), check_time(until, "until")
    if start is not None and end is not None and start > end:
        raise ValueError(f"since ({start.isoformat()}) is after until ({end.isoformat()})")
    after = None
    if cursor is not None:
        if not isinstance(cursor, str):
            raise TypeError(f"cursor must be a string or None, got {type(cursor).__name__}")
        after = runs.decode_cursor(cursor)
    where = runs.RunFilter(
        status=status_value, workflow=workflow, workflow_id=workflow_id, since=start, until=end
    )
    return where, after


def check_start_time(delay: Any, start_at: Any) -> None:
    """``start``'s delayed start: ``delay`` (finite seconds >= 0) or ``start_at`` (an aware
    datetime), not both."""
    if delay is not None and start_at is not None:
        raise ValueError("give delay= or start_at=, not both")
    if delay is not None:
        problem = limits.duration_problem(delay, allow_zero=True)
        if problem is not None:
            if not limits.is_number(delay):
                raise TypeError(f"delay {problem}")
            raise ValueError(f"delay {problem}")
    if start_at is not None:
        if not isinstance(start_at, datetime):
            raise TypeError(f"start_at must be a datetime, got {type(start_at).__name__}")
        if start_at.tzinfo is None or start_at.utcoffset() is None:
            raise ValueError(
                "start_at must be an aware datetime (with a time zone), got a naive one: "
                "use e.g. datetime(..., tzinfo=UTC)"
            )
        check_aware(start_at, "start_at")


def check_start_window(start_at: datetime, now: datetime) -> None:
    """``start_at`` at most ten years ahead of ``now`` (the database's clock), like
    ``delay``, and at most ten years behind it (a past time starts the run at once; one from
    another decade is a mistake, and a stored year 1 would not read back in every zone)."""
    ahead = (start_at - now).total_seconds()
    if ahead > limits.MAX_DURATION_S:
        raise ValueError(
            f"start_at must be at most ten years ({limits.MAX_DURATION_S:.0f} s) ahead, like "
            f"delay; got {start_at.isoformat()}, {ahead:.0f} s after now ({now.isoformat()})"
        )
    if -ahead > limits.MAX_DURATION_S:
        raise ValueError(
            f"start_at must be at most ten years ({limits.MAX_DURATION_S:.0f} s) in the past; "
            f"got {start_at.isoformat()} (now is {now.isoformat()})"
        )


def check_deadline(deadline: Any) -> None:
    """``start``'s ``deadline``: seconds from the run's start, positive and finite (zero or
    less would be a deadline in the past: the run would time out before it began)."""
    if deadline is None:
        return
    problem = limits.duration_problem(deadline)
    if problem is None:
        return
    if not limits.is_number(deadline):
        raise TypeError(f"deadline {problem}")
    if deadline <= 0:
        raise ValueError(
            f"deadline must be a positive number of seconds from the run's start, got "
            f"{deadline!r}: that deadline is in the past"
        )
    raise ValueError(f"deadline {problem}")


def check_audit_filter(
    actor: Any, action: Any, since: Any, limit: Any, cursor: Any
) -> tuple[audit.AuditFilter, int | None]:
    """Every argument of ``audit()`` but its target, checked before any query: the filter and
    the entry id to continue before."""
    if actor is not None:
        check_id(actor, "actor")
    if action is not None:
        check_id(action, "action")
        if action not in {a.value for a in AuditAction}:
            known = ", ".join(a.value for a in AuditAction)
            raise ValueError(f"unknown audit action {action!r} (one of: {known})")
    check_list_args(None, None, limit)
    where = audit.AuditFilter(actor=actor, action=action, since=check_time(since, "since"))
    return where, _audit_cursor(cursor)


def _audit_cursor(cursor: str | None) -> int | None:
    """The id an ``AuditPage.next_cursor`` continues before."""
    if cursor is None:
        return None
    if not isinstance(cursor, str) or not cursor.startswith("a") or not cursor[1:].isdigit():
        raise ValueError(f"cursor {str(cursor)[:100]!r} is not a cursor that audit() returned")
    if len(cursor) > 20:
        raise ValueError("cursor is not a cursor that audit() returned")
    return int(cursor[1:])
