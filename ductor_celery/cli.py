"""The ``ductor`` command; also ``celery -A app ductor ...`` (the celery.commands entry point).

Every error prints one line on stderr and exits non-zero; read commands take ``--json``.
"""

from __future__ import annotations

import getpass
import json
import os
import sys
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn

import click

from .engine.kinds import AuditSource
from .errors import DuctorError
from .limits import MAX_DURATION_S, MAX_JSON_DEPTH, MAX_LIST_LIMIT
from .settings import EMBEDDED_DATABASE_URL, normalize_url, redact_url
from .store.audit import acting_as

if TYPE_CHECKING:
    from .ductor import Ductor
    from .views import RunView


def _fail(message: str, code: int = 1) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _app_path(ctx: click.Context) -> tuple[Any, str | None]:
    obj = ctx.find_root().obj
    app = getattr(obj, "app", None)  # celery's CLIContext when run as `celery -A app ductor`
    path = obj.get("app") if isinstance(obj, dict) else None
    return app, path


def _load_ductor(ctx: click.Context) -> Ductor:
    """The Ductor of the app given with -A (ours, or celery's own -A)."""
    from celery import Celery

    from .ductor import Ductor

    app, app_path = _app_path(ctx)
    if app is None:
        if not app_path:
            _fail("no app given: use 'ductor -A module:app ...'")
        from celery.app.utils import find_app

        sys.path.insert(0, os.getcwd())  # as `celery -A` does: the app module sits here
        try:
            app = find_app(app_path)
        except Exception as exc:  # noqa: BLE001 - any import problem becomes one clear line
            _fail(f"cannot load app {app_path!r}: {exc}")
    if not isinstance(app, Celery):
        _fail(f"{app!r} is not a Celery app")
    found = getattr(app, "_ductor", None)
    if not isinstance(found, Ductor):
        _fail("the app has no Ductor: create one with Ductor(app) in the app module")
    return found


def _one_line(exc: BaseException) -> str:
    """The exception's message on one line (a message may span several)."""
    text = "; ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
    return text or exc.__class__.__name__


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a client call; ductor's errors and bad values become one line and exit 1."""
    try:
        return fn(*args, **kwargs)
    except (DuctorError, TimeoutError, TypeError, ValueError, RecursionError) as exc:
        _fail(_one_line(exc))
    except Exception as exc:  # noqa: BLE001 - e.g. the database is unreachable
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        _fail(f"{exc.__class__.__name__}: {first}")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (JSON has no NaN or Infinity)")


def _json_int(digits: str) -> int:
    limit = sys.get_int_max_str_digits()
    if limit and len(digits.lstrip("-")) > limit:
        raise ValueError(f"an integer of {len(digits.lstrip('-'))} digits (at most {limit})")
    return int(digits)


def _parse_json(text: str | None, option: str) -> Any:
    """Strict JSON: NaN, Infinity, huge integers and deep nesting are one clear line."""
    if text is None:
        return None
    try:
        return json.loads(text, parse_constant=_no_constant, parse_int=_json_int)
    except RecursionError:
        _fail(f"{option} is nested too deeply (at most {MAX_JSON_DEPTH} levels)")
    except ValueError as exc:  # JSONDecodeError too
        _fail(f"{option} is not valid JSON: {_one_line(exc)}")


def _parse_version(text: str | None, *, latest: bool = False) -> int | str | None:
    """--version: a version number (or, where allowed, ``latest``)."""
    if text is None or (latest and text == "latest"):
        return text
    try:
        return int(text.strip())
    except ValueError:
        also = " or 'latest'" if latest else ""
        _fail(f"--version must be a version number{also}, got {text!r}")


def _console() -> Any:
    from rich.console import Console

    return Console()


def _when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else ""


def _duration(start: datetime | None, end: datetime | None) -> str:
    if start is None or end is None:
        return ""
    return f"{(end - start).total_seconds():.3f}s"


def _os_user() -> str | None:
    """The operating-system user: who acts, unless ``--by`` says otherwise."""
    try:
        return getpass.getuser()[:200] or None
    except Exception:  # noqa: BLE001 - no user name (a container with a bare uid)
        return None


def _by_option(fn: Any) -> Any:
    return click.option(
        "--by",
        default=_os_user,
        show_default="the operating-system user",
        help="Who acts, for the audit log.",
    )(fn)


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


@ductor.command()
@click.option("--database-url", default=None, help="Database URL (default: the app's or env).")
@click.pass_context
def migrate(ctx: click.Context, database_url: str | None) -> None:
    """Create or upgrade the eec_ schema."""
    from .store.migrate import upgrade

    url = database_url or os.environ.get("DUCTOR_DATABASE_URL")
    app, app_path = _app_path(ctx)
    if url is None and (app is not None or app_path):
        url = _load_ductor(ctx).settings.database_url
    url = normalize_url(url or EMBEDDED_DATABASE_URL)
    try:
        upgrade(url)
    except Exception as exc:  # noqa: BLE001
        _fail(f"migration failed: {exc.__class__.__name__}: {str(exc).splitlines()[0]}")
    click.echo(f"schema is up to date ({redact_url(url)})")


@ductor.command()
@click.argument("workflow")
@click.option("--input", "input_json", default=None, help="The run input, as JSON.")
@click.option("--workflow-id", default=None, help="Business key; an open run with it is reused.")
@click.option("--wait", "wait_", is_flag=True, help="Wait for the run to finish; print it.")
@click.option("--timeout", default=None, type=float, help="With --wait: give up after seconds.")
@click.option("--delay", default=None, type=float, help="Start in this many seconds (pending).")
@click.option(
    "--version", "version_text", default=None, help="This registered version (default: newest)."
)
@click.option(
    "--deadline", default=None, type=float, help="Seconds from its start; then it is timed_out."
)
@_by_option
@click.pass_context
def start(
    ctx: click.Context,
    workflow: str,
    input_json: str | None,
    workflow_id: str | None,
    wait_: bool,
    timeout: float | None,
    delay: float | None,
    version_text: str | None,
    deadline: float | None,
    by: str | None,
) -> None:
    """Start a run of WORKFLOW; prints {"run_id", "workflow_id"} (then the run, with --wait)."""
    value = _parse_json(input_json, "--input")
    version = _parse_version(version_text)
    if wait_:
        from .call_checks import check_timeout

        _call(check_timeout, timeout)  # before the run starts, not after
    d = _load_ductor(ctx)
    handle = _call(
        d.start,
        workflow,
        input=value,
        workflow_id=workflow_id,
        delay=delay,
        version=version,
        deadline=deadline,
        by=by,
    )
    click.echo(json.dumps({"run_id": handle.run_id, "workflow_id": handle.workflow_id}))
    if wait_:
        view = _call(d.wait, handle.run_id, timeout=timeout)
        click.echo(view.model_dump_json())
        if view.status != "succeeded":
            sys.exit(2)


@ductor.command()
@click.option("--status", default=None, help="Only runs with this status.")
@click.option("--workflow", default=None, help="Only runs of this workflow.")
@click.option("--workflow-id", default=None, help="Only runs of this workflow id.")
@click.option("--since", default=None, help="Started at or after: ISO 8601 or an age (2h, 7d).")
@click.option("--until", default=None, help="Started before: ISO 8601 or an age (30m).")
@click.option("--cursor", default=None, help="The next-page cursor a previous listing printed.")
# A plain int: the client checks the range, so --limit 0 is one line and exit 1 like every
# other bad value (click's IntRange would print its usage text and exit 2).
@click.option("--limit", default=50, type=int, show_default=True, help=f"1..{MAX_LIST_LIMIT} runs.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_context
def runs(
    ctx: click.Context,
    status: str | None,
    workflow: str | None,
    workflow_id: str | None,
    since: str | None,
    until: str | None,
    cursor: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """List runs, newest first, a page at a time; prints the cursor of the next page."""
    from datetime import UTC

    from .web.timeparse import parse_time

    now = datetime.now(UTC)
    start = None if since is None else _call(parse_time, since, "--since", now)
    end = None if until is None else _call(parse_time, until, "--until", now)
    d = _load_ductor(ctx)
    page = _call(
        d.list_runs,
        status=status,
        workflow=workflow,
        workflow_id=workflow_id,
        since=start,
        until=end,
        cursor=cursor,
        limit=limit,
    )
    if as_json:
        for view in page:
            click.echo(view.model_dump_json(exclude={"nodes", "context", "input", "output"}))
        # stdout stays one run per line; the cursor goes beside it.
        if page.next_cursor is not None:
            click.echo(f"next cursor: {page.next_cursor}", err=True)
        return
    from rich.table import Table

    table = Table(title=f"{len(page)} runs")
    for column in ("run id", "workflow id", "workflow", "status", "created", "took"):
        table.add_column(column)
    for v in page:
        table.add_row(
            v.run_id,
            v.workflow_id,
            f"{v.workflow} v{v.version}",
            _status(v.status),
            _when(v.created_at),
            _duration(v.created_at, v.finished_at),
        )
    _console().print(table)
    if page.next_cursor is not None:
        click.echo(f"next cursor: {page.next_cursor}  (more runs: add --cursor {page.next_cursor})")


_COLORS = {
    "succeeded": "green",
    "running": "yellow",
    "waiting": "cyan",
    "failed": "red",
    "cancelled": "magenta",
    "terminated": "magenta",
    "timed_out": "red",
    "skipped": "dim",
    "pending": "white",
}


@ductor.command()
@click.argument("target", required=False)
@click.option("--actor", default=None, help="Only what this actor did.")
@click.option("--action", default=None, help="Only this action (pause, start, prune...).")
@click.option("--since", default=None, help="At or after: ISO 8601 or an age (2h, 7d).")
@click.option("--cursor", default=None, help="The next-page cursor a previous listing printed.")
@click.option("--limit", default=50, type=int, show_default=True, help=f"1..{MAX_LIST_LIMIT}.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_context
def audit(
    ctx: click.Context,
    target: str | None,
    actor: str | None,
    action: str | None,
    since: str | None,
    cursor: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """Who did what, newest first: of TARGET (a run id or workflow id), or of everything."""
    from datetime import UTC

    from .web.timeparse import parse_time

    start = None if since is None else _call(parse_time, since, "--since", datetime.now(UTC))
    d = _load_ductor(ctx)
    page = _call(
        d.audit, target, actor=actor, action=action, since=start, limit=limit, cursor=cursor
    )
    if as_json:
        for entry in page:
            click.echo(entry.model_dump_json())
        if page.next_cursor is not None:
            click.echo(f"next cursor: {page.next_cursor}", err=True)
        return
    from rich.table import Table

    table = Table(title=f"{len(page)} audit entries")
    for column in ("at", "actor", "action", "source", "run id", "node", "detail"):
        table.add_column(column)
    for e in page:
        table.add_row(
            _when(e.at),
            e.actor or "",
            e.action,
            e.source,
            e.run_id or "",
            e.node or "",
            _short(json.dumps(e.detail)) if e.detail else "",
        )
    _console().print(table)
    if page.next_cursor is not None:
        click.echo(f"next cursor: {page.next_cursor}  (more: add --cursor {page.next_cursor})")


def _status(status: str) -> str:
    return f"[{_COLORS.get(status, 'white')}]{status}[/]"


#: Attempt rows ``ductor show`` prints at most.
SHOW_ATTEMPTS = 100


@ductor.command()
@click.argument("target")
@click.option("--json", "as_json", is_flag=True, help="The run view as JSON.")
@click.pass_context
def show(ctx: click.Context, target: str, as_json: bool) -> None:
    """Show a run (TARGET: run id or workflow id): nodes, attempts, timings, errors, the graph."""
    d = _load_ductor(ctx)
    view: RunView = _call(d.get, target)
    if as_json:
        click.echo(view.model_dump_json(indent=2))
        return
    from rich.table import Table

    from .definition.render import to_mermaid

    spec = _call(d.client.definition_of, view.run_id)
    attempts, transitions = _call(d.client.history, view.run_id)
    console = _console()
    console.print(
        f"[bold]run[/] {view.run_id}  [bold]workflow id[/] {view.workflow_id}  "
        f"[bold]workflow[/] {view.workflow} v{view.version}  [bold]status[/] "
        f"{_status(view.status)}"
    )
    console.print(
        f"created {_when(view.created_at)}  finished {_when(view.finished_at) or '-'}  "
        f"took {_duration(view.created_at, view.finished_at) or '-'}"
    )
    if view.error:
        console.print(f"[red]error:[/] {view.error.get('node', '')} {view.error.get('message')}")
    nodes = Table(title="nodes")
    for column in ("node", "status", "attempts", "started", "took", "output / error"):
        nodes.add_column(column)
    for node_id, node in view.nodes.items():
        detail = node.output if node.error is None else (node.error or {}).get("message")
        nodes.add_row(
            node_id,
            _status(node.status),
            str(node.attempts),
            _when(node.started_at),
            _duration(node.started_at, node.finished_at),
            _short(detail),
        )
    console.print(nodes)
    # A big scatter has thousands of attempts: show the open ones and the latest others.
    shown = [a for a in attempts if a.finished_at is None][:SHOW_ATTEMPTS]
    room = SHOW_ATTEMPTS - len(shown)
    shown += [a for a in attempts if a.finished_at is not None][-room:] if room > 0 else []
    hidden = len(attempts) - len(shown)
    tries = Table(
        title="attempts" + (f" ({hidden} older finished ones not shown)" if hidden else "")
    )
    for column in ("token", "branch", "outcome", "claimed by", "took", "heartbeat", "error"):
        tries.add_column(column)
    for a in sorted(shown, key=lambda a: (a.created_at, a.token)):
        beat = ""
        if a.heartbeat_at is not None:
            beat = _when(a.heartbeat_at) + (
                f" {_short(a.heartbeat_details, 30)}" if a.heartbeat_details is not None else ""
            )
        tries.add_row(
            a.token.split(":", 1)[-1],
            "" if a.branch is None else str(a.branch),
            a.outcome or ("running" if a.claimed_at else "queued"),
            (a.claimed_by or "").rsplit(":", 1)[0],
            _duration(a.claimed_at, a.finished_at),
            beat,
            _short((a.error or {}).get("message")),
        )
    console.print(tries)
    history = Table(title="transitions")
    for column in ("seq", "at", "node", "from", "to", "reason"):
        history.add_column(column)
    for tr in transitions:
        history.add_row(
            str(tr.seq),
            _when(tr.at),
            tr.node or "(run)",
            tr.from_status or "",
            tr.to_status,
            _short(tr.reason, 80),
        )
    console.print(history)
    statuses = {k: v.status.value for k, v in view.nodes.items()}
    console.print(to_mermaid(spec, statuses), markup=False, highlight=False)


def _short(value: Any, width: int = 60) -> str:
    text = (
        ""
        if value is None
        else (value if isinstance(value, str) else json.dumps(value, default=str))
    )
    return text if len(text) <= width else text[: width - 1] + "…"


@ductor.command()
@click.argument("workflow")
@click.option(
    "--format", "fmt", type=click.Choice(["mermaid", "dot"]), default="mermaid", show_default=True
)
@click.pass_context
def graph(ctx: click.Context, workflow: str, fmt: str) -> None:
    """Print WORKFLOW's graph as Mermaid or Graphviz DOT."""
    from .definition.render import to_dot, to_mermaid

    spec = _call(_load_ductor(ctx).client.find_definition, workflow)
    click.echo(to_mermaid(spec) if fmt == "mermaid" else to_dot(spec))


@ductor.command()
@click.option(
    "--timeout",
    default=2.0,
    type=float,
    show_default=True,
    help="Seconds to wait for workers to answer.",
)
@click.pass_context
def doctor(ctx: click.Context, timeout: float) -> None:
    """Check the database, the schema, the broker, and that both ductor queues are consumed."""
    from .doctor import run_checks

    d = _load_ductor(ctx)
    console = _console()
    ok = True
    for check in run_checks(d, timeout=timeout):
        mark = "[green]ok[/]  " if check.ok else "[red]FAIL[/]"
        console.print(f"{mark} {check.name}: {check.detail}")
        ok = ok and check.ok
    if not ok:
        sys.exit(1)


@ductor.command()
@click.argument("target")
@click.argument("name")
@click.option("--payload", default=None, help="The signal payload, as JSON.")
@click.option(
    "--idempotency-key", default=None, help="A repeat of the key is accepted and ignored."
)
@_by_option
@click.pass_context
def signal(
    ctx: click.Context,
    target: str,
    name: str,
    payload: str | None,
    idempotency_key: str | None,
    by: str | None,
) -> None:
    """Send signal NAME to TARGET (run id or workflow id)."""
    value = _parse_json(payload, "--payload")
    signal_id = _call(
        _load_ductor(ctx).signal, target, name, value, idempotency_key=idempotency_key, by=by
    )
    click.echo(json.dumps({"signal_id": signal_id}))


def _decision(approved: bool) -> click.Command:
    verb = "approve" if approved else "reject"

    @click.command(name=verb, help=f"{verb.capitalize()} the waiting approval NODE of TARGET.")
    @click.argument("target")
    @click.argument("node")
    @click.option(
        "--by",
        default=_os_user,
        show_default="the operating-system user",
        help="Who decides (recorded with the decision and in the audit log).",
    )
    @click.option("--comment", default=None)
    @click.pass_context
    def decide(
        ctx: click.Context, target: str, node: str, by: str | None, comment: str | None
    ) -> None:
        d = _load_ductor(ctx)
        _call(d.approve if approved else d.reject, target, node, by=by, comment=comment)
        click.echo(f"{verb}d {node}")

    return decide


ductor.add_command(_decision(True))
ductor.add_command(_decision(False))


def _control(kind: str, with_reason: bool) -> click.Command:
    name = kind.replace("_", "-")

    @click.command(
        name=name,
        help=f"{name.capitalize()} TARGET (run id or workflow id), or every run matching "
        "--workflow/--status/--since/--limit (the count first; acts only with --yes).",
    )
    @click.argument("target", required=False)
    @_bulk_options
    @_by_option
    @click.pass_context
    def control(ctx: click.Context, /, target: str | None, **options: Any) -> None:
        d = _load_ductor(ctx)
        kwargs: dict[str, Any] = {"by": options.get("by")}
        if with_reason and options.get("reason") is not None:
            kwargs["reason"] = options["reason"]
        if kind == "redrive" and options.get("from_node") is not None:
            kwargs["from_node"] = options["from_node"]
        if _bulk_control(d, kind, target, options, kwargs):
            return
        if kind in ("continue_as_new", "redrive") and options.get("input_json") is not None:
            kwargs["input"] = _parse_json(options["input_json"], "--input")
        if kind == "continue_as_new" and options.get("version_text") is not None:
            kwargs["version"] = _parse_version(options["version_text"], latest=True)
        _call(getattr(d, kind), target, **kwargs)
        click.echo(f"{name} requested")

    if with_reason:
        control = click.option("--reason", default=None)(control)
    if kind == "continue_as_new":
        control = click.option(
            "--input",
            "input_json",
            default=None,
            help="Start the successor from the top with this JSON input.",
        )(control)
        control = click.option(
            "--version",
            "version_text",
            default=None,
            help="Move the successor to this registered version, or 'latest'.",
        )(control)
    if kind == "redrive":
        control = click.option(
            "--input",
            "input_json",
            default=None,
            help="The rerun's nodes see this JSON input instead of the run's.",
        )(control)
        control = click.option(
            "--from-node",
            default=None,
            help="Rerun this node and every node after it (any finished run).",
        )(control)
    return control


def _bulk_options(fn: Any) -> Any:
    for option in (
        click.option("--yes", is_flag=True, help="With filters: act (without: only count)."),
        click.option("--limit", default=None, type=int, help="With filters: at most N runs."),
        click.option("--since", default=None, help="With filters: created since (ISO or 2h)."),
        click.option("--status", default=None, help="Every run with this status."),
        click.option("--workflow", "bulk_workflow", default=None, help="Every run of it."),
    ):
        fn = option(fn)
    return fn


def _bulk_control(
    d: Ductor, kind: str, target: str | None, options: dict[str, Any], kwargs: dict[str, Any]
) -> bool:
    """A control given filters instead of a TARGET: count, then act with --yes. False when
    it is a plain one-run control."""
    from . import bulk

    filters = {k: options.get(k) for k in ("bulk_workflow", "status", "since", "limit")}
    if not any(v is not None for v in filters.values()):
        if target is None:
            _fail("give a TARGET, or --workflow/--status to act on every matching run")
        if options.get("yes"):
            _fail("--yes goes with --workflow/--status, not with a TARGET")
        return False
    if target is not None:
        _fail("give a TARGET or filters (--workflow/--status/--since/--limit), not both")
    since = _since(filters["since"]) if filters["since"] is not None else None
    selection = _call(
        bulk.select,
        d.client,
        kind,
        workflow=filters["bulk_workflow"],
        status=filters["status"],
        since=since,
        limit=filters["limit"],
        from_node="from_node" in kwargs,
    )
    name = kind.replace("_", "-")
    count = len(selection.run_ids)
    if not options.get("yes"):
        click.echo(f"{count} runs match; nothing done (add --yes to {name} them)")
        return True
    if kind in ("continue_as_new", "redrive") and options.get("input_json") is not None:
        kwargs["input"] = _parse_json(options["input_json"], "--input")
        kwargs["has_input"] = True
    if "from_node" in kwargs:  # the client's name for it
        kwargs["node"] = kwargs.pop("from_node")
    kwargs["requested_by"] = kwargs.pop("by", None)
    if kind == "continue_as_new" and options.get("version_text") is not None:
        kwargs["version"] = _parse_version(options["version_text"], latest=True)
    with acting_as(AuditSource.BULK):
        result = _call(bulk.apply, d.client, selection, **kwargs)
    for run_id, why in result.refused:
        click.echo(f"refused {run_id}: {why}", err=True)
    click.echo(f"{name} requested for {result.applied} of {count} runs")
    if result.refused:
        sys.exit(1)
    return True


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _seconds(text: str, option: str) -> float:
    """``90``, ``90s``, ``15m``, ``2h``, ``30d``, ``1w``: a number of seconds."""
    import math

    value = text.strip().lower()
    unit = _DURATION_UNITS.get(value[-1:], None)
    number = value[:-1] if unit is not None else value
    try:
        seconds = float(number) * (unit or 1)
    except ValueError:
        _fail(f"{option} must be a duration such as 90s, 15m, 2h or 30d, got {text!r}")
    if not math.isfinite(seconds) or seconds < 0:
        _fail(f"{option} must be a finite duration >= 0, got {text!r}")
    if seconds > MAX_DURATION_S:  # before any timedelta: 99999999999d would overflow one
        _fail(f"{option} must be at most ten years ({MAX_DURATION_S:.0f} s), got {text[:60]!r}")
    return seconds


def _since(text: str) -> datetime:
    """--since: an ISO 8601 time (a naive one is UTC) or a duration back from now."""
    from datetime import UTC, timedelta

    from .limits import time_problem

    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return datetime.now(UTC) - timedelta(seconds=_seconds(text, "--since"))
    when = when if when.tzinfo is not None else when.replace(tzinfo=UTC)
    problem = time_problem(when)  # 0001-01-01T00:00+14:00 is no time in UTC
    if problem is not None:
        _fail(f"--since {problem}")
    return when


for _kind, _reason in (
    ("pause", True),
    ("resume", False),
    ("cancel", True),
    ("terminate", True),
    ("redrive", False),
    ("continue_as_new", False),
):
    ductor.add_command(_control(_kind, _reason))


@ductor.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=8080, type=int, show_default=True, help="Port to listen on.")
@click.option(
    "--token",
    default=None,
    help="One admin token, named 'token' (default: ductor_web_token; without any token the "
    "console is read-only).",
)
@click.option(
    "--token-file",
    default=None,
    metavar="FILE",
    help="Named tokens with roles (viewer, operator, admin): JSON if FILE ends in .json, TOML "
    'otherwise; {"tokens": {"alice": {"secret": "...", "role": "operator"}}}, a secret may be '
    '"sha256:<hex>" (default: ductor_web_tokens).',
)
@click.option(
    "--auth-reads",
    is_flag=True,
    default=None,
    help="Reading (pages, JSON API, /metrics) needs a token too (default: ductor_web_auth_reads).",
)
@click.option("--flower-url", default=None, help="Flower's URL: attempts link to their task.")
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    metavar="NAME",
    help="Also answer requests whose Host is NAME (repeatable; *.example.com for subdomains; "
    "default: the bound address, localhost, 127.0.0.1, ::1 and ductor_web_allowed_hosts).",
)
@click.pass_context
def web(
    ctx: click.Context,
    host: str,
    port: int,
    token: str | None,
    token_file: str | None,
    auth_reads: bool | None,
    flower_url: str | None,
    allowed_hosts: tuple[str, ...],
) -> None:
    """Serve the web console: runs, live graphs, actions, a JSON API and /metrics."""
    if not 0 < port < 65536:
        _fail(f"--port must be between 1 and 65535, got {port}")
    if token is not None and not token.strip():
        _fail("--token must not be empty")
    if token_file is not None and not token_file.strip():
        _fail("--token-file must not be empty")
    d = _load_ductor(ctx)
    from .web.app import bound_hosts, create_app, run

    hosts = [*allowed_hosts, *bound_hosts(host)]
    app = _call(
        create_app,
        d,
        token=token,
        token_file=token_file,
        auth_reads=auth_reads or None,
        flower_url=flower_url,
        allowed_hosts=hosts,
    )
    console = app.state.console
    if console.read_only:
        mode = "read-only: no token"
    else:
        reads = "reads need a token" if console.auth_reads else "reads need no token"
        mode = f"tokens: {console.tokens.describe()}; {reads}"
    click.echo(f"ductor console on http://{host}:{port}/ ({mode})", err=True)
    if token_file is not None:
        _warn_if_shared(token_file, console.tokens)
    if host not in ("127.0.0.1", "localhost", "::1") and not console.auth_reads:
        click.echo(
            f"warning: bound to {host}: anyone who reaches it can read every run's input, "
            "context and output (only actions need a token; --auth-reads changes that); it "
            f"answers only the Host names {', '.join(app.state.allowed_hosts)} (add one with "
            "--allowed-host NAME)",
            err=True,
        )
    run(app, host=host, port=port)


def _warn_if_shared(path: str, tokens: Any) -> None:
    """A token file others may read, holding secrets rather than their hashes: say so."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    plain = [t.name for t in tokens if not t.hashed]
    if plain and mode & 0o044:
        click.echo(
            f"warning: the token file {path} is readable by other users and holds "
            f"{len(plain)} secret(s) in the clear: chmod 600 it, or store 'sha256:<hex>' hashes",
            err=True,
        )


@ductor.command(name="schedules")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_context
def schedules_(ctx: click.Context, as_json: bool) -> None:
    """List schedules with their next fire time."""
    d = _load_ductor(ctx)
    views = _call(d.list_schedules)
    if as_json:
        for view in views:
            click.echo(view.model_dump_json())
        return
    from rich.table import Table

    table = Table(title=f"{len(views)} schedules")
    for column in ("name", "workflow", "when", "overlap", "next fire (UTC)", "last run"):
        table.add_column(column)
    for v in views:
        when = f"cron {v.cron} ({v.timezone})" if v.cron else f"every {v.every:g}s"
        table.add_row(
            v.name,
            v.workflow,
            when,
            v.overlap,
            "paused" if v.paused else _when(v.next_fire_at),
            v.last_workflow_id or "",
        )
    _console().print(table)


@ductor.group(name="schedule")
def schedule_group() -> None:
    """Add, remove, pause, resume or trigger a schedule."""


@schedule_group.command(name="add")
@click.argument("name")
@click.option("--workflow", required=True, help="The workflow each fire time starts.")
@click.option("--cron", default=None, help='A cron expression, e.g. "0 2 * * *".')
@click.option("--every", default=None, help="Or a period: 300, 90s, 15m, 2h, 1d (>= 1s).")
@click.option(
    "--timezone", "--tz", default="UTC", show_default=True, help="The cron's IANA time zone."
)
@click.option("--input", "input_json", default=None, help="The runs' input, as JSON.")
@click.option(
    "--overlap",
    default="skip",
    show_default=True,
    help="While the previous run is open: skip, buffer_one or allow.",
)
@click.option("--catchup-window", default=None, help="Catch up missed fire times this recent (5m).")
@_by_option
@click.pass_context
def schedule_add(
    ctx: click.Context,
    name: str,
    workflow: str,
    cron: str | None,
    every: str | None,
    timezone: str,
    input_json: str | None,
    overlap: str,
    catchup_window: str | None,
    by: str | None,
) -> None:
    """Define schedule NAME (replacing one of that name); prints it as JSON."""
    value = _parse_json(input_json, "--input")
    options: dict[str, Any] = {}
    if catchup_window is not None:
        options["catchup_window"] = _seconds(catchup_window, "--catchup-window")
    d = _load_ductor(ctx)
    view = _call(
        d.schedule,
        name,
        workflow=workflow,
        cron=cron,
        every=_seconds(every, "--every") if every is not None else None,
        timezone=timezone,
        input=value,
        overlap=overlap,
        by=by,
        **options,
    )
    click.echo(view.model_dump_json())


def _schedule_action(verb: str, method: str, help_text: str) -> None:
    @schedule_group.command(name=verb, help=help_text)
    @click.argument("name")
    @_by_option
    @click.pass_context
    def action(ctx: click.Context, name: str, by: str | None) -> None:
        d = _load_ductor(ctx)
        # Removing a schedule is an audited action; pausing and triggering are not (yet).
        extra = {"by": by} if method == "unschedule" else {}
        found = _call(getattr(d, method), name, **extra)
        if found is not None:  # trigger: the run it started
            click.echo(json.dumps({"run_id": found.run_id, "workflow_id": found.workflow_id}))
        else:
            click.echo(f"schedule {name} {verb}d")  # removed, paused, resumed


_schedule_action("remove", "unschedule", "Delete schedule NAME (its runs stay).")
_schedule_action("pause", "pause_schedule", "Stop firing NAME until resumed.")
_schedule_action("resume", "resume_schedule", "Fire NAME again, from the next fire time.")
_schedule_action("trigger", "trigger_schedule", "Start a run of NAME now; prints its ids.")


@ductor.command()
@click.option("--older-than", required=True, help="Finished longer ago than this: 30d, 12h...")
@click.option("--status", "statuses", multiple=True, help="Only this finished status (repeat).")
@click.option("--dry-run", is_flag=True, help="Only count the runs that would be deleted.")
@_by_option
@click.pass_context
def prune(
    ctx: click.Context, older_than: str, statuses: tuple[str, ...], dry_run: bool, by: str | None
) -> None:
    """Delete finished runs (attempts, transitions, signals, controls too), in batches."""
    from datetime import timedelta

    age = timedelta(seconds=_seconds(older_than, "--older-than"))
    d = _load_ductor(ctx)
    count = _call(d.prune, older_than=age, statuses=list(statuses) or None, dry_run=dry_run, by=by)
    click.echo(f"{count} runs would be deleted" if dry_run else f"{count} runs deleted")


def main() -> None:
    ductor(obj=None)
