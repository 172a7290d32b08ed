"""``ductor web``: serve the web console (``ductor_celery/web/``), with the warnings about how
it is exposed (a wide bind address, a token file others may read)."""

from __future__ import annotations

import os
from typing import Any

import click

from .base import call, ductor, fail, load_ductor


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
        fail(f"--port must be between 1 and 65535, got {port}")
    if token is not None and not token.strip():
        fail("--token must not be empty")
    if token_file is not None and not token_file.strip():
        fail("--token-file must not be empty")
    d = load_ductor(ctx)
    from ..web.app import bound_hosts, create_app, run

    hosts = [*allowed_hosts, *bound_hosts(host)]
    app = call(
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
