"""``POST /hooks/{name}``: a signed delivery of a registered webhook (definition/webhooks.py)
starts or signals a run, once per delivery. No bearer token: the signature is the credential.

``receive`` does one delivery, in this order, and writes nothing before the last step:

1. the signature header: present, well-formed, its time within the replay window, else
   ``BadSignature`` (401);
2. the secret, read from ``ductor_secret_provider`` when a delivery needs it, then kept in
   this process's memory for ``SECRET_TTL_S`` (``HookSecrets``: a flood of forged deliveries
   asks the provider once per secret per window, never once per request; never written):
   one the provider does not have, or cannot give (down, empty, not UTF-8 text), is
   ``HookSecretUnavailable`` (503: the sender retries, and the console's log says which
   secret and why);
3. the HMAC, compared in constant time, else ``BadSignature`` (401).

Until the delivery is authenticated the answer is one of ours, never an exception's text:
anything else that goes wrong in steps 1..3 is logged and answered 500 without it.

4. the body: a JSON object (depth, size and numbers checked as every console body is), a
   string (or an integer) at each of the hook's paths, else ``BadDelivery`` (400);
5. the start or the signal, at most once per delivery: ``Client.start_request`` /
   ``signal_request`` keyed ``hook:<name>`` and the delivery's id (the value at the
   ``workflow_id`` path; without one, and for a signal hook, the SHA-256 of the raw body),
   whose ``eec_start_request`` row commits with the run or the signal
   (store/start_requests.py). A repeat answers 200 and does nothing. A database that cannot
   be reached within ``REQUEST_RETRY_S`` is answered 503 (console.py), its text logged only.

Only the few inserts of step 5 happen in the request: the run's work is the workers'.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from time import monotonic
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import limits
from ..client import Client
from ..definition.paths import parse_body_path, read_body
from ..definition.webhooks import BadSignature, Webhook, verify
from ..engine.kinds import AuditSource
from ..errors import SecretNotFound
from ..runtime.secrets import AttemptSecrets, SecretUnavailable
from ..store.audit import acting_as
from ..store.db import retry_deadline
from ..store.start_requests import RequestKey
from .actions import json_body
from .console import REQUEST_RETRY_S, Console, message_of, status_of

log = logging.getLogger("ductor_celery.web")

#: What a 401 asks for: a signed request, not a bearer token (RFC 9110 wants the header).
SIGNATURE_CHALLENGE = {"www-authenticate": 'HMAC-SHA256 realm="ductor-webhook"'}
#: How long a hook's secret, as the provider gave it (or failed to), is kept in this process.
SECRET_TTL_S = 5.0


class BadDelivery(ValueError):
    """A correctly signed delivery the hook cannot use (a body that is no JSON object, no
    usable value at one of the hook's paths): answered with 400, and nothing is written."""


class HookSecretUnavailable(Exception):
    """The hook's secret cannot be read now (the provider has none, or failed): answered with
    503, so the sender retries later. The message names the secret, never a value."""


class NotVerified(Exception):
    """Checking a delivery's signature failed on something else than the delivery or the
    secret's availability (a bug): answered with 500 and no text, the error logged."""


def read_secret(provider: Any, name: str) -> str:
    """The secret's value from ``ductor_secret_provider``, as a step reads one (its value is
    redacted from this process's log lines from now on); HookSecretUnavailable otherwise."""
    try:
        value = AttemptSecrets(provider).get(name)
    except (SecretNotFound, SecretUnavailable) as exc:
        raise HookSecretUnavailable(str(exc)) from None
    if not value:
        raise HookSecretUnavailable(f"secret {name!r} is empty: no signature can be checked")
    try:
        value.encode("utf-8")  # the HMAC's key: its UTF-8 bytes
    except UnicodeEncodeError:
        # An environment variable that is not UTF-8 (read with surrogateescape): say which
        # secret, never where in it or what character.
        raise HookSecretUnavailable(
            f"secret {name!r} is not UTF-8 text (a lone surrogate: set from bytes that are "
            "not UTF-8?): no signature can be checked"
        ) from None
    return value


class HookSecrets:
    """The hooks' secrets, each read from the provider when a delivery needs it and kept for
    ``ttl`` seconds (``SECRET_TTL_S``), its failure too: any well-formed signature header, a
    forged one included, needs the secret, and a flood of them must not become a flood of
    calls to a remote vault. Thread-safe; one call to the provider at a time per secret (the
    deliveries that need it meanwhile wait for that one)."""

    def __init__(self, provider: Any, ttl: float = SECRET_TTL_S) -> None:
        self._provider = provider
        self._ttl = ttl
        self._lock = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        #: By secret name: until when (``monotonic()``), and the value or why there is none.
        self._known: dict[str, tuple[float, str | HookSecretUnavailable]] = {}

    def get(self, name: str) -> str:
        """The secret's value; HookSecretUnavailable as ``read_secret`` says."""
        with self._lock:
            lock = self._locks.setdefault(name, threading.Lock())
        with lock:
            found = self._known.get(name)
            if found is None or monotonic() >= found[0]:
                result: str | HookSecretUnavailable
                try:
                    result = read_secret(self._provider, name)
                except HookSecretUnavailable as exc:
                    result = exc
                found = self._known[name] = (monotonic() + self._ttl, result)
        if isinstance(found[1], HookSecretUnavailable):
            raise HookSecretUnavailable(str(found[1]))
        return found[1]


def authenticate(
    hook: Webhook, headers: Mapping[str, str], body: bytes, secrets: HookSecrets, now: float
) -> None:
    """Steps 1..3: BadSignature and HookSecretUnavailable as they are; anything else raised
    on the way is logged and becomes NotVerified (no exception's text reaches a sender that
    has not shown it has the secret)."""
    try:
        verify(hook, headers, body, lambda: secrets.get(hook.secret), now)
    except (BadSignature, HookSecretUnavailable):
        raise
    except Exception:
        log.exception("webhook %r: checking a delivery's signature failed", hook.name)
        raise NotVerified from None


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    return _JSON_TYPES.get(type(value), "a number")


def json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object (read as every console body is); a ValueError naming the
    problem otherwise."""
    value = json_body(body)
    if not isinstance(value, dict):
        raise BadDelivery(f"the body must be a JSON object, got {_json_type(value)}")
    return value


def id_at(body: dict[str, Any], path: str, what: str) -> str:
    """The string (or integer, as its digits) at a hook's path: an id of 1..200 characters."""
    value = read_body(body, parse_body_path(path, what))
    if value is None:
        raise BadDelivery(f"the body has no {what} at {path}")
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise BadDelivery(f"the {what} at {path} must be a string, got {_json_type(value)}")
    problem = limits.id_problem(value)
    if problem is not None:
        raise BadDelivery(f"the {what} at {path} {problem}")
    return value


@dataclass(frozen=True, slots=True)
class Delivery:
    """What a delivery did: the run it started or signalled; ``created``: False for a repeat."""

    starts: bool
    run_id: str
    workflow_id: str
    created: bool
    signal_id: int | None = None

    def as_json(self) -> dict[str, Any]:
        found: dict[str, Any] = {"run_id": self.run_id, "workflow_id": self.workflow_id}
        if not self.starts:
            found["signal_id"] = self.signal_id
        return found


def receive(
    client: Client,
    hook: Webhook,
    body: bytes,
    headers: Mapping[str, str],
    *,
    now: float,
    secrets: HookSecrets,
) -> Delivery:
    """One delivery of ``hook`` (the module docstring's steps); ``secrets``: the hooks'
    secrets, from the ``ductor_secret_provider`` setting. The audit entry of what it does:
    actor the hook's name, source ``web``."""
    authenticate(hook, headers, body, secrets, now)
    value = json_object(body)
    digest = hashlib.sha256(body).hexdigest()
    with acting_as(AuditSource.WEB), retry_deadline(REQUEST_RETRY_S):
        if hook.workflow is not None:
            workflow_id = None
            if hook.workflow_id is not None:
                workflow_id = id_at(value, hook.workflow_id, "workflow id")
            request = RequestKey.hook(hook.name, workflow_id or digest)
            handle, created = client.start_request(
                request, hook.workflow, value, workflow_id, by=hook.name
            )
            return Delivery(True, handle.run_id, handle.workflow_id, created)
        assert hook.signal is not None and hook.target is not None
        target = id_at(value, hook.target, "target")
        found, created = client.signal_request(
            RequestKey.hook(hook.name, digest), target, hook.signal, value, by=hook.name
        )
        return Delivery(False, found.run_id, found.workflow_id, created, found.signal_id)


def routes(console: Console) -> list[Route]:
    d = console.ductor
    secrets = HookSecrets(d.settings.secret_provider)

    async def deliver(request: Request) -> Response:
        name = request.path_params["name"]
        hook = d.webhooks.get(name)
        if hook is None:
            return JSONResponse({"error": f"no webhook named {limits.show(name)}"}, 404)
        try:
            body = await console.body(request)
            done = await run_in_threadpool(
                receive,
                d.client,
                hook,
                body,
                request.headers,
                now=time.time(),
                secrets=secrets,
            )
        except BadSignature as exc:
            return JSONResponse({"error": str(exc)}, 401, headers=SIGNATURE_CHALLENGE)
        except HookSecretUnavailable as exc:
            log.warning("webhook %r refused a delivery: %s", hook.name, exc)
            return JSONResponse(
                {"error": "the webhook's secret is not available (see the console's log)"}, 503
            )
        except NotVerified:
            return JSONResponse(
                {"error": "the delivery's signature could not be checked (see the console's log)"},
                500,
            )
        except Exception as exc:  # noqa: BLE001 - status_of re-raises what is not ours
            return JSONResponse({"error": message_of(exc)}, status_of(exc))
        if not done.created:
            code = 200
        else:
            code = 201 if done.starts else 202
        return JSONResponse(done.as_json(), code)

    return [Route("/hooks/{name:path}", deliver, methods=["POST"])]
