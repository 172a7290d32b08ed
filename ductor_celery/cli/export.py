"""``ductor export TARGET``: one run as a JSON document on stdout (docs/replay.md)."""

from __future__ import annotations

import click

from .base import call, ductor, load_ductor


@ductor.command()
@click.argument("target")
@click.option(
    "-o",
    "--output",
    "output",
    default=None,
    type=click.Path(dir_okay=False),
    help="Write to this file instead of stdout.",
)
@click.pass_context
def export(ctx: click.Context, target: str, output: str | None) -> None:
    """Write run TARGET (run id or workflow id) as JSON: its definition, input, context,
    every attempt with its arguments and outcome, signals, controls, transitions, tags.
    Secrets stay references. Load it with testing.replay or testing.harness(from_export=)."""
    from ..exports import dumps_export, export_run

    d = load_ductor(ctx)
    text = dumps_export(call(export_run, d.client, target))
    if output is None:
        click.echo(text)
        return
    with open(output, "w", encoding="utf-8") as f:
        f.write(text + "\n")
