"""What every route of the console shares: the Ductor it reads and acts through, its tokens,
its templates, and the answers to ductor's errors."""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass, field
from datetime import datetime
from importlib import resources
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote

from jinja2 import Environment, FileSystemLoader
from sqlalchemy.engine import Engine
from starlette.requests import Request

from ..errors import (
    DuctorError,
    InvalidOperation,
    PayloadTooLarge,
    RunNotFound,
    StoreUnavailable,
    WorkflowNotFound,
)
from ..store.db import brief
from .auth import Forbidden, Unauthenticated
from .layout import Layout, graph_nodes, layout
from .params import BadRequest
from .tokens import TokenSet

if TYPE_CHECKING:
    from ..definition.spec import WorkflowSpec
    from ..ductor import Ductor

log = logging.getLogger("ductor_celery.web")

PACKAGE = resources.files("ductor_celery.web")
#: The largest request body read: a payload at the limit, JSON-escaped, with room to spare.
BODY_SLACK = 64 * 1024
#: How long a request that someone outside waits on (a webhook's delivery, an HTTP start)
#: rides out a database outage (``store.db.retry_deadline``) before it is answered 503: the
#: sender retries later, where 120 s of retries would outlast its own timeout (GitHub: 10 s).
REQUEST_RETRY_S = 5.0
#: What a caller is told when the database cannot be reached: the driver's text (hosts, ports,
#: users, the statement) goes to the console's log only.
STORE_UNAVAILABLE = "the database is not available now: try again later"


def status_of(exc: BaseException) -> int:
    """The HTTP status of an error a client call (or a check of ours) raised."""
    if isinstance(exc, Unauthenticated):
        return 401
    if isinstance(exc, Forbidden):
        return 403
    if isinstance(exc, InvalidOperation):
        return 409
    if isinstance(exc, RunNotFound | WorkflowNotFound):
        return 404
    if isinstance(exc, PayloadTooLarge):
        return 413
    if isinstance(exc, StoreUnavailable):
        return 503
    if isinstance(exc, BadRequest | DuctorError | TypeError | ValueError | RecursionError):
        return 400
    raise exc


def message_of(exc: BaseException) -> str:
    """The error's message on one line; for ``StoreUnavailable``, ``STORE_UNAVAILABLE`` (the
    error itself is logged here instead: it is the driver's text)."""
    if isinstance(exc, StoreUnavailable):
        log.error("answered %s: %s", STORE_UNAVAILABLE, brief(exc))
        return STORE_UNAVAILABLE
    text = "; ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
    return text or exc.__class__.__name__


def when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else ""


def duration(start: datetime | None, end: datetime | None) -> str:
    if start is None or end is None:
        return ""
    seconds = (end - start).total_seconds()
    return f"{seconds:.3f}s" if seconds < 60 else f"{seconds / 60:.1f}min"


def pretty(value: Any, limit: int = 20_000) -> str:
    """A JSON value for a <pre>, cut at ``limit`` characters (the JSON API has all of it)."""
    text = json.dumps(value, indent=2, sort_keys=False, default=str, ensure_ascii=False)
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n… ({len(text) - limit} more characters: see the JSON API)"


def short(value: Any, width: int = 80) -> str:
    if value is None:
        return ""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= width else text[: width - 1] + "…"


@dataclass
class Console:
    ductor: Ductor
    #: Who may read and act (empty: nobody acts, the console is read-only).
    tokens: TokenSet
    flower_url: str | None
    poll_interval: float
    #: Reads (pages, the JSON API, /metrics) need a token too (auth.ReadGate).
    auth_reads: bool = False
    env: Environment = field(init=False)
    #: Keys what a session keeps of its token (auth.fingerprint); made per process, like the
    #: session cookie's signing key, and never sent anywhere.
    session_key: bytes = field(default_factory=lambda: secrets.token_bytes(32), init=False)
    _layouts: dict[str, Layout] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.env = Environment(
            loader=FileSystemLoader(str(PACKAGE / "templates")),
            autoescape=True,  # every template is HTML, whatever its name
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.filters.update(when=when, pretty=pretty, short=short)
        self.env.globals.update(duration=duration, quote=quote)

    @property
    def engine(self) -> Engine:
        return self.ductor.client.engine

    @property
    def read_only(self) -> bool:
        return not self.tokens

    @property
    def max_body(self) -> int:
        return 2 * self.ductor.settings.max_payload_bytes + BODY_SLACK

    def layout_of(self, spec: WorkflowSpec) -> Layout:
        """The graph's layout, computed once per definition (specs never change)."""
        found = self._layouts.get(spec.spec_hash)
        if found is None:
            found = self._layouts[spec.spec_hash] = layout(graph_nodes(spec))
        return found

    def flower_link(self, token: str) -> str | None:
        if not self.flower_url:
            return None
        return f"{self.flower_url.rstrip('/')}/task/{quote(token, safe='')}"

    def render(self, name: str, **context: Any) -> str:
        return self.env.get_template(name).render(console=self, **context)

    async def body(self, request: Request) -> bytes:
        """The request body, refused (413) past ``max_body`` without reading all of it."""
        size = request.headers.get("content-length", "")
        if size.isdigit() and int(size) > self.max_body:
            raise PayloadTooLarge(f"the request body is {size} bytes (at most {self.max_body})")
        chunks, total = [], 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > self.max_body:
                raise PayloadTooLarge(f"the request body is over {self.max_body} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def form(self, request: Request) -> dict[str, str]:
        """An ``application/x-www-form-urlencoded`` body (the pages' forms)."""
        raw = await self.body(request)
        try:
            pairs = parse_qsl(
                raw.decode("utf-8"), keep_blank_values=True, max_num_fields=50, errors="strict"
            )
        except (UnicodeDecodeError, ValueError) as exc:
            raise BadRequest(f"the form is not valid: {message_of(exc)}") from None
        return dict(pairs)
