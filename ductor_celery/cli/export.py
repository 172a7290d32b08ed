"""``ductor export TARGET``: one run as a JSON document on stdout (docs/replay.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from .base import call, ductor, fail, load_ductor

if TYPE_CHECKING:
    from ..ductor import Ductor


def export_of(d: Ductor, target: str) -> dict[str, Any]:
    """The export (format 1) of the run TARGET names: a run id, else the newest run of that
    workflow id (``RunNotFound`` if none)."""
    from ..store.export_format import export_document

    view = d.get(target)  # checks the target and resolves a workflow id
    return export_document(d.client.engine, view.run_id, dict(view.tags))


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
    from ..store.export_format import dumps_export

    d = load_ductor(ctx)
    text = dumps_export(call(export_of, d, target))
    if output is None:
        click.echo(text)
        return
    try:
        with open(output, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    except OSError as exc:
        fail(f"cannot write {output}: {exc.strerror or exc}")
