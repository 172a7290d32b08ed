"""ductor's settings, read from a Celery app's configuration (lowercase ``ductor_*`` keys)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .engine.inputs import EngineConfig
from .limits import MAX_DURATION_S

EMBEDDED_DATABASE_URL = "sqlite:///.ductor/ductor.sqlite3"


@dataclass(frozen=True, slots=True)
class Settings:
    database_url: str = EMBEDDED_DATABASE_URL
    #: The connection ``Client.wait`` LISTENs on (``None``: ``database_url``). Behind a
    #: transaction-pooling PgBouncer, a direct URL to PostgreSQL: LISTEN is session state.
    listen_database_url: str | None = None
    #: Let psycopg prepare statements on the server after a few executions (faster on a direct
    #: connection). False behind PgBouncer in transaction pooling mode before 1.21 (without
    #: ``max_prepared_statements``): a prepared statement is session state, and the next
    #: transaction may run on another server connection.
    database_prepare: bool = True
    steps_queue: str = "ductor-steps"
    coord_queue: str = "ductor-coord"
    sweep_interval: float = 1.0
    default_step_timeout: float = 300.0
    resend_unclaimed_after: float = 30.0
    max_payload_bytes: int = 1_048_576
    max_transitions: int = 10_000
    #: Outbox rows older than this are considered abandoned by their dispatcher.
    outbox_grace: float = 2.0
    #: A step worker that has written an outcome runs its run's tick itself when no other tick
    #: of the run is in progress; otherwise (and always when False) the coordinator does.
    eager_ticks: bool = True
    #: With eager ticks, a step worker runs up to this many of a run's next steps itself, one
    #: after another, instead of sending each through the broker (runtime/inline.py); 0: off.
    inline_steps: int = 50
    #: Each ductor worker serves Prometheus metrics on this port (runtime/metrics.py); None: off.
    metrics_port: int | None = None
    #: The address it binds: every interface, as Prometheus exporters do (no run data in it).
    metrics_host: str = "0.0.0.0"
    #: The sweeper prunes finished runs older than this many days (``None``: keep everything).
    retention_days: float | None = None
    #: The sweeper deletes audit entries older than this many days (``None``: keep them); an
    #: entry of a pruned run goes with it, unless it records a bulk action.
    audit_retention_days: float | None = 365.0
    #: Dotted path to a callable ``name -> str`` resolving ``$.secret.<name>`` and
    #: ``ctx.secret(name)`` in the step worker (or the callable itself, set in this process);
    #: ``None``: ``DUCTOR_SECRET_<NAME>`` env vars.
    secret_provider: str | Callable[[str], Any] | None = None
    #: A cancelled run's attempts in flight get this many seconds to stop on their own
    #: (``ctx.cancelled``, ``StepCancelled``) before they are closed.
    cancel_grace: float = 30.0
    #: On RabbitMQ, declare ductor's queues as classic queues (with ``x-max-priority``) instead
    #: of quorum queues (runtime/broker.py). No effect on Redis.
    classic_queues: bool = False

    @property
    def embedded(self) -> bool:
        return self.database_url.startswith("sqlite")

    @property
    def listen_url(self) -> str:
        """Where ``wait()`` listens: ``listen_database_url``, else ``database_url``."""
        return self.listen_database_url or self.database_url

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            resend_unclaimed_after=self.resend_unclaimed_after,
            default_step_timeout=self.default_step_timeout,
            max_payload_bytes=self.max_payload_bytes,
            max_transitions=self.max_transitions,
            cancel_grace=self.cancel_grace,
        )

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any], database_url: str | None = None) -> Settings:
        """Database URL, first found wins: argument, ``ductor_database_url``, env, embedded."""
        url = (
            database_url
            or conf.get("ductor_database_url")
            or os.environ.get("DUCTOR_DATABASE_URL")
            or EMBEDDED_DATABASE_URL
        )
        listen_url = conf.get("ductor_listen_database_url") or os.environ.get(
            "DUCTOR_LISTEN_DATABASE_URL"
        )
        prepare = conf.get("ductor_database_prepare")
        if prepare is None:
            prepare = os.environ.get("DUCTOR_DATABASE_PREPARE") or None
        defaults = cls()

        def get(key: str, default: Any, kind: Callable[[Any], Any]) -> Any:
            value = conf.get(f"ductor_{key}")
            return default if value is None else kind(value)

        return cls(
            database_url=normalize_url(str(url)),
            listen_database_url=normalize_url(str(listen_url)) if listen_url else None,
            database_prepare=defaults.database_prepare if prepare is None else _flag(prepare),
            steps_queue=get("steps_queue", defaults.steps_queue, str),
            coord_queue=get("coord_queue", defaults.coord_queue, str),
            sweep_interval=get("sweep_interval", defaults.sweep_interval, float),
            default_step_timeout=get("default_step_timeout", defaults.default_step_timeout, float),
            resend_unclaimed_after=get(
                "resend_unclaimed_after", defaults.resend_unclaimed_after, float
            ),
            max_payload_bytes=get("max_payload_bytes", defaults.max_payload_bytes, int),
            max_transitions=get("max_transitions", defaults.max_transitions, int),
            outbox_grace=get("outbox_grace", defaults.outbox_grace, float),
            eager_ticks=get("eager_ticks", defaults.eager_ticks, _flag),
            inline_steps=get("inline_steps", defaults.inline_steps, _count("inline_steps")),
            metrics_port=get("metrics_port", defaults.metrics_port, _port("metrics_port")),
            metrics_host=get("metrics_host", defaults.metrics_host, str),
            retention_days=get("retention_days", defaults.retention_days, _days),
            # Set to None on purpose (not merely unset): keep every entry.
            audit_retention_days=(
                None
                if "ductor_audit_retention_days" in conf
                and conf.get("ductor_audit_retention_days") is None
                else get(
                    "audit_retention_days",
                    defaults.audit_retention_days,
                    lambda v: _days(v, "ductor_audit_retention_days"),
                )
            ),
            secret_provider=get("secret_provider", defaults.secret_provider, _provider),
            cancel_grace=get("cancel_grace", defaults.cancel_grace, _grace),
            classic_queues=_classic_queues(conf, defaults.classic_queues),
        )


def _classic_queues(conf: Mapping[str, Any], default: bool) -> bool:
    """``ductor_classic_queues``, else ``DUCTOR_CLASSIC_QUEUES`` from the environment."""
    value = conf.get("ductor_classic_queues")
    if value is None:
        value = os.environ.get("DUCTOR_CLASSIC_QUEUES") or None
    if value is None:
        return default
    try:
        return _flag(value)
    except ValueError:
        raise ValueError(
            f"ductor_classic_queues (or DUCTOR_CLASSIC_QUEUES) must be true or false, got {value!r}"
        ) from None


def _provider(value: Any) -> str | Callable[[str], Any]:
    """A dotted path to a callable, or the callable itself (a config module can hold either)."""
    if callable(value):
        return value  # type: ignore[no-any-return]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(
            f"ductor_secret_provider must be a dotted path such as 'pkg.module:function' or a "
            f"callable, got {value!r}"
        )
    return value.strip()


def _flag(value: Any) -> bool:
    """A boolean setting: True/False, or the strings Celery users write in env-driven configs."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"a ductor flag setting must be true or false, got {value!r}")


def _days(value: Any, name: str = "ductor_retention_days") -> float:
    """A retention: a positive number of days (a string from an env config too)."""
    try:
        days = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        days = math.nan
    # At most ten years, like every duration (limits.MAX_DURATION_S): the sweeper computes
    # "now - days" on every pass, and 1e12 days would overflow it on every pass.
    if not math.isfinite(days) or not 0 < days <= MAX_DURATION_S / 86400:
        raise ValueError(
            f"{name} must be a positive number of days up to "
            f"{MAX_DURATION_S / 86400:.0f} (ten years), or None; got {value!r}"
        )
    return days


def _grace(value: Any) -> float:
    """``ductor_cancel_grace``: seconds, 0 or more (0: close attempts at once, as before)."""
    try:
        seconds = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        seconds = math.nan
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_DURATION_S:
        raise ValueError(
            f"ductor_cancel_grace must be a number of seconds from 0 to {MAX_DURATION_S:.0f} "
            f"(ten years); got {value!r}"
        )
    return seconds


def _count(key: str) -> Callable[[Any], int]:
    """A whole number setting, 0 or more; ``True``/``False`` read as 1/0 would hide a typo."""

    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError(f"ductor_{key} must be a whole number, 0 or more; got {value!r}")
        try:
            number = int(value)
        except ValueError:
            raise ValueError(
                f"ductor_{key} must be a whole number, 0 or more; got {value!r}"
            ) from None
        if number < 0:
            raise ValueError(f"ductor_{key} must be a whole number, 0 or more; got {value!r}")
        return number

    return parse


def _port(key: str) -> Callable[[Any], int]:
    """A TCP port setting, 1..65535 (0, "any free port", would leave nothing to scrape)."""

    def parse(value: Any) -> int:
        number = _count(key)(value)
        if not 1 <= number <= 65535:
            raise ValueError(f"ductor_{key} must be a port number, 1 to 65535; got {value!r}")
        return number

    return parse


def redact_url(url: str) -> str:
    """The URL for a message or a log line: the password replaced by ``***``."""
    import sqlalchemy as sa

    return sa.engine.make_url(url).render_as_string(hide_password=True)


def normalize_url(url: str) -> str:
    """``postgresql://`` and ``postgres://`` mean psycopg 3 to us."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url
