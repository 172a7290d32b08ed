"""Run tags (search attributes): the rules a tag obeys, and how a tick applies a step's tags.

Pure: the client checks ``start(tags=)`` and list filters with ``tags_problem``, a step's
``ctx.tag`` with ``tag_problem``, and the tick folds a succeeded attempt's tags with
``apply_step_tags`` (docs/tags.md). Tags live in the run state (``RunState.tags``) and, as an
index the lists filter through, in ``eec_run_tag``; the commit writes ``TickPayload.tags_set``
there in the same transaction as the state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .context import TickContext

#: At most this many tags per run.
MAX_TAGS = 20
#: Keys and values are strings of 1..MAX_TAG_LENGTH characters.
MAX_TAG_LENGTH = 100
#: A step's tags as they travel with its attempt: ``[[key, value], ...]`` in the order the
#: step first set each key. A list, not an object: PostgreSQL's jsonb reorders an object's keys,
#: and the order decides which tags fit when the run nears ``MAX_TAGS``.
StepTags = list[list[str]]


def tag_problem(key: Any, value: Any) -> str | None:
    """What is wrong with the tag ``key: value``, or None when it is a valid tag."""
    for what, text in (("key", key), ("value", value)):
        if not isinstance(text, str):
            shown = _shown(key) if what == "value" else ""
            return f"tag {what}{shown} must be a string, got {type(text).__name__}"
        if not 1 <= len(text) <= MAX_TAG_LENGTH:
            shown = _shown(key) if what == "value" else f" {text[:40]!r}"
            return (
                f"tag {what}{shown} must be 1..{MAX_TAG_LENGTH} characters, "
                f"it is {len(text)} characters long"
            )
        # Neither database stores these: PostgreSQL refuses NUL in text, and a lone surrogate
        # is not valid UTF-8 (SQLite would keep it mangled, so a filter would never match).
        if "\x00" in text:
            shown = _shown(key) if what == "value" else ""
            return f"tag {what}{shown} must not contain NUL characters"
        if not text.isprintable() and any(0xD800 <= ord(c) <= 0xDFFF for c in text):
            shown = _shown(key) if what == "value" else ""
            return f"tag {what}{shown} must not contain lone surrogates (it is not valid Unicode)"
    return None


def tags_problem(tags: Any, what: str = "tags") -> str | None:
    """What is wrong with a mapping of tags (at most ``MAX_TAGS``, each valid), or None."""
    if not isinstance(tags, Mapping):
        return f"{what} must be a mapping of strings to strings, got {type(tags).__name__}"
    if len(tags) > MAX_TAGS:
        return f"{what}: at most {MAX_TAGS} tags per run, got {len(tags)}"
    for key, value in tags.items():
        problem = tag_problem(key, value)
        if problem is not None:
            return f"{what}: {problem}"
    return None


def checked_tags(tags: Any, what: str = "tags") -> dict[str, str]:
    """``tags`` as a plain dict; ValueError naming the first problem."""
    if tags is None:
        return {}
    problem = tags_problem(tags, what)
    if problem is not None:
        raise ValueError(problem)
    return dict(tags)


def apply_step_tags(t: TickContext, node: str, tags: Any) -> None:
    """Apply the tags a succeeded attempt set (``StepTags``), in the order it set them.

    A key the run has already is updated; a new key is added while the run has fewer than
    ``MAX_TAGS``; one that would be the run's 21st is dropped, and a transition on ``node``
    says so. The attempt is never failed for it. A malformed entry, or a value that is not a
    list of pairs (a row not written by ``ctx.tag``), is dropped the same way: the tick never
    raises on bad data.
    """
    if not tags:
        return
    state = t.payload.state
    status = t.nodes[node].status if node in t.nodes else state.status
    pairs = isinstance(tags, list) and all(isinstance(p, list) and len(p) == 2 for p in tags)
    if not pairs:
        t.record(node, status, status, f"tags dropped: not key-value pairs ({type(tags).__name__})")
        return
    for key, value in tags:
        problem = tag_problem(key, value)
        if problem is None and key not in state.tags and len(state.tags) >= MAX_TAGS:
            problem = f"the run has {MAX_TAGS} tags already"
        if problem is not None:
            t.record(node, status, status, f"tag {_text(key)} dropped: {problem}")
            continue
        if state.tags.get(key) != value:
            state.tags[key] = value
            t.payload.tags_set[key] = value


def _shown(key: Any) -> str:
    return f" of {key[:40]!r}" if isinstance(key, str) else ""


def _text(key: Any) -> str:
    return repr(key[:40]) if isinstance(key, str) else type(key).__name__
