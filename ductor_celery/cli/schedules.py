"""The schedule commands: ``schedules`` (the listing) and the ``schedule`` group (``add``,
``remove``, ``pause``, ``resume``, ``trigger``)."""

from __future__ import annotations

import json
from typing import Any

import click

from .base import (
    by_option,
    call,
    ductor,
    load_ductor,
    parse_json,
    parse_seconds,
    rich_console,
    timestamp,
)


@ductor.command(name="schedules")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_context
def schedules_(ctx: click.Context, as_json: bool) -> None:
    """List schedules with their next fire time."""
    d = load_ductor(ctx)
    views = call(d.list_schedules)
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
            "paused" if v.paused else timestamp(v.next_fire_at),
            v.last_workflow_id or "",
        )
    rich_console().print(table)


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
@by_option
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
    value = parse_json(input_json, "--input")
    options: dict[str, Any] = {}
    if catchup_window is not None:
        options["catchup_window"] = parse_seconds(catchup_window, "--catchup-window")
    d = load_ductor(ctx)
    view = call(
        d.schedule,
        name,
        workflow=workflow,
        cron=cron,
        every=parse_seconds(every, "--every") if every is not None else None,
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
    @by_option
    @click.pass_context
    def action(ctx: click.Context, name: str, by: str | None) -> None:
        d = load_ductor(ctx)
        # Removing a schedule is an audited action; pausing and triggering are not (yet).
        extra = {"by": by} if method == "unschedule" else {}
        found = call(getattr(d, method), name, **extra)
        if found is not None:  # trigger: the run it started
            click.echo(json.dumps({"run_id": found.run_id, "workflow_id": found.workflow_id}))
        else:
            click.echo(f"schedule {name} {verb}d")  # removed, paused, resumed


_schedule_action("remove", "unschedule", "Delete schedule NAME (its runs stay).")
_schedule_action("pause", "pause_schedule", "Stop firing NAME until resumed.")
_schedule_action("resume", "resume_schedule", "Fire NAME again, from the next fire time.")
_schedule_action("trigger", "trigger_schedule", "Start a run of NAME now; prints its ids.")
