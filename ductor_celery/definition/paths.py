"""Path expressions: ``$.input.a.b``, ``$.context.k``, ``$.nodes.<id>.output[0].x``, ``$.item``,
and secret references ``$.secret.<name>``.

A string that starts with ``$.`` is a path; every other value is a literal. Dicts and lists are
resolved element by element. A path that points at nothing resolves to ``None`` (the way a
missing key reads in JSONPath), so a ``when`` on an absent field is simply falsy. Paths read
encoded values (``ductor_celery.values``): a key below an encoded model or dataclass reads its
field, so ``$.input.order.total`` works whether ``order`` was a dict or an ``Order``.

A secret reference is never resolved here: the tick leaves ``"$.secret.<name>"`` in the
arguments it stores, and only the step worker, just before the call, puts the value in its
place (``secret_slots`` says where; runtime/secrets.py). It is allowed only in a step's or a
scatter's ``args``. A secret's name is ASCII letters, digits and ``_``, not starting with a
digit, at most ``MAX_SECRET_NAME_LENGTH`` characters (``secret_name_problem``): it becomes an
environment variable's name upper-cased, and ``"ß".upper() == "SS"`` would alias two names.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import DefinitionError
from ..limits import MAX_SECRET_NAME_LENGTH, show
from ..values import envelope_fields, truthy
from .blobrefs import REF_KEY, BlobValues, ref_of

ROOTS = ("input", "context", "nodes", "item", "secret")
SECRET_PREFIX = "$.secret."
_SEGMENT = re.compile(r"\.([A-Za-z_][A-Za-z0-9_\-]*)|\[(\d+)\]")
_SECRET_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def secret_name_problem(name: object) -> str | None:
    """Why ``name`` cannot name a secret, or ``None``. The message names the name (never a
    value: the provider is not asked for a name refused here)."""
    if not isinstance(name, str):
        return f"secret name must be a str, not {type(name).__name__}"
    if len(name) > MAX_SECRET_NAME_LENGTH:
        return (
            f"secret name {show(name)} is {len(name)} characters long: a secret's name is at "
            f"most {MAX_SECRET_NAME_LENGTH}"
        )
    if not _SECRET_NAME.fullmatch(name):
        what = "is empty" if not name else f"{show(name)} is not valid"
        return (
            f"secret name {what}: a secret's name is ASCII letters, digits and '_', "
            "not starting with a digit"
        )
    return None


@dataclass(frozen=True, slots=True)
class Path:
    """A parsed path: a root and the keys or indexes below it."""

    text: str
    root: str
    node: str | None  # for $.nodes.<id>.output paths
    keys: tuple[str | int, ...]


def is_path(value: object) -> bool:
    return isinstance(value, str) and (value.startswith("$.") or value.startswith("!$."))


def _keys(rest: str) -> tuple[list[str | int], str | None]:
    """The ``.name`` and ``[index]`` keys ``rest`` is made of, and the part from the first one
    that is neither (``None`` when all of it reads)."""
    keys: list[str | int] = []
    pos = 0
    while pos < len(rest):
        m = _SEGMENT.match(rest, pos)
        if m is None:
            return keys, rest[pos:]
        keys.append(m.group(1) if m.group(1) is not None else int(m.group(2)))
        pos = m.end()
    return keys, None


@functools.lru_cache(maxsize=4096)
def parse_path(text: str) -> Path:
    """Parse ``text`` or raise DefinitionError naming it. Kept per text (a ``Path`` is
    immutable): a tick resolves the same few templates for every step it starts and every
    item of a scatter, and a malformed text, refused here, is not kept."""
    body = text[1:] if text.startswith("!") else text
    if not body.startswith("$"):
        raise DefinitionError(f"malformed path {text!r}: a path starts with '$.'")
    keys, unread = _keys(body[1:])
    if unread is not None:
        problem = _secret_problem(body)
        if problem is not None:
            raise DefinitionError(f"malformed path {text!r}: {problem}")
        raise DefinitionError(
            f"malformed path {text!r}: cannot read {unread!r} (expected '.name' or '[index]')"
        )
    if not keys or keys[0] not in ROOTS:
        raise DefinitionError(
            f"malformed path {text!r}: it must start with one of "
            + ", ".join(f"$.{r}" for r in ROOTS)
        )
    root = str(keys[0])
    if root == "secret":
        if text.startswith("!") or len(keys) != 2 or not isinstance(keys[1], str):
            raise DefinitionError(
                f"malformed path {text!r}: a secret reference reads '$.secret.<name>', "
                "nothing before or below it"
            )
        return Path(text, root, None, (keys[1],))
    if root == "nodes":
        if len(keys) < 3 or not isinstance(keys[1], str) or keys[2] != "output":
            raise DefinitionError(
                f"malformed path {text!r}: node paths read '$.nodes.<id>.output...'"
            )
        return Path(text, root, keys[1], tuple(keys[3:]))
    return Path(text, root, None, tuple(keys[1:]))


def _secret_problem(body: str) -> str | None:
    """What is wrong with the name of ``$.secret.<name>`` that does not parse (``$.secret.ß``),
    when it is its name (not a key below it)."""
    if not body.startswith(SECRET_PREFIX):
        return None
    name = body[len(SECRET_PREFIX) :]
    if "." in name or "[" in name:
        return None
    return secret_name_problem(name)


def iter_paths(template: Any) -> list[Path]:
    """Every path inside a template (a literal, a path, or dicts and lists of them)."""
    found: list[Path] = []

    def walk(value: Any) -> None:
        if is_path(value):
            found.append(parse_path(value))
        elif isinstance(value, Mapping):
            for v in value.values():
                walk(v)
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v)

    walk(template)
    return found


@dataclass(frozen=True, slots=True)
class Scope:
    """What paths resolve against. ``outputs`` holds only the nodes the caller loaded."""

    input: Any
    context: Mapping[str, Any]
    outputs: Mapping[str, Any]
    item: Any = None
    #: The tick's large values: a path reading inside a reference reads its value from here
    #: (a path naming the whole value gets the reference itself, read by whoever needs it).
    blobs: BlobValues | None = None


def _dig(value: Any, keys: tuple[str | int, ...], blobs: BlobValues | None = None) -> Any:
    for key in keys:
        if type(value) is dict and REF_KEY in value and (ref := ref_of(value)) is not None:
            if blobs is None:
                return None
            found, value = blobs.value(ref)
            if not found:
                return None  # needed: the tick is computed again with it
        if type(value) is dict:
            value = envelope_fields(value)
        if isinstance(key, int):
            if isinstance(value, list) and -len(value) <= key < len(value):
                value = value[key]
            else:
                return None
        elif isinstance(value, Mapping):
            value = value.get(key)
        else:
            return None
    return value


#: A webhook's paths read the request's JSON body: ``$.body.id``, ``$.body.data.object[0].id``.
BODY_PREFIX = "$.body"


def parse_body_path(text: object, what: str) -> tuple[str | int, ...]:
    """The keys of a webhook's path into the request body (``$.body`` and at least one key
    below it); DefinitionError naming ``what`` and the path otherwise."""
    example = f"'{BODY_PREFIX}.id'"
    if not isinstance(text, str) or not text.startswith(BODY_PREFIX):
        raise DefinitionError(
            f"{what} must be a path into the request body such as {example}, got {show(text)}"
        )
    keys, unread = _keys(text[len(BODY_PREFIX) :])
    if unread is not None:
        raise DefinitionError(
            f"malformed path {text!r} ({what}): cannot read {unread!r} "
            "(expected '.name' or '[index]')"
        )
    if not keys:
        raise DefinitionError(
            f"{what} {text!r} names the whole body: give a key below it, such as {example}"
        )
    return tuple(keys)


def read_body(body: Any, keys: tuple[str | int, ...]) -> Any:
    """The value at a body path's keys (``None`` where there is none)."""
    return _dig(body, keys)


def resolve_path(path: Path, scope: Scope) -> Any:
    if path.root == "input":
        value = _dig(scope.input, path.keys, scope.blobs)
    elif path.root == "context":
        value = _dig(scope.context, path.keys, scope.blobs)
    elif path.root == "item":
        value = _dig(scope.item, path.keys, scope.blobs)
    elif path.root == "secret":
        return path.text  # the reference itself: only the step worker resolves it
    else:
        assert path.node is not None
        value = _dig(scope.outputs.get(path.node), path.keys, scope.blobs)
    if path.text.startswith("!"):
        return not truthy(value)
    return value


def resolve(template: Any, scope: Scope) -> Any:
    """Resolve every path inside ``template``; literals come back unchanged."""
    if is_path(template):
        return resolve_path(parse_path(template), scope)
    if isinstance(template, Mapping):
        return {k: resolve(v, scope) for k, v in template.items()}
    if isinstance(template, list | tuple):
        return [resolve(v, scope) for v in template]
    return template


def item_resolver(template: Any, scope: Scope) -> Callable[[Any], Any]:
    """``resolve(template, <scope with item=x>)`` as a function of ``x``, for a batch's items:
    the parts that read no item are resolved once, here, and each item's call only digs into
    the item. The value of a part read once is the same object in every item's result (the
    callers normalize the list through JSON before anything keeps it)."""
    if is_path(template):
        path = parse_path(template)
        if path.root != "item":
            value = resolve_path(path, scope)
            return lambda item: value
        keys, blobs = path.keys, scope.blobs
        if path.text.startswith("!"):
            return lambda item: not truthy(_dig(item, keys, blobs))
        return lambda item: _dig(item, keys, blobs)
    if isinstance(template, Mapping):
        parts = [(key, item_resolver(value, scope)) for key, value in template.items()]
        return lambda item: {key: part(item) for key, part in parts}
    if isinstance(template, list | tuple):
        elements = [item_resolver(value, scope) for value in template]
        return lambda item: [part(item) for part in elements]
    return lambda item: template


def secret_slots(template: Any) -> tuple[tuple[tuple[str | int, ...], str], ...]:
    """Where an argument template holds secret references: (keys down to it, secret name).

    Resolving a template keeps its dicts' keys and its lists' lengths, so the same keys find
    the same place in the resolved arguments. The worker fills only these places: a string
    ``"$.secret.x"`` that arrives in a run's input or a step's output is data, never resolved.
    """
    found: list[tuple[tuple[str | int, ...], str]] = []

    def walk(value: Any, where: tuple[str | int, ...]) -> None:
        if isinstance(value, str) and value.startswith(SECRET_PREFIX):
            found.append((where, str(parse_path(value).keys[0])))
        elif isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, (*where, k))
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(v, (*where, i))

    walk(template, ())
    return tuple(found)
