"""The ``ductor`` command; also ``celery -A app ductor ...`` (the celery.commands entry point)."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from .errors import DuctorError
from .settings import EMBEDDED_DATABASE_URL, normalize_url


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


def _load_ductor(ctx: click.Context) -> Any:
    """The Ductor instance of the app given with -A (ours or celery's)."""
    from celery import Celery

    from .ductor import Ductor

    obj = ctx.find_root().obj
    app = getattr(obj, "app", None)  # celery's CLIContext
    if app is None:
        app_path = obj.get("app") if isinstance(obj, dict) else None
        if not app_path:
            _fail("no app given: use 'ductor -A module:app ...'")
        from celery.app.utils import find_app

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
    import os

    from .store.migrate import upgrade

    url = database_url or os.environ.get("DUCTOR_DATABASE_URL")
    if url is None:
        obj = ctx.find_root().obj
        if getattr(obj, "app", None) is not None or (isinstance(obj, dict) and obj.get("app")):
            url = _load_ductor(ctx).settings.database_url
    url = normalize_url(url or EMBEDDED_DATABASE_URL)
    try:
        upgrade(url)
    except Exception as exc:  # noqa: BLE001
        _fail(f"migration failed: {exc.__class__.__name__}: {str(exc).splitlines()[0]}")
    click.echo(f"schema is up to date ({_redact(url)})")


def _redact(url: str) -> str:
    import sqlalchemy as sa

    return sa.engine.make_url(url).render_as_string(hide_password=True)


@ductor.command()
@click.argument("workflow")
@click.option("--input", "input_json", default=None, help="The run input, as JSON.")
@click.option("--workflow-id", default=None, help="Business key; an open run with it is reused.")
@click.option("--wait", "wait_", is_flag=True, help="Wait for the run to finish.")
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
    """Start a run of WORKFLOW."""
    try:
        value = json.loads(input_json) if input_json is not None else None
    except json.JSONDecodeError as exc:
        _fail(f"--input is not valid JSON: {exc}")
    d = _load_ductor(ctx)
    try:
        handle = d.start(workflow, input=value, workflow_id=workflow_id)
        click.echo(json.dumps({"run_id": handle.run_id, "workflow_id": handle.workflow_id}))
        if wait_:
            view = d.wait(handle.run_id, timeout=timeout)
            click.echo(view.model_dump_json())
            if view.status != "succeeded":
                sys.exit(2)
    except (DuctorError, TimeoutError) as exc:
        _fail(str(exc))


@ductor.command()
@click.option("--status", default=None)
@click.option("--workflow", default=None)
@click.option("--limit", default=50, type=int)
@click.pass_context
def runs(ctx: click.Context, status: str | None, workflow: str | None, limit: int) -> None:
    """List runs, newest first (JSON lines)."""
    d = _load_ductor(ctx)
    try:
        for view in d.list_runs(status=status, workflow=workflow, limit=limit):
            click.echo(
                view.model_dump_json(
                    include={
                        "run_id",
                        "workflow_id",
                        "workflow",
                        "status",
                        "created_at",
                        "finished_at",
                    }
                )
            )
    except (DuctorError, ValueError) as exc:
        _fail(str(exc))


@ductor.command()
@click.argument("target")
@click.pass_context
def show(ctx: click.Context, target: str) -> None:
    """Show a run (by run id or workflow id) as JSON."""
    d = _load_ductor(ctx)
    try:
        click.echo(d.get(target).model_dump_json(indent=2))
    except DuctorError as exc:
        _fail(str(exc))


def main() -> None:
    ductor(obj=None)
