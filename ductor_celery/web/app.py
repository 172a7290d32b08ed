"""``create_app(ductor)``: the console as a Starlette app; ``serve(...)``: it under uvicorn."""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

from . import api, pages
from .console import PACKAGE, Console
from .guard import LOOPBACK_HOSTS, HostCheck, SecurityHeaders, allowed_names, server_error

if TYPE_CHECKING:
    from ..ductor import Ductor

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
#: Bind addresses that mean "every interface": not a name any browser asks for.
EVERY_ADDRESS = ("0.0.0.0", "::", "[::]", "")


def _setting(ductor: Ductor, name: str) -> Any:
    value = ductor.app.conf.get(name)
    return value if value not in (None, "") else None


def _names(value: object) -> list[Any]:
    """Allowed hosts as given: a list of names, or one string of comma-separated names (as an
    environment variable carries them)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [part for part in value.split(",") if part.strip()] or [value]
    if isinstance(value, list | tuple | set | frozenset):
        return list(value)
    raise ValueError(f"allowed hosts must be a list of names, got {type(value).__name__}")


def bound_hosts(host: str) -> list[str]:
    """The name a bind address adds to the allowed hosts: itself, unless it means every
    interface (then browsers reach the console by names only the operator knows)."""
    return [] if host.strip() in EVERY_ADDRESS else [host]


def create_app(
    ductor: Ductor,
    *,
    token: str | None = None,
    flower_url: str | None = None,
    poll_interval: float = 1.0,
    allowed_hosts: Iterable[str] | str | None = None,
) -> Starlette:
    """The console of ``ductor``'s runs. ``token`` (default ``ductor_web_token``) enables the
    actions; without one the console is read-only. ``flower_url`` (default
    ``ductor_flower_url``) links each attempt to its task in Flower. ``allowed_hosts``: names
    (besides localhost, 127.0.0.1 and ::1, and those of ``ductor_web_allowed_hosts``) that
    requests may give in ``Host``; any other is refused with 400."""
    token = token if token is not None else _setting(ductor, "ductor_web_token")
    if token is not None and (not isinstance(token, str) or not token.strip()):
        raise ValueError("the console's token must be a non-empty string")
    flower_url = flower_url if flower_url is not None else _setting(ductor, "ductor_flower_url")
    hosts = allowed_names(
        [
            *LOOPBACK_HOSTS,
            *_names(_setting(ductor, "ductor_web_allowed_hosts")),
            *_names(allowed_hosts),
        ]
    )
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
            # Outermost first: every answer gets the headers, the Host check's 400 included.
            Middleware(SecurityHeaders),
            Middleware(HostCheck, allowed=hosts),
            Middleware(
                SessionMiddleware,
                # A key per process: sessions do not outlive the console (a restart logs out).
                secret_key=secrets.token_urlsafe(32),
                session_cookie="ductor_console",
                same_site="strict",
                https_only=False,
                max_age=12 * 3600,
            ),
        ],
        exception_handlers={500: server_error},
    )
    app.state.console = console
    app.state.allowed_hosts = hosts
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
    allowed_hosts: Iterable[str] | str | None = None,
) -> None:
    """Run the console until interrupted; it answers requests for ``host`` (unless it is every
    address), the loopback names, and ``allowed_hosts``."""
    hosts = [*_names(allowed_hosts), *bound_hosts(host)]
    app = create_app(ductor, token=token, flower_url=flower_url, allowed_hosts=hosts)
    run(app, host=host, port=port)
