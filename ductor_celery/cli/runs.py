"""The commands of one run's life: ``start``, ``runs`` (the listing), ``show``, ``signal``,
``approve`` and ``reject``. The controls (pause, cancel...) are in ``controls.py``."""

from __future__ import annotations

import json
import sys
from datetime import datetime
from typing import TYPE_CHECKING

import click
from rich.markup import escape

from ..limits import MAX_LIST_LIMIT
from .base import (
    by_option,
    call,
    ductor,
    duration,
    load_ductor,
    os_user,
    parse_json,
    parse_version,
    rich_console,
    short,
    timestamp,
)

if TYPE_CHECKING:
    from ..views import RunView


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
@click.option("--tag", "tag_texts", multiple=True, help="Tag the run KEY=VALUE (repeatable).")
@by_option
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
    tag_texts: tuple[str, ...],
    by: str | None,
) -> None:
    """Start a run of WORKFLOW; prints {"run_id", "workflow_id"} (then the run, with --wait)."""
    value = parse_json(input_json, "--input")
    tags = call(parse_tags, tag_texts)
    version = parse_version(version_text)
    if wait_:
        from ..call_checks import check_timeout

        call(check_timeout, timeout)  # before the run starts, not after
    d = load_ductor(ctx)
    handle = call(
        d.start,
        workflow,
        input=value,
        workflow_id=workflow_id,
        delay=delay,
        version=version,
        deadline=deadline,
        by=by,
        tags=tags,
    )
    click.echo(json.dumps({"run_id": handle.run_id, "workflow_id": handle.workflow_id}))
    if wait_:
        view = call(d.wait, handle.run_id, timeout=timeout)
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
@click.option(
    "--tag", "tag_texts", multiple=True, help="Only runs tagged KEY=VALUE (repeatable: all match)."
)
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
    tag_texts: tuple[str, ...],
    as_json: bool,
) -> None:
    """List runs, newest first, a page at a time; prints the cursor of the next page."""
    from datetime import UTC

    from ..web.timeparse import parse_time

    now = datetime.now(UTC)
    start = None if since is None else call(parse_time, since, "--since", now)
    end = None if until is None else call(parse_time, until, "--until", now)
    tags = call(parse_tags, tag_texts)
    d = load_ductor(ctx)
    page = call(
        d.list_runs,
        status=status,
        workflow=workflow,
        workflow_id=workflow_id,
        since=start,
        until=end,
        cursor=cursor,
        limit=limit,
        tags=tags,
        large_values=False,  # the list shows no values: it never reads them
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
    for column in ("run id", "workflow id", "workflow", "status", "created", "took", "tags"):
        table.add_column(column)
    for v in page:
        table.add_row(
            v.run_id,
            v.workflow_id,
            f"{v.workflow} v{v.version}",
            _status(v.status),
            timestamp(v.created_at),
            duration(v.created_at, v.finished_at),
            # Tags are anyone's text: never read as rich markup.
            escape(" ".join(f"{k}={t}" for k, t in sorted(v.tags.items()))),
        )
    rich_console().print(table)
    if page.next_cursor is not None:
        click.echo(f"next cursor: {page.next_cursor}  (more runs: add --cursor {page.next_cursor})")


def parse_tags(texts: tuple[str, ...]) -> dict[str, str]:
    """``--tag KEY=VALUE`` options as a tags mapping: split on the first ``=`` (a value may
    hold more); ValueError naming one without ``=`` or a key given twice. The client checks
    the keys and values themselves."""
    found: dict[str, str] = {}
    for text in texts:
        key, equals, value = text.partition("=")
        if not equals:
            raise ValueError(f"--tag {text[:100]!r} is not KEY=VALUE")
        if key in found:
            raise ValueError(f"--tag key {key[:100]!r} is given twice")
        found[key] = value
    return found


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
    d = load_ductor(ctx)
    view: RunView = call(d.get, target)
    if as_json:
        click.echo(view.model_dump_json(indent=2))
        return
    from rich.table import Table

    from ..definition.render import to_mermaid

    spec = call(d.client.definition_of, view.run_id)
    attempts, transitions = call(d.client.history, view.run_id)
    console = rich_console()
    console.print(
        f"[bold]run[/] {view.run_id}  [bold]workflow id[/] {view.workflow_id}  "
        f"[bold]workflow[/] {view.workflow} v{view.version}  [bold]status[/] "
        f"{_status(view.status)}"
    )
    console.print(
        f"created {timestamp(view.created_at)}  finished {timestamp(view.finished_at) or '-'}  "
        f"took {duration(view.created_at, view.finished_at) or '-'}"
    )
    if view.tags:  # anyone's text: never read as markup
        console.print(
            "[bold]tags[/] " + escape(" ".join(f"{k}={v}" for k, v in sorted(view.tags.items())))
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
            timestamp(node.started_at),
            duration(node.started_at, node.finished_at),
            short(detail),
        )
    console.print(nodes)
    if view.compensations:  # docs/compensation.md: undone last-completed first
        saga = Table(title="compensations")
        for column in ("node", "status", "attempts", "output / error"):
            saga.add_column(column)
        for c in view.compensations:
            detail = c.output if c.error is None else (c.error or {}).get("message")
            saga.add_row(c.node, _status(c.status), str(c.attempts), short(detail))
        console.print(saga)
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
            beat = timestamp(a.heartbeat_at) + (
                f" {short(a.heartbeat_details, 30)}" if a.heartbeat_details is not None else ""
            )
        tries.add_row(
            a.token.split(":", 1)[-1],
            "" if a.branch is None else str(a.branch),
            a.outcome or ("running" if a.claimed_at else "queued"),
            (a.claimed_by or "").rsplit(":", 1)[0],
            duration(a.claimed_at, a.finished_at),
            beat,
            short((a.error or {}).get("message")),
        )
    console.print(tries)
    history = Table(title="transitions")
    for column in ("seq", "at", "node", "from", "to", "reason"):
        history.add_column(column)
    for tr in transitions:
        history.add_row(
            str(tr.seq),
            timestamp(tr.at),
            tr.node or "(run)",
            tr.from_status or "",
            tr.to_status,
            short(tr.reason, 80),
        )
    console.print(history)
    statuses = {k: v.status.value for k, v in view.nodes.items()}
    console.print(to_mermaid(spec, statuses), markup=False, highlight=False)


@ductor.command()
@click.argument("target")
@click.argument("name")
@click.option("--payload", default=None, help="The signal payload, as JSON.")
@click.option(
    "--idempotency-key", default=None, help="A repeat of the key is accepted and ignored."
)
@by_option
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
    value = parse_json(payload, "--payload")
    signal_id = call(
        load_ductor(ctx).signal, target, name, value, idempotency_key=idempotency_key, by=by
    )
    click.echo(json.dumps({"signal_id": signal_id}))


def _decision(approved: bool) -> click.Command:
    verb = "approve" if approved else "reject"

    @click.command(name=verb, help=f"{verb.capitalize()} the waiting approval NODE of TARGET.")
    @click.argument("target")
    @click.argument("node")
    @click.option(
        "--by",
        default=os_user,
        show_default="the operating-system user",
        help="Who decides (recorded with the decision and in the audit log).",
    )
    @click.option("--comment", default=None)
    @click.pass_context
    def decide(
        ctx: click.Context, target: str, node: str, by: str | None, comment: str | None
    ) -> None:
        d = load_ductor(ctx)
        call(d.approve if approved else d.reject, target, node, by=by, comment=comment)
        click.echo(f"{verb}d {node}")

    return decide


ductor.add_command(_decision(True))
ductor.add_command(_decision(False))
