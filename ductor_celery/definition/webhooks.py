"""Webhooks, as registered: ``ductor.webhook(...)`` checks one whole (``webhook``), and how
its deliveries are signed (``verify``, ``sign``). Pure: the console's ``web/hooks.py`` reads a
delivery, resolves the secret and starts or signals the run.

A hook either starts a run of its workflow (``workflow=``; ``workflow_id=``, an optional path
into the body, names the run's workflow id and the delivery) or signals a run (``signal=``;
``target=``, the path of the run id or workflow id to signal). Paths read the JSON body:
``$.body.id``.

Three signature schemes (``scheme=``), each an HMAC-SHA256 keyed by the secret's UTF-8 bytes:

- ``"ductor"``: ``X-Ductor-Signature: t=<unix time>,v1=<hex>`` over ``"<t>.<body>"``, the time
  within ``REPLAY_WINDOW_S`` of this process's clock, before or after;
- ``"stripe"``: the same scheme under Stripe's own header, ``Stripe-Signature`` (its ``v0=``
  entries are ignored);
- ``"github"``: ``X-Hub-Signature-256: sha256=<hex>`` over the body alone. It carries no time,
  so a replayed delivery is stopped only by being the same delivery (docs/webhooks.md).

A header may carry several ``v1=`` signatures (a sender rotating its secret signs with both):
each is compared in constant time, all of them every time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum

from .. import limits
from ..errors import DefinitionError
from .paths import SECRET_PREFIX, parse_body_path, secret_name_problem


class Scheme(StrEnum):
    """How a hook's deliveries are signed."""

    #: ``X-Ductor-Signature: t=<unix time>,v1=<hex HMAC-SHA256 of "<t>.<body>">``
    DUCTOR = "ductor"
    #: ``Stripe-Signature``: the same scheme (Stripe's own), ``v0=`` entries ignored
    STRIPE = "stripe"
    #: ``X-Hub-Signature-256: sha256=<hex HMAC-SHA256 of the body>``: no time, no window
    GITHUB = "github"


SIGNATURE_HEADERS = {
    Scheme.DUCTOR: "X-Ductor-Signature",
    Scheme.STRIPE: "Stripe-Signature",
    Scheme.GITHUB: "X-Hub-Signature-256",
}
#: How far a signature's time may be from this process's clock, before or after.
REPLAY_WINDOW_S = 300
_UNIX_TIME = re.compile(r"\d{1,12}")


class BadSignature(Exception):
    """A delivery whose signature is missing, malformed, out of its time window or wrong:
    answered with 401, and nothing is written."""


@dataclass(frozen=True, slots=True)
class Webhook:
    """A registered hook (``ductor.webhook``): exactly one of ``workflow`` and ``signal``."""

    name: str
    #: The secret's name: ``secret="$.secret.<name>"`` as registered.
    secret: str
    scheme: Scheme
    workflow: str | None = None
    #: A start hook's path to the run's workflow id (and the delivery's id), or None.
    workflow_id: str | None = None
    signal: str | None = None
    #: A signal hook's path to the run id or workflow id the signal goes to.
    target: str | None = None


def _id_or_problem(value: object, what: str) -> str:
    problem = limits.id_problem(value)
    if problem is not None:
        raise DefinitionError(f"{what} {problem}")
    assert isinstance(value, str)
    return value


def webhook(
    name: object,
    workflow: object = None,
    *,
    secret: object,
    workflow_id: object = None,
    signal: object = None,
    target: object = None,
    scheme: object = Scheme.DUCTOR,
) -> Webhook:
    """A hook checked whole: DefinitionError naming the problem (never a secret's value)."""
    name = _id_or_problem(name, "webhook name")
    what = f"webhook {name!r}"
    if (workflow is None) == (signal is None):
        raise DefinitionError(
            f"{what} takes exactly one of workflow= (start a run) and signal= (signal a run)"
        )
    if scheme not in tuple(Scheme):
        raise DefinitionError(
            f"{what}: unknown scheme {limits.show(scheme)} (one of: {', '.join(Scheme)})"
        )
    if not isinstance(secret, str) or not secret.startswith(SECRET_PREFIX):
        # Never shown: a literal here is most likely the secret itself.
        raise DefinitionError(
            f"{what}: secret= must be a reference '{SECRET_PREFIX}<name>' (its value is read "
            "from ductor_secret_provider when a delivery arrives), not the secret itself"
        )
    secret_name = secret[len(SECRET_PREFIX) :]
    problem = secret_name_problem(secret_name)
    if problem is not None:
        raise DefinitionError(f"{what}: {problem}")
    if workflow is not None:
        return Webhook(
            name=name,
            secret=secret_name,
            scheme=Scheme(str(scheme)),
            workflow=_id_or_problem(workflow, f"{what}: workflow"),
            workflow_id=_start_path(what, workflow_id, target),
        )
    signal = _id_or_problem(signal, f"{what}: signal")
    if signal.startswith("ductor."):
        raise DefinitionError(
            f"{what}: invalid signal name {signal!r} (names starting 'ductor.' are reserved)"
        )
    return Webhook(
        name=name,
        secret=secret_name,
        scheme=Scheme(str(scheme)),
        signal=signal,
        target=_signal_path(what, workflow_id, target),
    )


def _start_path(what: str, workflow_id: object, target: object) -> str | None:
    """A start hook's ``workflow_id`` path (optional)."""
    if target is not None:
        raise DefinitionError(f"{what}: target= is for a signal hook (signal=), not a start")
    if workflow_id is None:
        return None
    parse_body_path(workflow_id, f"{what}: workflow_id")
    assert isinstance(workflow_id, str)
    return workflow_id


def _signal_path(what: str, workflow_id: object, target: object) -> str:
    """A signal hook's ``target`` path (required)."""
    if workflow_id is not None:
        raise DefinitionError(
            f"{what}: workflow_id= is for a start hook (workflow=); a signal hook's "
            "deliveries are told apart by their body's SHA-256"
        )
    if target is None:
        raise DefinitionError(
            f"{what}: a signal hook needs target=, the path of the run id or workflow id "
            "to signal, such as '$.body.order'"
        )
    parse_body_path(target, f"{what}: target")
    assert isinstance(target, str)
    return target


class Webhooks:
    """The hooks registered in this process, by name."""

    def __init__(self) -> None:
        self._hooks: dict[str, Webhook] = {}

    def add(self, hook: Webhook) -> Webhook:
        """Register ``hook``; the same definition again is a no-op (a module imported twice),
        another one under a registered name is a DefinitionError."""
        known = self._hooks.get(hook.name)
        if known is not None and known != hook:
            raise DefinitionError(f"a different webhook named {hook.name!r} is registered")
        self._hooks[hook.name] = hook
        return hook

    def get(self, name: str) -> Webhook | None:
        return self._hooks.get(name)

    def __iter__(self) -> Iterator[Webhook]:
        return iter(list(self._hooks.values()))


# -- signatures ----------------------------------------------------------------------------------


def _header(headers: Mapping[str, str], name: str) -> str | None:
    wanted = name.lower()
    for key, value in headers.items():
        if key.lower() == wanted:
            return value
    return None


def _mac(secret: str, message: bytes) -> bytes:
    return hmac.new(secret.encode("utf-8"), message, hashlib.sha256).hexdigest().encode()


def _timed(header: str, name: str, now: float) -> tuple[str, list[str]]:
    """A ``t=...,v1=...`` header's time (checked against the window) and its signatures."""
    times: list[str] = []
    signatures: list[str] = []
    for item in header.split(","):
        key, _, value = item.strip().partition("=")
        if key == "t":
            times.append(value.strip())
        elif key == "v1":
            signatures.append(value.strip())
    if len(times) != 1 or not _UNIX_TIME.fullmatch(times[0]) or not signatures:
        raise BadSignature(
            f"the {name} header must read 't=<unix time>,v1=<hex HMAC-SHA256 of \"<t>.<body>\">'"
        )
    off = now - int(times[0])
    if abs(off) > REPLAY_WINDOW_S:
        when = "old" if off > 0 else "ahead of this server's clock"
        raise BadSignature(
            f"the {name} header's time is {abs(off):.0f} s {when}: a signature is accepted "
            f"within {REPLAY_WINDOW_S} s of it (a replay, or a sender's clock that is off)"
        )
    return times[0], signatures


def verify(
    hook: Webhook,
    headers: Mapping[str, str],
    body: bytes,
    secret: Callable[[], str],
    now: float,
) -> None:
    """Check a delivery's signature (``secret`` is asked only once the header is well-formed
    and in its window); BadSignature naming what is wrong otherwise."""
    name = SIGNATURE_HEADERS[hook.scheme]
    header = _header(headers, name)
    if header is None:
        raise BadSignature(f"the {name} header is missing")
    if hook.scheme == Scheme.GITHUB:
        algorithm, _, given = header.strip().partition("=")
        if algorithm != "sha256" or not given:
            raise BadSignature(f"the {name} header must read 'sha256=<hex HMAC-SHA256 of body>'")
        signatures, message = [given], body
    else:
        stamp, signatures = _timed(header, name, now)
        message = stamp.encode() + b"." + body
    expected = _mac(secret(), message)
    # Every candidate is compared, whatever the first one gave: no timing tells which failed.
    matches = [
        hmac.compare_digest(expected, s.lower().encode("utf-8", "replace")) for s in signatures
    ]
    if not any(matches):
        raise BadSignature(f"the {name} signature does not match the body")


def sign(secret: str, body: bytes, now: float, scheme: Scheme | str = Scheme.DUCTOR) -> str:
    """The signature header's value a sender computes (for tests, relays and scripts)."""
    if Scheme(scheme) == Scheme.GITHUB:
        return "sha256=" + _mac(secret, body).decode()
    stamp = str(int(now))
    return f"t={stamp},v1={_mac(secret, stamp.encode() + b'.' + body).decode()}"
