"""The console's outer walls: which ``Host`` names it answers, and the headers every response
carries.

Why a Host check on a console bound to 127.0.0.1: DNS rebinding. A page on any site can point
its own name at 127.0.0.1 once loaded, and its script then reads this console as "same
origin", every run's input and output included. The browser still sends the attacker's name in
``Host``, so refusing names the console does not serve closes that door.

Why the headers: the pages show values anyone who can start a run chose (inputs, outputs,
errors, ids). Templates escape them; the Content-Security-Policy makes a slip harmless anyway,
since no script runs but the console's own file, and no other site may frame the console to
trick a click.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable

from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocketClose

#: Always served: the loopback names (the bound address is added by ``serve`` and the CLI).
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")

#: Only the console's own files: no inline script or style, no eval, no plugins, no framing.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",  # frame-ancestors for browsers older than CSP 2
    "referrer-policy": "same-origin",  # run ids in URLs stay here (Flower links included)
}

_NAME = re.compile(r"^[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?$")
_PORT = re.compile(r"^[0-9]{1,5}$")


def _ipv6(text: str) -> str | None:
    try:
        return str(ipaddress.IPv6Address(text))
    except ValueError:
        return None


def host_name(header: str) -> str | None:
    """The name a ``Host`` header asks for, lower-case, without its port or a final dot
    (``[::1]:8080`` -> ``::1``); None when it is not a well-formed host."""
    value = header.strip().lower()
    if value.startswith("["):
        inside, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not (rest[0] == ":" and _PORT.match(rest[1:]))):
            return None
        return _ipv6(inside)
    name, colon, port = value.partition(":")
    if colon and not _PORT.match(port):
        return None
    name = name[:-1] if name.endswith(".") else name
    return name if _NAME.match(name) else None


def allowed_name(given: object) -> str:
    """One allowed-host entry as the check compares it: a name or an address (IPv6 with or
    without brackets), ``*.domain`` for its subdomains, or ``*`` for any host. ValueError,
    naming it, for anything else (a port included: the check ignores ports)."""
    if not isinstance(given, str):
        raise ValueError(f"an allowed host must be a string, got {type(given).__name__}")
    value = given.strip().lower()
    if value == "*":
        return value
    if value.startswith("*."):
        rest = host_name(value[2:])
        if rest is not None and ":" not in rest:
            return "*." + rest
    elif value.startswith("[") or value.count(":") > 1:
        bracketed = value.startswith("[") and value.endswith("]")
        found = _ipv6(value[1:-1] if bracketed else value)
        if found is not None:
            return found
    elif ":" not in value:
        found = host_name(value)
        if found is not None:
            return found
    raise ValueError(
        f"{given!r} is not an allowed host: give a name or an address without a port "
        "(example.com, 10.0.0.5, ::1), *.example.com for its subdomains, or * for any"
    )


def allowed_names(values: Iterable[object]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(allowed_name(v) for v in values))


def allows(allowed: Iterable[str], header: str | None) -> bool:
    """Whether a request with this ``Host`` header is one the console serves."""
    name = host_name(header) if header is not None else None
    if name is None:
        return False
    for pattern in allowed:
        if pattern == "*" or pattern == name:
            return True
        if pattern.startswith("*.") and name.endswith(pattern[1:]):
            return True
    return False


class HostCheck:
    """Refuse (400, before any other work, before a session is made) a request whose ``Host``
    the console does not serve."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...]) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = Headers(scope=scope).get("host")
        if allows(self.allowed, host):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await WebSocketClose(code=1008)(scope, receive, send)
            return
        shown = repr(host[:100]) if host is not None else "none"
        answer = PlainTextResponse(
            f"this console does not serve the host {shown}: start it with --allowed-host NAME "
            "(or set ductor_web_allowed_hosts) to serve another name",
            status_code=400,
        )
        await answer(scope, receive, send)


class SecurityHeaders:
    """Every HTTP response leaves with ``SECURITY_HEADERS``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def guarded(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).update(SECURITY_HEADERS)
            await send(message)

        await self.app(scope, receive, guarded)


def server_error(request: Request, exc: Exception) -> Response:
    """A 500: plain text that names nothing of the request. Starlette answers it outside the
    other middleware, so it carries the headers itself."""
    return PlainTextResponse("Internal Server Error", status_code=500, headers=SECURITY_HEADERS)
