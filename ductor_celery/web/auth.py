"""Who may act: the bearer token on the JSON API, a logged-in session with its CSRF token on
the pages. Without a configured token nobody may: the console is read-only."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from starlette.requests import Request

READ_ONLY = (
    "the console is read-only: start it with --token (or set ductor_web_token) to allow actions"
)


class Forbidden(Exception):
    """Answered with 403 and the message."""


def fingerprint(token: str, key: bytes) -> str:
    """What a session keeps of the token it logged in with: an HMAC keyed by the console's own
    secret, so a new token logs everyone out, and whoever reads the cookie (it is signed, not
    encrypted) has nothing to test token guesses against offline."""
    return hmac.new(key, b"ductor-console:" + token.encode(), hashlib.sha256).hexdigest()


def same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def check_bearer(request: Request, token: str | None) -> None:
    """The JSON API's rule: ``Authorization: Bearer <token>``, never the session cookie."""
    if token is None:
        raise Forbidden(READ_ONLY)
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not same(given.strip(), token):
        raise Forbidden("a valid 'Authorization: Bearer <token>' header is required")


def csrf_token(request: Request) -> str:
    """The session's CSRF token, made on its first page."""
    found = request.session.get("csrf")
    if not isinstance(found, str):
        found = request.session["csrf"] = secrets.token_urlsafe(24)
    return found


def logged_in(request: Request, token: str | None, key: bytes) -> bool:
    found = request.session.get("auth")
    return token is not None and isinstance(found, str) and same(found, fingerprint(token, key))


def check_form(request: Request, token: str | None, key: bytes, form: dict[str, str]) -> None:
    """A page's POST: the console has a token, the session logged in with it, and the form
    carries the session's CSRF token."""
    if token is None:
        raise Forbidden(READ_ONLY)
    expected = request.session.get("csrf")
    if not isinstance(expected, str) or not same(form.get("csrf_token", ""), expected):
        raise Forbidden("the form's CSRF token is missing or stale: reload the page")
    if not logged_in(request, token, key):
        raise Forbidden("log in with the console's token first")
