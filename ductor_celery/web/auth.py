"""Who may read and act: a named token with a role (``tokens.py``), given as
``Authorization: Bearer <token>`` on the JSON API, or by logging in on the pages (a session
cookie that keeps the token's name and a keyed fingerprint of it; every form also carries the
session's CSRF token). Without tokens the console is read-only. With ``auth_reads`` every
request but the login page and the static files needs a token, of any role (``ReadGate``).

Each check that lets a request through remembers its token on the request: ``actor(request)``
is the name of who acts, the name the console passes to the Ductor as ``by=``.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Callable
from typing import Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from .tokens import Role, Token, TokenSet

READ_ONLY = (
    "the console is read-only: start it with --token or --token-file (or set ductor_web_token "
    "or ductor_web_tokens) to allow actions"
)
#: What a 401 asks for (RFC 6750).
CHALLENGE = {"www-authenticate": 'Bearer realm="ductor"'}


class Forbidden(Exception):
    """Answered with 403 and the message: a wrong token, or one whose role is too low."""


class Unauthenticated(Exception):
    """Answered with 401 and the message: the request needs a token and gave none."""


class Access(Protocol):
    """What the checks read of the console (``console.Console`` is one)."""

    tokens: TokenSet
    session_key: bytes
    auth_reads: bool


def fingerprint(token: Token, key: bytes) -> str:
    """What a session keeps of the token it logged in with, beside its name: an HMAC of the
    token keyed by the console's own secret, so a changed or removed token logs the session
    out, and whoever reads the cookie (it is signed, not encrypted) has nothing to test token
    guesses against offline."""
    message = b"ductor-console:" + token.name.encode() + b"\x00" + token.digest
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def _remember(request: Request, token: Token) -> Token:
    request.state.ductor_token = token
    return token


def actor(request: Request) -> str | None:
    """The name of the token this request acts with, once a check has let it through; None
    before (or on a console that let it read without one)."""
    token = getattr(request.state, "ductor_token", None)
    return token.name if isinstance(token, Token) else None


def bearer(request: Request, tokens: TokenSet) -> Token | None:
    """The token of the ``Authorization: Bearer`` header; None without one (or with another
    scheme, such as a proxy's Basic); Forbidden for a bearer token this console does not know."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    token = tokens.match(given.strip())
    if token is None:
        raise Forbidden("the bearer token is not one of this console's tokens")
    return token


def session_token(request: Request, access: Access) -> Token | None:
    """The token the session logged in with, while the console still has it unchanged."""
    name, kept = request.session.get("who"), request.session.get("auth")
    if not isinstance(name, str) or not isinstance(kept, str):
        return None
    token = access.tokens.named(name)
    if token is None or not same(kept, fingerprint(token, access.session_key)):
        return None
    return token


def log_in(request: Request, access: Access, token: Token) -> None:
    request.session["who"] = token.name
    request.session["auth"] = fingerprint(token, access.session_key)


def log_out(request: Request) -> None:
    request.session.pop("who", None)
    request.session.pop("auth", None)


def _allowed(token: Token, needed: Role, what: str) -> Token:
    if not token.role.allows(needed):
        raise Forbidden(
            f"the token {token.name!r} has the role {token.role}: {what} needs the role "
            f"{needed} or above"
        )
    return token


def _none_given(access: Access, message: str) -> Exception:
    """No token at all: 401 where reads need one too, 403 (as before roles) where they do not."""
    return Unauthenticated(message) if access.auth_reads else Forbidden(message)


def check_bearer(request: Request, access: Access, needed: Role, what: str) -> Token:
    """The JSON API's rule: ``Authorization: Bearer <token>`` of a role that may do ``what``,
    never the session cookie."""
    if not access.tokens:
        raise Forbidden(READ_ONLY)
    token = bearer(request, access.tokens)
    if token is None:
        raise _none_given(access, "a valid 'Authorization: Bearer <token>' header is required")
    return _remember(request, _allowed(token, needed, what))


def csrf_token(request: Request) -> str:
    """The session's CSRF token, made on its first page."""
    found = request.session.get("csrf")
    if not isinstance(found, str):
        found = request.session["csrf"] = secrets.token_urlsafe(24)
    return found


def check_csrf(request: Request, form: dict[str, str]) -> None:
    expected = request.session.get("csrf")
    if not isinstance(expected, str) or not same(form.get("csrf_token", ""), expected):
        raise Forbidden("the form's CSRF token is missing or stale: reload the page")


def check_form(
    request: Request, access: Access, form: dict[str, str], needed: Role, what: str
) -> Token:
    """A page's POST: the console has tokens, the form carries the session's CSRF token, and
    the session logged in with a token (still unchanged) of a role that may do ``what``."""
    if not access.tokens:
        raise Forbidden(READ_ONLY)
    check_csrf(request, form)
    token = session_token(request, access)
    if token is None:
        raise _none_given(access, "log in with a token first")
    return _remember(request, _allowed(token, needed, what))


def check_read(request: Request, access: Access, *, api: bool) -> Token:
    """With ``auth_reads``: a token of any role, as a bearer header (the JSON API) or, on the
    pages, also the session's."""
    token = bearer(request, access.tokens)
    if token is None and not api:
        token = session_token(request, access)
    if token is None:
        how = "send" if api else "log in, or send"
        raise Unauthenticated(
            f"this console's reads need a token: {how} 'Authorization: Bearer <token>'"
        )
    return _remember(request, token)


#: Paths anyone may fetch when reads need a token: logging in needs its page and its styles,
#: and a webhook's delivery carries its signature instead of a token (web/hooks.py).
OPEN_PATHS = re.compile(r"^/(login|static/.*|hooks/.*)$")
#: Whole pages: a request that may not read them gets the login page (with the status).
PAGE_PATHS = re.compile(r"^/(runs/[^/]+)?$")


class ReadGate:
    """With ``auth_reads`` (read live from the console): every request but ``OPEN_PATHS``
    needs a token, or gets 401 (403 for a bearer token the console does not know): JSON on
    ``/api/``, the login page for a page, plain text for the rest (fragments, ``/metrics``)."""

    def __init__(
        self, app: ASGIApp, access: Access, login_page: Callable[[Request, int, str], Response]
    ) -> None:
        self.app = app
        self.access = access
        self.login_page = login_page

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not self.access.auth_reads or OPEN_PATHS.match(path):
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        api = path.startswith("/api/")
        try:
            check_read(request, self.access, api=api)
        except (Unauthenticated, Forbidden) as exc:
            code = 401 if isinstance(exc, Unauthenticated) else 403
            headers = CHALLENGE if code == 401 else None
            answer: Response
            if api:
                answer = JSONResponse({"error": str(exc)}, status_code=code, headers=headers)
            elif request.method == "GET" and PAGE_PATHS.match(path):
                answer = self.login_page(request, code, str(exc))
                if headers:
                    answer.headers.update(headers)
            else:
                answer = PlainTextResponse(str(exc), status_code=code, headers=headers)
            await answer(scope, receive, send)
            return
        await self.app(scope, receive, send)
