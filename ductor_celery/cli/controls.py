"""The controls of a run: ``pause``, ``resume``, ``cancel``, ``terminate``, ``redrive`` and
``continue-as-new``, each of one TARGET or, given filters instead, of every matching run
(``bulk``: the count first, acting only with ``--yes``)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from ..engine.kinds import AuditSource
from ..store.audit import acting_as
from .base import (
    by_option,
    call,
    ductor,
    fail,
    load_ductor,
    parse_json,
    parse_since,
    parse_version,
)

if TYPE_CHECKING:
    from ..ductor import Ductor


def _control(kind: str, with_reason: bool) -> click.Command:
    name = kind.replace("_", "-")

    @click.command(
        name=name,
        help=f"{name.capitalize()} TARGET (run id or workflow id), or every run matching "
        "--workflow/--status/--since/--limit (the count first; acts only with --yes).",
    )
    @click.argument("target", required=False)
    @_bulk_options
    @by_option
    @click.pass_context
    def control(ctx: click.Context, /, target: str | None, **options: Any) -> None:
        d = load_ductor(ctx)
        kwargs: dict[str, Any] = {"by": options.get("by")}
        if with_reason and options.get("reason") is not None:
            kwargs["reason"] = options["reason"]
        if kind == "redrive" and options.get("from_node") is not None:
            kwargs["from_node"] = options["from_node"]
        if _bulk_control(d, kind, target, options, kwargs):
            return
        if kind in ("continue_as_new", "redrive") and options.get("input_json") is not None:
            kwargs["input"] = parse_json(options["input_json"], "--input")
        if kind == "continue_as_new" and options.get("version_text") is not None:
            kwargs["version"] = parse_version(options["version_text"], latest=True)
        call(getattr(d, kind), target, **kwargs)
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
    from .. import bulk

    filters = {k: options.get(k) for k in ("bulk_workflow", "status", "since", "limit")}
    if not any(v is not None for v in filters.values()):
        if target is None:
            fail("give a TARGET, or --workflow/--status to act on every matching run")
        if options.get("yes"):
            fail("--yes goes with --workflow/--status, not with a TARGET")
        return False
    if target is not None:
        fail("give a TARGET or filters (--workflow/--status/--since/--limit), not both")
    since = parse_since(filters["since"]) if filters["since"] is not None else None
    selection = call(
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
        kwargs["input"] = parse_json(options["input_json"], "--input")
        kwargs["has_input"] = True
    if "from_node" in kwargs:  # the client's name for it
        kwargs["node"] = kwargs.pop("from_node")
    kwargs["requested_by"] = kwargs.pop("by", None)
    if kind == "continue_as_new" and options.get("version_text") is not None:
        kwargs["version"] = parse_version(options["version_text"], latest=True)
    with acting_as(AuditSource.BULK):
        result = call(bulk.apply, d.client, selection, **kwargs)
    for run_id, why in result.refused:
        click.echo(f"refused {run_id}: {why}", err=True)
    click.echo(f"{name} requested for {result.applied} of {count} runs")
    if result.refused:
        sys.exit(1)
    return True


for _kind, _reason in (
    ("pause", True),
    ("resume", False),
    ("cancel", True),
    ("terminate", True),
    ("redrive", False),
    ("continue_as_new", False),
):
    ductor.add_command(_control(_kind, _reason))
