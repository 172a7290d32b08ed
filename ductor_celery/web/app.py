"""``create_app(ductor)``: the console as a Starlette app; ``serve(...)``: it under uvicorn."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

from . import api, hooks, pages
from .auth import ReadGate
from .console import PACKAGE, Console
from .guard import LOOPBACK_HOSTS, HostCheck, SecurityHeaders, allowed_names, server_error
from .tokens import TokenSet, from_file, from_mapping, single, union

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


def _flag(value: object, name: str) -> bool:
    """A yes/no setting: a bool, or the words an environment variable carries."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be true or false, got {type(value).__name__}")


def console_tokens(
    ductor: Ductor,
    *,
    token: str | None = None,
    tokens: Mapping[str, Mapping[str, str]] | None = None,
    token_file: str | os.PathLike[str] | None = None,
) -> TokenSet:
    """The console's tokens: those given (``token``: one admin named ``token``; ``tokens``:
    name -> {secret, role}; ``token_file``), or, when none is given, those of the settings
    ``ductor_web_token`` and ``ductor_web_tokens``. The sources given together are one set:
    no two tokens may share a name or a secret. TokenError (a ValueError) for any problem."""
    if token is None and tokens is None and token_file is None:
        one, many = _setting(ductor, "ductor_web_token"), _setting(ductor, "ductor_web_tokens")
        where = ("ductor_web_token", "ductor_web_tokens")
    else:
        one, many, where = token, tokens, ("the console's token", "the console's tokens")
    sets = []
    if one is not None:
        sets.append(single(one, where[0]))
    if many is not None:
        sets.append(from_mapping(many, where[1]))
    if token_file is not None:
        sets.append(from_file(token_file))
    return union(sets)


def bound_hosts(host: str) -> list[str]:
    """The name a bind address adds to the allowed hosts: itself, unless it means every
    interface (then browsers reach the console by names only the operator knows)."""
    return [] if host.strip() in EVERY_ADDRESS else [host]


def create_app(
    ductor: Ductor,
    *,
    token: str | None = None,
    tokens: Mapping[str, Mapping[str, str]] | None = None,
    token_file: str | os.PathLike[str] | None = None,
    auth_reads: bool | None = None,
    flower_url: str | None = None,
    poll_interval: float = 1.0,
    allowed_hosts: Iterable[str] | str | None = None,
) -> Starlette:
    """The console of ``ductor``'s runs. Tokens enable the actions (``console_tokens``:
    ``token``, ``tokens``, ``token_file``, or the settings ``ductor_web_token`` and
    ``ductor_web_tokens``); without any the console is read-only. ``auth_reads`` (default
    ``ductor_web_auth_reads``): reading needs a token too. ``flower_url`` (default
    ``ductor_flower_url``) links each attempt to its task in Flower. ``allowed_hosts``: names
    (besides localhost, 127.0.0.1 and ::1, and those of ``ductor_web_allowed_hosts``) that
    requests may give in ``Host``; any other is refused with 400."""
    known = console_tokens(ductor, token=token, tokens=tokens, token_file=token_file)
    if auth_reads is None:
        auth_reads = _flag(_setting(ductor, "ductor_web_auth_reads"), "ductor_web_auth_reads")
    if auth_reads and not known:
        raise ValueError(
            "reads that need a token (--auth-reads, ductor_web_auth_reads) need tokens: "
            "give --token or --token-file (or set ductor_web_token or ductor_web_tokens)"
        )
    flower_url = flower_url if flower_url is not None else _setting(ductor, "ductor_flower_url")
    hosts = allowed_names(
        [
            *LOOPBACK_HOSTS,
            *_names(_setting(ductor, "ductor_web_allowed_hosts")),
            *_names(allowed_hosts),
        ]
    )
    console = Console(
        ductor=ductor,
        tokens=known,
        flower_url=flower_url,
        poll_interval=poll_interval,
        auth_reads=auth_reads,
    )
    app = Starlette(
        routes=[
            *pages.routes(console),
            *api.routes(console),
            *hooks.routes(console),
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
            # Inside the session: a page may read once its session logged in.
            Middleware(ReadGate, access=console, login_page=pages.login_page(console)),
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
    allowed_hosts: Iterable[str] | str | None = None,
    **options: Any,
) -> None:
    """Run the console until interrupted; it answers requests for ``host`` (unless it is every
    address), the loopback names, and ``allowed_hosts``. ``options``: those of
    ``create_app`` (``token``, ``tokens``, ``token_file``, ``auth_reads``, ``flower_url``)."""
    hosts = [*_names(allowed_hosts), *bound_hosts(host)]
    app = create_app(ductor, allowed_hosts=hosts, **options)
    run(app, host=host, port=port)
