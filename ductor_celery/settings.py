"""ductor's settings, read from a Celery app's configuration (lowercase ``ductor_*`` keys)."""

from __future__ import annotations

import math
import os
import re
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
    #: The largest single value (an input, a payload, a step's result) once serialized.
    max_payload_bytes: int = 67_108_864
    #: A value larger than this once serialized is stored in ``eec_blob`` and travels by
    #: reference (docs/large-values.md); smaller ones stay inline in their row.
    offload_bytes: int = 262_144
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
            offload_bytes=self.offload_bytes,
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
            listen_database_url=(
                normalize_url(str(listen_url), "ductor_listen_database_url") if listen_url else None
            ),
            database_prepare=defaults.database_prepare if prepare is None else _flag(prepare),
            steps_queue=get("steps_queue", defaults.steps_queue, str),
            coord_queue=get("coord_queue", defaults.coord_queue, str),
            sweep_interval=get("sweep_interval", defaults.sweep_interval, float),
            default_step_timeout=get("default_step_timeout", defaults.default_step_timeout, float),
            resend_unclaimed_after=get(
                "resend_unclaimed_after", defaults.resend_unclaimed_after, float
            ),
            max_payload_bytes=get("max_payload_bytes", defaults.max_payload_bytes, int),
            offload_bytes=get("offload_bytes", defaults.offload_bytes, int),
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


def normalize_url(url: str, setting: str = "ductor_database_url") -> str:
    """``postgresql://`` and ``postgres://`` mean psycopg 3 to us; several hosts are written
    in the one form SQLAlchemy and libpq both read (``multi_host_url``). ``setting``: the
    setting the URL came from, named in the error a bad URL raises."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            url = "postgresql+psycopg://" + url[len(prefix) :]
            break
    if url.startswith("postgresql"):
        url = multi_host_url(url, setting)
    return url


# --- several database hosts (a primary and its standbys; docs/reliability.md) ---------------
#
# libpq reads ``postgresql://u@h1:5432,h2:5433/db``: try each host in turn, and with
# ``target_session_attrs=read-write`` keep only the one that accepts writes, so after a
# failover every new connection finds the new primary by itself. SQLAlchemy cannot parse a
# port in such a host list (it reads "5432,h2:5433" as the port), and renders its own
# multi-host form (``?host=h1:5432&host=h2``) into a broken list for an IPv6 address. So a URL
# naming several hosts is rewritten into query parameters both pass through unchanged:
# ``postgresql+psycopg://u@/db?host=h1,h2&port=5432,5433`` (an empty port: libpq's default).

#: The authority of a URL as SQLAlchemy splits it (user, then password up to the "@"), the
#: hosts up to the path or query, and the rest.
_AUTHORITY = re.compile(
    r"(?P<head>[\w+]+://(?:[^:/]*(?::[^@]*)?@)?)(?P<hosts>[^/?]*)(?P<tail>.*)\Z", re.S
)
#: ``target_session_attrs`` values that always land on a server that takes writes.
_WRITABLE_SESSION_ATTRS = ("read-write", "primary")


def multi_host_url(url: str, setting: str = "ductor_database_url") -> str:
    """``url`` with several hosts (``h1:p1,h2:p2`` after the "@") rewritten as
    ``?host=h1,h2&port=p1,p2``, and ``target_session_attrs=read-write`` added when several
    hosts are named and the URL does not choose: libpq's default ("any") would take the first
    host that answers, a standby after a failover, where every write fails. A URL with one
    host is returned as it is. Raises ``ValueError`` naming ``setting`` for an empty host, a
    port that is not a number from 1 to 65535, or a host list given twice."""
    import sqlalchemy as sa

    match = _AUTHORITY.match(url)
    if match is not None and "," in match["hosts"]:
        hosts, ports = _split_hosts(match["hosts"], setting)
        path, _, query = match["tail"].partition("?")
        parsed = sa.engine.make_url(f"{match['head']}{path}" + (f"?{query}" if query else ""))
        if "host" in parsed.query or "port" in parsed.query:
            raise ValueError(
                f"{setting} names its hosts twice: in the address ({match['hosts']!r}) and as "
                "host= or port= parameters; keep one of them"
            )
        extra = {"host": ",".join(hosts)}
        if any(ports):
            extra["port"] = ",".join(ports)
        url = parsed.update_query_dict(extra).render_as_string(hide_password=False)
    parsed = sa.engine.make_url(url)
    hosts = _query_hosts(parsed, setting)
    if len(hosts) < 2 and (parsed.host is None or "," not in parsed.host):
        return url
    attrs = parsed.query.get("target_session_attrs")
    if attrs is None:
        return parsed.update_query_dict({"target_session_attrs": "read-write"}).render_as_string(
            hide_password=False
        )
    if attrs not in _WRITABLE_SESSION_ATTRS:
        raise ValueError(
            f"{setting} names several hosts with target_session_attrs={attrs!r}: ductor writes, "
            "so a connection must reach the primary; use read-write (the default ductor adds) "
            "or primary"
        )
    return url


def _split_hosts(text: str, setting: str) -> tuple[list[str], list[str]]:
    """``h1:p1,[::1]:p2,h3`` as hosts and ports ("" where none is given), checked."""
    hosts: list[str] = []
    ports: list[str] = []
    entries = text.split(",")
    for number, entry in enumerate(entries, 1):
        where = f"host {number} of {len(entries)} in {text!r}"
        if entry.startswith("["):  # an IPv6 address, with its port after the bracket
            host, bracket, rest = entry[1:].partition("]")
            if not bracket or (rest and not rest.startswith(":")):
                raise ValueError(f"{setting}: {where} is not a bracketed IPv6 address")
            port = rest[1:]
            has_port = bool(rest)
        else:
            host, colon, port = entry.partition(":")
            has_port = bool(colon)
        if not host.strip():
            raise ValueError(f"{setting}: {where} is empty")
        if has_port:
            _check_port(port, setting, where)
        hosts.append(host)
        ports.append(port)
    return hosts, ports


def _query_hosts(parsed: Any, setting: str) -> list[str]:
    """The hosts a URL names as ``host=`` parameters (SQLAlchemy's own multi-host forms
    too), their ports checked."""
    values = parsed.query.get("host", ())
    hosts = [h for v in ((values,) if isinstance(values, str) else values) for h in v.split(",")]
    if len(hosts) > 1 and not all(h.strip() for h in hosts):
        raise ValueError(f"{setting}: an empty host in the host= parameters {hosts!r}")
    port_values = parsed.query.get("port", ())
    for value in (port_values,) if isinstance(port_values, str) else port_values:
        for port in value.split(","):
            if port:
                _check_port(port, setting, f"the port= parameter {value!r}")
    return hosts


def _check_port(port: str, setting: str, where: str) -> None:
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"{setting}: {where} has port {port!r}; a port is a number 1 to 65535")
