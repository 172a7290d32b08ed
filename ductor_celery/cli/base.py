"""The ``ductor`` click group and the helpers every command module shares.

Loading the app's Ductor (``-A``), running a client call so that an error is one line on stderr
and exit 1 (``call``), reading JSON, versions, durations and ``--since`` from the command line,
the ``--by`` option, and the small formatters of the tables.
"""

from __future__ import annotations

import getpass
import json
import os
import sys
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn

import click

from ..engine.kinds import AuditSource
from ..errors import DuctorError
from ..limits import MAX_DURATION_S
from ..payloads import JsonTextError, loads_strict
from ..store.audit import acting_as

if TYPE_CHECKING:
    from ..ductor import Ductor


@click.group(name="ductor")
@click.option("-A", "--app", "app_path", default=None, help="The Celery app, e.g. proj.app:app.")
@click.pass_context
def ductor(ctx: click.Context, app_path: str | None) -> None:
    """Durable workflows on Celery."""
    # Every action of this command is recorded as from the command line (the audit log).
    ctx.with_resource(acting_as(AuditSource.CLI))
    if ctx.obj is None:
        ctx.obj = {"app": app_path}
    elif isinstance(ctx.obj, dict):
        ctx.obj.setdefault("app", app_path)


def fail(message: str, code: int = 1) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def given_app(ctx: click.Context) -> tuple[Any, str | None]:
    """The app object celery's own ``-A`` loaded, and the path given with ours."""
    obj = ctx.find_root().obj
    app = getattr(obj, "app", None)  # celery's CLIContext when run as `celery -A app ductor`
    path = obj.get("app") if isinstance(obj, dict) else None
    return app, path


def load_ductor(ctx: click.Context) -> Ductor:
    """The Ductor of the app given with -A (ours, or celery's own -A)."""
    from celery import Celery

    from ..ductor import Ductor

    app, app_path = given_app(ctx)
    if app is None:
        if not app_path:
            fail("no app given: use 'ductor -A module:app ...'")
        from celery.app.utils import find_app

        sys.path.insert(0, os.getcwd())  # as `celery -A` does: the app module sits here
        try:
            app = find_app(app_path)
        except Exception as exc:  # noqa: BLE001 - any import problem becomes one clear line
            fail(f"cannot load app {app_path!r}: {exc}")
    if not isinstance(app, Celery):
        fail(f"{app!r} is not a Celery app")
    found = getattr(app, "_ductor", None)
    if not isinstance(found, Ductor):
        fail("the app has no Ductor: create one with Ductor(app) in the app module")
    return found


def _one_line(exc: BaseException) -> str:
    """The exception's message on one line (a message may span several)."""
    text = "; ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
    return text or exc.__class__.__name__


def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a client call; ductor's errors and bad values become one line and exit 1."""
    try:
        return fn(*args, **kwargs)
    except (DuctorError, TimeoutError, TypeError, ValueError, RecursionError) as exc:
        fail(_one_line(exc))
    except Exception as exc:  # noqa: BLE001 - e.g. the database is unreachable
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        fail(f"{exc.__class__.__name__}: {first}")


# -- reading the command line ------------------------------------------------------------------


def parse_json(text: str | None, option: str) -> Any:
    """Strict JSON: NaN, Infinity, huge integers and deep nesting are one clear line."""
    if text is None:
        return None
    try:
        return loads_strict(text, option)
    except JsonTextError as exc:
        fail(str(exc))


def parse_version(text: str | None, *, latest: bool = False) -> int | str | None:
    """--version: a version number (or, where allowed, ``latest``)."""
    if text is None or (latest and text == "latest"):
        return text
    try:
        return int(text.strip())
    except ValueError:
        also = " or 'latest'" if latest else ""
        fail(f"--version must be a version number{also}, got {text!r}")


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_seconds(text: str, option: str) -> float:
    """``90``, ``90s``, ``15m``, ``2h``, ``30d``, ``1w``: a number of seconds."""
    import math

    value = text.strip().lower()
    unit = _DURATION_UNITS.get(value[-1:], None)
    number = value[:-1] if unit is not None else value
    try:
        seconds = float(number) * (unit or 1)
    except ValueError:
        fail(f"{option} must be a duration such as 90s, 15m, 2h or 30d, got {text!r}")
    if not math.isfinite(seconds) or seconds < 0:
        fail(f"{option} must be a finite duration >= 0, got {text!r}")
    if seconds > MAX_DURATION_S:  # before any timedelta: 99999999999d would overflow one
        fail(f"{option} must be at most ten years ({MAX_DURATION_S:.0f} s), got {text[:60]!r}")
    return seconds


def parse_since(text: str) -> datetime:
    """--since: an ISO 8601 time (a naive one is UTC) or a duration back from now."""
    from datetime import UTC, timedelta

    from ..limits import time_problem

    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return datetime.now(UTC) - timedelta(seconds=parse_seconds(text, "--since"))
    when = when if when.tzinfo is not None else when.replace(tzinfo=UTC)
    problem = time_problem(when)  # 0001-01-01T00:00+14:00 is no time in UTC
    if problem is not None:
        fail(f"--since {problem}")
    return when


def os_user() -> str | None:
    """The operating-system user: who acts, unless ``--by`` says otherwise."""
    try:
        return getpass.getuser()[:200] or None
    except Exception:  # noqa: BLE001 - no user name (a container with a bare uid)
        return None


def by_option(fn: Any) -> Any:
    return click.option(
        "--by",
        default=os_user,
        show_default="the operating-system user",
        help="Who acts, for the audit log.",
    )(fn)


# -- printing ------------------------------------------------------------------------------------


def rich_console() -> Any:
    from rich.console import Console

    return Console()


def timestamp(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else ""


def duration(start: datetime | None, end: datetime | None) -> str:
    if start is None or end is None:
        return ""
    return f"{(end - start).total_seconds():.3f}s"


def short(value: Any, width: int = 60) -> str:
    text = (
        ""
        if value is None
        else (value if isinstance(value, str) else json.dumps(value, default=str))
    )
    return text if len(text) <= width else text[: width - 1] + "…"
