"""Secrets by reference: resolved in the step worker just before the call, never stored.

A step's arguments may hold ``"$.secret.<name>"`` (definition/paths.py); the tick stores the
reference as it is, and the worker puts the value in its place only at the places the node's
argument template names (``secret_slots``), then calls the step. ``ctx.secret(name)`` reads
one from inside a step. The value comes from ``ductor_secret_provider``: a dotted path
(``pkg.module:function`` or ``pkg.module.function``) to a callable ``name -> str``; by default
the environment variable ``DUCTOR_SECRET_<NAME>`` (the name upper-cased).

Every value an attempt resolved is replaced by ``***`` in what the attempt writes (its error
and traceback, its result, context patch and heartbeat details) and, for the life of the
process, in every log line its logging handlers emit: in every form a program commonly prints
it (``printed_forms``: itself, the inner text of its ``repr()`` and ``ascii()``, of its JSON
string with and without ``ensure_ascii``, URL-quoted), the longest form first. A form shorter
than ``MIN_REDACTED_ANYWHERE`` characters (a secret of one to three characters) is replaced
only where it stands alone, not touching a letter, digit or ``_``: replacing ``"ab"`` inside
every word would wreck the text it is found in, and a secret that short is guessed anyway.

A secret's name is checked before the provider is asked (``definition.paths.
secret_name_problem``); a bad one fails the attempt without retry (``InvalidSecretName``).

A secret the provider does not have (``KeyError``/``LookupError``, or ``None``) fails the
attempt without retry, naming the secret; a provider that raises anything else (a vault
that is down) fails it with retry.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import quote, quote_plus

from ..definition.paths import secret_name_problem, secret_slots
from ..definition.spec import ScatterNodeSpec, WorkflowSpec
from ..errors import InvalidSecretName, SecretNotFound
from ..payloads import storable_text

REDACTED = "***"

#: A printed form of a secret at least this long is replaced wherever it is found; a shorter
#: one only where it stands alone (not touching a letter, digit or ``_``).
MIN_REDACTED_ANYWHERE = 4

Provider = Callable[[str], Any]
Slots = tuple[tuple[tuple[str | int, ...], str], ...]


#: Secret slots per (definition hash, node): a hash names one definition forever.
_slots: dict[tuple[str, str], Slots] = {}


def slots_for(spec_hash: str, node_id: str, read_spec: Callable[[str], WorkflowSpec]) -> Slots:
    """Where a node's argument template (a scatter's: per branch) holds secret references,
    computed once per definition and node."""
    key = (spec_hash, node_id)
    found = _slots.get(key)
    if found is None:
        node = read_spec(spec_hash).graph.nodes.get(node_id)
        if isinstance(node, ScatterNodeSpec):
            template: Any = node.branch_args()
        else:
            template = getattr(node, "args", None)
        found = _slots[key] = secret_slots(template) if template else ()
    return found


class SecretUnavailable(Exception):
    """The provider failed for another reason than not having the secret (worth a retry)."""


def env_provider(name: str) -> str:
    """The default provider: ``DUCTOR_SECRET_<NAME>``."""
    var = env_var(name)
    value = os.environ.get(var)
    if value is None:
        raise SecretNotFound(
            f"secret {name!r} is not available: the environment variable {var} is not set "
            "in the step worker"
        )
    return value


def env_var(name: str) -> str:
    return f"DUCTOR_SECRET_{name.upper()}"


def check_name(name: object) -> str:
    """``name`` if it may name a secret; else ``InvalidSecretName`` (a ``ValueError`` that
    fails the attempt without retry), naming the problem."""
    problem = secret_name_problem(name)
    if problem is not None:
        raise InvalidSecretName(problem)
    assert isinstance(name, str)
    return name


@functools.cache
def load_provider(path: str | Provider | None) -> Provider:
    """The provider a ``ductor_secret_provider`` setting names (imported once per process)."""
    if not path:
        return env_provider
    if callable(path):
        return path
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ValueError(
            f"ductor_secret_provider must be a dotted path such as 'pkg.module:function', "
            f"got {path!r}"
        )
    found: Any = importlib.import_module(module)
    for part in attr.split("."):
        found = getattr(found, part)
    if not callable(found):
        raise ValueError(f"ductor_secret_provider {path!r} is not callable")
    return found  # type: ignore[no-any-return]


class AttemptSecrets:
    """The secrets one attempt resolved: reads them and redacts what the attempt writes."""

    def __init__(self, provider: str | Provider | None = None) -> None:
        """``provider``: the ``ductor_secret_provider`` setting (a dotted path, a callable, or
        ``None`` for the environment). A path is imported on first use: an attempt that uses
        no secret never loads it, and one that cannot be loaded fails only the attempts that
        need it (with retry: a deploy may fix it)."""
        self._setting = provider
        self._provider: Provider | None = None
        self._values: dict[str, str] = {}
        self._redactor = Redactor(())

    def _call_provider(self, name: str) -> Any:
        if self._provider is None:
            try:
                self._provider = load_provider(self._setting)
            except Exception as exc:  # noqa: BLE001 - a bad path, an import error
                raise SecretUnavailable(
                    f"secret {name!r}: ductor_secret_provider {self._setting!r} cannot be "
                    f"loaded: {type(exc).__name__}: {exc}"
                ) from None
        return self._provider(name)

    def get(self, name: str) -> str:
        """The secret's value: ``InvalidSecretName`` (no retry) for a name that cannot be a
        secret's, ``SecretNotFound`` (no retry) if the provider has none,
        ``SecretUnavailable`` (retry) if it failed otherwise."""
        check_name(name)
        known = self._values.get(name)
        if known is not None:
            return known
        try:
            value = self._call_provider(name)
        except (SecretNotFound, SecretUnavailable):
            raise
        except LookupError:
            raise SecretNotFound(
                f"secret {name!r} is not available from ductor_secret_provider"
            ) from None
        except Exception as exc:  # noqa: BLE001 - a vault that is down, a bug in the provider
            raise SecretUnavailable(
                f"secret {name!r}: the provider raised {type(exc).__name__}: "
                f"{self._redactor.text(str(exc))}"
            ) from None
        if value is None:
            raise SecretNotFound(f"secret {name!r} is not available from ductor_secret_provider")
        if not isinstance(value, str):
            raise SecretUnavailable(
                f"secret {name!r}: the provider returned a {type(value).__name__}, not a str"
            )
        self._values[name] = value
        if value:
            self._redactor = Redactor(self._values.values())
            _remember(value)
        return value

    @property
    def used(self) -> bool:
        return bool(self._values)

    def fill(self, args: dict[str, Any], slots: Slots) -> dict[str, Any]:
        """``args`` with each slot's reference replaced by the secret's value (copied along
        the way: the claimed attempt's arguments are left as they are)."""
        if not slots:
            return args
        filled: Any = dict(args)
        for keys, name in slots:
            filled = _put(filled, keys, f"$.secret.{name}", functools.partial(self.get, name))
        return filled  # type: ignore[no-any-return]

    def redact(self, value: Any) -> Any:
        """``value`` with every printed form of every resolved secret replaced by ``***``
        inside its strings (dict keys too)."""
        return self._redactor.value(value)

    def redact_text(self, text: str) -> str:
        """``text`` with every printed form of every resolved secret replaced by ``***``."""
        return self._redactor.text(text)


def _put(container: Any, keys: tuple[str | int, ...], ref: str, value: Callable[[], str]) -> Any:
    """A copy of ``container`` with the reference at ``keys`` replaced (nothing if absent)."""
    if not keys:
        return value() if container == ref else container
    key, rest = keys[0], keys[1:]
    if isinstance(container, dict) and isinstance(key, str) and key in container:
        copy = dict(container)
        copy[key] = _put(container[key], rest, ref, value)
        return copy
    if isinstance(container, list) and isinstance(key, int) and 0 <= key < len(container):
        items = list(container)
        items[key] = _put(container[key], rest, ref, value)
        return items
    return container


# -- redaction ------------------------------------------------------------------------------------


def _printed(make: Callable[[], str]) -> str:
    try:
        return make()
    except Exception:  # noqa: BLE001 - quote() of a lone surrogate: no program prints that form
        return ""


@functools.lru_cache(maxsize=1024)
def printed_forms(secret: str) -> frozenset[str]:
    """Every way a program commonly prints ``secret``: itself; the inner text of its
    ``repr()`` and ``ascii()`` (``KeyError(secret)``, ``f"{secret!r}"``, a dict printed); of
    its JSON string with and without ``ensure_ascii``; URL-quoted by ``quote`` (with its default
    ``safe='/'`` and with ``safe=''``) and ``quote_plus``; and as ``storable_text`` leaves it in
    an error (NUL and lone surrogates escaped). Never a form ``***`` itself holds."""
    forms = {
        secret,
        _printed(lambda: repr(secret)[1:-1]),
        _printed(lambda: ascii(secret)[1:-1]),
        _printed(lambda: json.dumps(secret)[1:-1]),
        _printed(lambda: json.dumps(secret, ensure_ascii=False)[1:-1]),
        _printed(lambda: quote(secret)),
        _printed(lambda: quote(secret, safe="")),
        _printed(lambda: quote_plus(secret)),
        _printed(lambda: storable_text(secret)),
    }
    return frozenset(f for f in forms if f and f not in REDACTED)


class Redactor:
    """Replaces every printed form of some secrets by ``***``, longest form first: a form that
    holds another (the JSON form holds the text's pieces, a secret may hold another secret) is
    replaced whole, leaving no fragment."""

    def __init__(self, secrets: Iterable[str]) -> None:
        forms = sorted({f for s in secrets if s for f in printed_forms(s)}, key=len, reverse=True)
        self._anywhere = [f for f in forms if len(f) >= MIN_REDACTED_ANYWHERE]
        alone = [f for f in forms if len(f) < MIN_REDACTED_ANYWHERE]
        self._alone = (
            re.compile("|".join(rf"(?<!\w){re.escape(f)}(?!\w)" for f in alone)) if alone else None
        )

    def __bool__(self) -> bool:
        return bool(self._anywhere) or self._alone is not None

    def text(self, text: str) -> str:
        for form in self._anywhere:
            if form in text:
                text = text.replace(form, REDACTED)
        if self._alone is not None:
            text = self._alone.sub(REDACTED, text)
        return text

    def value(self, value: Any) -> Any:
        """``value`` (JSON: dicts, lists, strings, ...) with its strings redacted."""
        if not self:
            return value
        return self._value(value)

    def _value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self._value(k): self._value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._value(v) for v in value]
        return value


def redact_text(text: str, values: Iterable[str]) -> str:
    """``text`` with every printed form of each of ``values`` replaced by ``***``."""
    return Redactor(values).text(text)


# -- log lines -----------------------------------------------------------------------------------

#: Every secret value resolved in this process: the log filter redacts them all.
_known: set[str] = set()
_known_lock = threading.Lock()
#: Rebuilt (under the lock) when a new value is resolved; read without it.
_process_redactor = Redactor(())


def _remember(value: str) -> None:
    global _process_redactor
    with _known_lock:
        if value not in _known:
            _known.add(value)
            _process_redactor = Redactor(_known)
    _install_log_filter()


def redact_known(text: str) -> str:
    """``text`` with every secret this process resolved redacted (for a message that is cut
    short before it is logged: redacted first, no fragment is left for the log filter)."""
    return _process_redactor.text(text)


class RedactingFilter(logging.Filter):
    """Replaces every secret this process resolved by ``***`` in a record's message and
    traceback, before any handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        redactor = _process_redactor
        if not redactor:
            return True
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken %-format: leave it to the handler
            return True
        redacted = redactor.text(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redactor.text(record.exc_text)
        if record.stack_info:
            record.stack_info = redactor.text(record.stack_info)
        return True


_FILTER = RedactingFilter()


def _install_log_filter() -> None:
    """On every handler this process has now (a Celery worker has set its own up before the
    first task runs): the root logger's and any logger's own."""
    loggers: list[Any] = [logging.getLogger()]
    loggers += [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    for lg in loggers:
        for handler in lg.handlers:
            if _FILTER not in handler.filters:
                handler.addFilter(_FILTER)
