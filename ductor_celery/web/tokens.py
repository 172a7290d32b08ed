"""The console's tokens: each one a name (who acts) and a role (what it may do).

They come from ``--token T`` / ``ductor_web_token`` (one admin named ``token``), a token file
(``--token-file``: JSON when its name ends in ``.json``, TOML otherwise) or the setting
``ductor_web_tokens``, all of this shape::

    {"tokens": {"alice": {"secret": "...", "role": "operator"}}}    # the setting: the inner map

A ``secret`` of ``"sha256:<64 hex digits>"`` is the SHA-256 of the token instead of the token.
Every secret is kept as its SHA-256 digest only, a given token is hashed and compared with
every entry in constant time (``hmac.compare_digest``), and no message, ``repr`` or log line
ever holds a secret or a digest: a bad file is refused at start with the entry's name and what
is wrong with it, never its value.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

#: The name ``--token T`` and ``ductor_web_token`` give their one (admin) token.
SINGLE_TOKEN_NAME = "token"
#: The longest token name (it is recorded as the actor of what the token does).
MAX_NAME = 100
_SHA256 = re.compile(r"^[0-9a-fA-F]{64}$")
_HASH_PREFIX = "sha256:"
_ENTRY_KEYS = ("secret", "role")


class Role(StrEnum):
    """What a token may do; each role may do everything the ones before it may."""

    #: reads: the pages and the JSON API (needed only with ``--auth-reads``)
    VIEWER = "viewer"
    #: also acts on runs: controls, approvals, signals, start
    OPERATOR = "operator"
    #: also bulk controls, schedules and prune
    ADMIN = "admin"

    def allows(self, needed: Role) -> bool:
        return _RANK[self] >= _RANK[needed]


_RANK = {Role.VIEWER: 0, Role.OPERATOR: 1, Role.ADMIN: 2}


class TokenError(ValueError):
    """A token, token file or token setting the console cannot use (refused at start). The
    message names the entry and the problem, never a secret."""


def digest_of(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "replace")).digest()


@dataclass(frozen=True)
class Token:
    name: str
    role: Role
    #: SHA-256 of the secret (not shown: a digest of a weak secret is a secret too).
    digest: bytes = field(repr=False)
    #: Given as ``sha256:...`` rather than as the secret itself.
    hashed: bool = False


@dataclass(frozen=True)
class TokenSet:
    """The tokens one console knows; empty: the console is read-only."""

    tokens: tuple[Token, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.tokens)

    def __iter__(self) -> Iterator[Token]:
        return iter(self.tokens)

    def match(self, given: str) -> Token | None:
        """The token whose secret is ``given``, or None. Every entry is compared, in constant
        time each, so neither the time taken nor an early exit tells which one is close."""
        wanted = digest_of(given)
        found = None
        for token in self.tokens:
            if hmac.compare_digest(wanted, token.digest):
                found = token
        return found

    def named(self, name: str) -> Token | None:
        for token in self.tokens:
            if token.name == name:
                return token
        return None

    def describe(self) -> str:
        """``alice (operator), bob (viewer)``: names and roles, for the start-up line."""
        return ", ".join(f"{t.name} ({t.role})" for t in self.tokens)


def _checked_secret(secret: object, where: str) -> tuple[bytes, bool]:
    """A secret as (digest, hashed). The error names ``where``, never the value."""
    if not isinstance(secret, str):
        raise TokenError(f"{where}: the secret must be a string, got {type(secret).__name__}")
    if not secret.strip():
        raise TokenError(f"{where}: the secret is empty")
    if secret != secret.strip():
        raise TokenError(
            f"{where}: the secret begins or ends with white space (a bearer header drops it)"
        )
    if not secret.isprintable():
        raise TokenError(f"{where}: the secret holds a control character")
    if secret.startswith(_HASH_PREFIX):
        hexits = secret[len(_HASH_PREFIX) :]
        if not _SHA256.match(hexits):
            raise TokenError(
                f"{where}: a secret that starts with 'sha256:' must go on with the 64 hex "
                "digits of the token's SHA-256"
            )
        return bytes.fromhex(hexits), True
    return digest_of(secret), False


def _checked_name(name: object, where: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise TokenError(f"{where}: a token name must be a non-empty string")
    if len(name) > MAX_NAME or name != name.strip() or not name.isprintable():
        raise TokenError(
            f"{where}: the token name {name[:MAX_NAME]!r} must be 1 to {MAX_NAME} printable "
            "characters, without white space at either end"
        )
    return name


def single(secret: object, where: str = "the console's token") -> TokenSet:
    """``--token T`` / ``ductor_web_token``: one admin token named ``token``."""
    if not isinstance(secret, str) or not secret.strip():
        raise TokenError(f"{where} must be a non-empty string")
    if secret != secret.strip() or not secret.isprintable():
        raise TokenError(f"{where} must be printable, without white space at either end")
    return TokenSet((Token(SINGLE_TOKEN_NAME, Role.ADMIN, digest_of(secret)),))


def from_mapping(entries: object, where: str) -> TokenSet:
    """``{"alice": {"secret": ..., "role": ...}, ...}``: the setting, or a file's ``tokens``."""
    if not isinstance(entries, Mapping):
        raise TokenError(
            f"{where} must be a mapping of token names to {{secret, role}}, "
            f"got {type(entries).__name__}"
        )
    if not entries:
        raise TokenError(f"{where} has no tokens")
    found = []
    for raw_name, entry in entries.items():
        name = _checked_name(raw_name, where)
        here = f"{where}: token {name!r}"
        if not isinstance(entry, Mapping):
            raise TokenError(f"{here} must be a mapping with 'secret' and 'role'")
        unknown = sorted(str(k) for k in entry if k not in _ENTRY_KEYS)
        if unknown:
            raise TokenError(f"{here} has an unknown key {unknown[0][:40]!r} (keys: secret, role)")
        for key in _ENTRY_KEYS:
            if key not in entry:
                raise TokenError(f"{here} has no {key!r}")
        role = entry["role"]
        if not isinstance(role, str) or role not in {r.value for r in Role}:
            raise TokenError(f"{here}: the role must be one of {', '.join(r.value for r in Role)}")
        digest, hashed = _checked_secret(entry["secret"], here)
        found.append(Token(name, Role(role), digest, hashed))
    return union([TokenSet(tuple(found))])


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise TokenError(f"the key {key[:MAX_NAME]!r} appears twice")
        seen[key] = value
    return seen


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else exc.__class__.__name__


def from_file(path: str | os.PathLike[str]) -> TokenSet:
    """A token file: JSON when its name ends in ``.json``, TOML otherwise."""
    where = f"token file {os.fspath(path)}"
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise TokenError(f"cannot read {where}: {exc.strerror or exc.__class__.__name__}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        # Not the codec's message: it would quote a byte of the file.
        raise TokenError(f"{where} is not UTF-8 text (at byte {exc.start})") from None
    data: object
    if os.fspath(path).lower().endswith(".json"):
        try:
            data = json.loads(text, object_pairs_hook=_unique_keys)
        except TokenError as exc:
            raise TokenError(f"{where}: {exc}") from None
        except ValueError as exc:
            raise TokenError(f"{where} is not valid JSON: {_first_line(exc)}") from None
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise TokenError(f"{where} is not valid TOML: {_first_line(exc)}") from None
    if not isinstance(data, dict) or "tokens" not in data:
        raise TokenError(f"{where} must hold a 'tokens' table: [tokens.<name>] secret, role")
    unknown = sorted(k for k in data if k != "tokens")
    if unknown:
        raise TokenError(f"{where} has an unknown key {unknown[0][:40]!r} (only 'tokens')")
    return from_mapping(data["tokens"], where)


def union(sets: Iterable[TokenSet]) -> TokenSet:
    """Several sources' tokens as one set: two tokens may share neither a name nor a secret
    (with one secret the console could not tell whose request it is)."""
    found: list[Token] = []
    for token in (t for s in sets for t in s):
        for other in found:
            if other.name == token.name:
                raise TokenError(
                    f"two tokens are named {token.name!r} (--token and ductor_web_token "
                    f"are named {SINGLE_TOKEN_NAME!r})"
                )
            if hmac.compare_digest(other.digest, token.digest):
                raise TokenError(f"the tokens {other.name!r} and {token.name!r} have one secret")
        found.append(token)
    return TokenSet(tuple(found))
