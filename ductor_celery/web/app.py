"""``create_app(ductor)``: the console as a Starlette app; ``serve(...)``: it under uvicorn."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

from . import api, pages
from .console import PACKAGE, Console

if TYPE_CHECKING:
    from ..ductor import Ductor

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


def _setting(ductor: Ductor, name: str) -> Any:
    value = ductor.app.conf.get(name)
    return value if value not in (None, "") else None


def create_app(
    ductor: Ductor,
    *,
    token: str | None = None,
    flower_url: str | None = None,
    poll_interval: float = 1.0,
) -> Starlette:
    """The console of ``ductor``'s runs. ``token`` (default ``ductor_web_token``) enables the
    actions; without one the console is read-only. ``flower_url`` (default
    ``ductor_flower_url``) links each attempt to its task in Flower."""
    token = token if token is not None else _setting(ductor, "ductor_web_token")
    if token is not None and (not isinstance(token, str) or not token.strip()):
        raise ValueError("the console's token must be a non-empty string")
    flower_url = flower_url if flower_url is not None else _setting(ductor, "ductor_flower_url")
    console = Console(
        ductor=ductor, token=token, flower_url=flower_url, poll_interval=poll_interval
    )
    app = Starlette(
        routes=[
            *pages.routes(console),
            *api.routes(console),
            Mount("/static", StaticFiles(directory=str(PACKAGE / "static")), name="static"),
        ],
        middleware=[
            Middleware(
                SessionMiddleware,
                # A key per process: sessions do not outlive the console (a restart logs out).
                secret_key=secrets.token_urlsafe(32),
                session_cookie="ductor_console",
                same_site="strict",
                https_only=False,
                max_age=12 * 3600,
            )
        ],
    )
    app.state.console = console
    return app


def run(app: Starlette, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> None:
    """Serve a console app with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)


def serve(
    ductor: Ductor,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    token: str | None = None,
    flower_url: str | None = None,
) -> None:
    """Run the console until interrupted."""
    run(create_app(ductor, token=token, flower_url=flower_url), host=host, port=port)
