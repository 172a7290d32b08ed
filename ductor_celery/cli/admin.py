"""The operator's commands: ``migrate`` (the schema), ``doctor`` (is everything reachable and
consumed), ``graph`` (a workflow's graph), ``prune`` (delete old finished runs) and ``audit``
(who did what)."""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime

import click

from ..limits import MAX_LIST_LIMIT
from ..settings import EMBEDDED_DATABASE_URL, normalize_url, redact_url
from .base import (
    by_option,
    call,
    ductor,
    fail,
    given_app,
    load_ductor,
    parse_seconds,
    rich_console,
    short,
    timestamp,
)


@ductor.command()
@click.option("--database-url", default=None, help="Database URL (default: the app's or env).")
@click.pass_context
def migrate(ctx: click.Context, database_url: str | None) -> None:
    """Create or upgrade the eec_ schema."""
    from ..store.migrate import upgrade

    url = database_url or os.environ.get("DUCTOR_DATABASE_URL")
    app, app_path = given_app(ctx)
    if url is None and (app is not None or app_path):
        url = load_ductor(ctx).settings.database_url
    url = normalize_url(url or EMBEDDED_DATABASE_URL)
    try:
        upgrade(url)
    except Exception as exc:  # noqa: BLE001
        fail(f"migration failed: {exc.__class__.__name__}: {str(exc).splitlines()[0]}")
    click.echo(f"schema is up to date ({redact_url(url)})")


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
    from ..doctor import run_checks

    d = load_ductor(ctx)
    console = rich_console()
    ok = True
    for check in run_checks(d, timeout=timeout):
        mark = "[green]ok[/]  " if check.ok else "[red]FAIL[/]"
        console.print(f"{mark} {check.name}: {check.detail}")
        ok = ok and check.ok
    if not ok:
        sys.exit(1)


@ductor.command()
@click.argument("workflow")
@click.option(
    "--format", "fmt", type=click.Choice(["mermaid", "dot"]), default="mermaid", show_default=True
)
@click.pass_context
def graph(ctx: click.Context, workflow: str, fmt: str) -> None:
    """Print WORKFLOW's graph as Mermaid or Graphviz DOT."""
    from ..definition.render import to_dot, to_mermaid

    spec = call(load_ductor(ctx).client.find_definition, workflow)
    click.echo(to_mermaid(spec) if fmt == "mermaid" else to_dot(spec))


@ductor.command()
@click.option("--older-than", required=True, help="Finished longer ago than this: 30d, 12h...")
@click.option("--status", "statuses", multiple=True, help="Only this finished status (repeat).")
@click.option("--dry-run", is_flag=True, help="Only count the runs that would be deleted.")
@by_option
@click.pass_context
def prune(
    ctx: click.Context, older_than: str, statuses: tuple[str, ...], dry_run: bool, by: str | None
) -> None:
    """Delete finished runs (attempts, transitions, signals, controls too), in batches."""
    from datetime import timedelta

    age = timedelta(seconds=parse_seconds(older_than, "--older-than"))
    d = load_ductor(ctx)
    count = call(d.prune, older_than=age, statuses=list(statuses) or None, dry_run=dry_run, by=by)
    click.echo(f"{count} runs would be deleted" if dry_run else f"{count} runs deleted")


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

    from ..web.timeparse import parse_time

    start = None if since is None else call(parse_time, since, "--since", datetime.now(UTC))
    d = load_ductor(ctx)
    page = call(
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
            timestamp(e.at),
            e.actor or "",
            e.action,
            e.source,
            e.run_id or "",
            e.node or "",
            short(json.dumps(e.detail)) if e.detail else "",
        )
    rich_console().print(table)
    if page.next_cursor is not None:
        click.echo(f"next cursor: {page.next_cursor}  (more: add --cursor {page.next_cursor})")
