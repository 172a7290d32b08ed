"""The ``ductor`` command; also ``celery -A app ductor ...`` (the celery.commands entry point).

Every error prints one line on stderr and exits non-zero; read commands take ``--json``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn

import click

from .errors import DuctorError
from .limits import MAX_JSON_DEPTH, MAX_LIST_LIMIT
from .settings import EMBEDDED_DATABASE_URL, normalize_url, redact_url

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


def _console() -> Any:
    from rich.console import Console

    return Console()


def _when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else ""


def _duration(start: datetime | None, end: datetime | None) -> str:
    if start is None or end is None:
        return ""
    return f"{(end - start).total_seconds():.3f}s"


@click.group(name="ductor")
@click.option("-A", "--app", "app_path", default=None, help="The Celery app, e.g. proj.app:app.")
@click.pass_context
def ductor(ctx: click.Context, app_path: str | None) -> None:
    """Durable workflows on Celery."""
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
@click.pass_context
def start(
    ctx: click.Context,
    workflow: str,
    input_json: str | None,
    workflow_id: str | None,
    wait_: bool,
    timeout: float | None,
) -> None:
    """Start a run of WORKFLOW; prints {"run_id", "workflow_id"} (then the run, with --wait)."""
    value = _parse_json(input_json, "--input")
    if wait_:
        from .client import check_timeout

        _call(check_timeout, timeout)  # before the run starts, not after
    d = _load_ductor(ctx)
    handle = _call(d.start, workflow, input=value, workflow_id=workflow_id)
    click.echo(json.dumps({"run_id": handle.run_id, "workflow_id": handle.workflow_id}))
    if wait_:
        view = _call(d.wait, handle.run_id, timeout=timeout)
        click.echo(view.model_dump_json())
        if view.status != "succeeded":
            sys.exit(2)


@ductor.command()
@click.option("--status", default=None, help="Only runs with this status.")
@click.option("--workflow", default=None, help="Only runs of this workflow.")
# A plain int: the client checks the range, so --limit 0 is one line and exit 1 like every
# other bad value (click's IntRange would print its usage text and exit 2).
@click.option("--limit", default=50, type=int, show_default=True, help=f"1..{MAX_LIST_LIMIT} runs.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_context
def runs(
    ctx: click.Context, status: str | None, workflow: str | None, limit: int, as_json: bool
) -> None:
    """List runs, newest first."""
    d = _load_ductor(ctx)
    views = _call(d.list_runs, status=status, workflow=workflow, limit=limit)
    if as_json:
        for view in views:
            click.echo(view.model_dump_json(exclude={"nodes", "context", "input", "output"}))
        return
    from rich.table import Table

    table = Table(title=f"{len(views)} runs")
    for column in ("run id", "workflow id", "workflow", "status", "created", "took"):
        table.add_column(column)
    for v in views:
        table.add_row(
            v.run_id,
            v.workflow_id,
            f"{v.workflow} v{v.version}",
            _status(v.status),
            _when(v.created_at),
            _duration(v.created_at, v.finished_at),
        )
    _console().print(table)


_COLORS = {
    "succeeded": "green",
    "running": "yellow",
    "waiting": "cyan",
    "failed": "red",
    "cancelled": "magenta",
    "terminated": "magenta",
    "skipped": "dim",
    "pending": "white",
}


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
@click.pass_context
def signal(
    ctx: click.Context, target: str, name: str, payload: str | None, idempotency_key: str | None
) -> None:
    """Send signal NAME to TARGET (run id or workflow id)."""
    value = _parse_json(payload, "--payload")
    signal_id = _call(
        _load_ductor(ctx).signal, target, name, value, idempotency_key=idempotency_key
    )
    click.echo(json.dumps({"signal_id": signal_id}))


def _decision(approved: bool) -> click.Command:
    verb = "approve" if approved else "reject"

    @click.command(name=verb, help=f"{verb.capitalize()} the waiting approval NODE of TARGET.")
    @click.argument("target")
    @click.argument("node")
    @click.option("--by", default=None, help="Who decides.")
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

    @click.command(name=name, help=f"{name.capitalize()} TARGET (run id or workflow id).")
    @click.argument("target")
    @click.pass_context
    def control(ctx: click.Context, /, target: str, **options: Any) -> None:
        d = _load_ductor(ctx)
        kwargs: dict[str, Any] = {}
        if with_reason and options.get("reason") is not None:
            kwargs["reason"] = options["reason"]
        if kind == "continue_as_new" and options.get("input_json") is not None:
            kwargs["input"] = _parse_json(options["input_json"], "--input")
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
    return control


for _kind, _reason in (
    ("pause", True),
    ("resume", False),
    ("cancel", True),
    ("terminate", True),
    ("redrive", False),
    ("continue_as_new", False),
):
    ductor.add_command(_control(_kind, _reason))


def main() -> None:
    ductor(obj=None)
