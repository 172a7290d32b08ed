"""Large values in ``eec_blob`` (docs/large-values.md): write one, read one back, read a page of
an offloaded list, delete a run's.

The writer of the row that would have held a value writes its blob: in the same transaction
(the client's insert, the tick's commit), or, for a step's result, in a short transaction of
the step worker's own just before the outcome's (runtime/large_values.py). Readers resolve
references where a value leaves for user code or for a path that reads inside it: the step's
arguments, ``ctx.input``, views, the tick's paths (``TickInputs.blobs``).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from ..definition.blobrefs import (
    BlobNeeds,
    BlobRef,
    Chunk,
    describe,
    iter_chunks,
    page_of,
    ref_of,
    refs_in,
    value_of,
)
from ..definition.blobrefs import replace_refs as _replace
from ..engine.inputs import TickInputs
from ..errors import DanglingReference
from .composed import PerDatabase, cache_for
from .schema import blob

#: The serializer sizes are measured with, the one ``payloads.check_json`` uses.
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False)

#: ``Settings.offload_bytes``' default.
DEFAULT_THRESHOLD = 262_144

#: Each database's offload threshold, set by the process that opened it from its settings
#: (``configure``): the store's writers (inserts, outcomes, commits) read it from their
#: connection's engine instead of every signature carrying it.
_thresholds: weakref.WeakKeyDictionary[Engine, int] = weakref.WeakKeyDictionary()


def configure(engine: Engine, offload_bytes: int) -> None:
    """Values over ``offload_bytes`` written through ``engine`` are stored by reference."""
    _thresholds[engine] = offload_bytes


def threshold(engine: Engine) -> int:
    return _thresholds.get(engine, DEFAULT_THRESHOLD)


def offloaded_on(conn: Connection, run_id: str, value: Any) -> Any:
    """``offloaded`` at the threshold configured for ``conn``'s database."""
    return offloaded(conn, run_id, value, threshold(conn.engine))


def offloaded(conn: Any, run_id: str, value: Any, threshold: int, text: str | None = None) -> Any:
    """``value`` as its row stores it: itself when its JSON is at most ``threshold`` bytes,
    else a reference to the blob written here (on ``conn``, in its transaction: a Connection,
    or anything with its ``execute``, such as a caller's joined transaction). A value that is
    already a reference stays one. Costs one serialization (no query) below the threshold,
    none when ``text`` is the value's JSON already (``large_text``)."""
    text = large_text(value, threshold, text)
    return value if text is None else write(conn, run_id, value, text).to_json()


def large_text(value: Any, threshold: int, text: str | None = None) -> str | None:
    """The JSON of a value to offload (over ``threshold`` bytes, not a reference already), or
    None: one serialization, no query. ``text``: the value's JSON as ``payloads.check_json``
    made it (the same encoding as here), which is then not made again for a value under the
    threshold. Over it, the value is encoded here all the same: that text may hold a key
    twice (``JsonCheck.text``), and a blob's bytes, size and digest must be the value's."""
    if value is None or ref_of(value) is not None:
        return None
    try:
        if text is not None and _within(text, threshold):
            return None
        text = _ENCODER.encode(value)
        if _within(text, threshold):
            return None
    except (ValueError, TypeError):  # UnicodeEncodeError too
        # Not storable at all (a check let it through): left inline, where the database
        # refuses it and its writer records that instead (``store.db.ValuesRefused``).
        return None
    return text


def _within(text: str, threshold: int) -> bool:
    """Whether ``text`` is at most ``threshold`` UTF-8 bytes. Each character is 1..4 bytes:
    most texts are decided without encoding them (more characters than the threshold is
    over it; an ASCII text's bytes are its characters). Raises UnicodeEncodeError for a lone
    surrogate."""
    if len(text) <= threshold // 4:
        return True
    return len(text) <= threshold and (text.isascii() or len(text.encode("utf-8")) <= threshold)


def size_of(value: Any) -> int:
    """Bytes of a value's JSON, as the threshold counts them (0 for a value that is not
    storable at all: the database's refusal is what its writer reports)."""
    try:
        text = _ENCODER.encode(value)
        return len(text) if text.isascii() else len(text.encode("utf-8"))
    except (ValueError, TypeError):
        return 0


def write(conn: Any, run_id: str, value: Any, text: str | None = None) -> BlobRef:
    """Store ``value`` (plain JSON, already checked) as a new blob of ``run_id``."""
    text = _ENCODER.encode(value) if text is None else text
    ref = describe(value, text, uuid.uuid4().hex)
    # One statement per chunk: a multi-row insert of several MiB is one huge statement; and
    # one chunk made at a time, so the writer never holds a second copy of the whole value.
    for c in iter_chunks(value, text):
        conn.execute(
            sa.insert(blob).values(
                id=ref.id, seq=c.seq, run_id=run_id, first_item=c.first_item, data=c.data
            )
        )
    return ref


def _chunks(conn: Connection, ref: BlobRef, where: Any = None) -> list[Chunk]:
    query = sa.select(blob.c.seq, blob.c.data, blob.c.first_item).where(blob.c.id == ref.id)
    if where is not None:
        query = query.where(where)
    return [
        Chunk(r.seq, bytes(r.data), r.first_item) for r in conn.execute(query.order_by(blob.c.seq))
    ]


def read(conn: Connection, ref: BlobRef, held_by: str = "a value") -> Any:
    """The value a reference names; ``DanglingReference`` naming the blob and ``held_by``
    when its chunks are gone or do not make the value."""
    chunks = _chunks(conn, ref)
    if not chunks:
        raise DanglingReference(f"blob {ref.id} referenced by {held_by} does not exist")
    try:
        return value_of(chunks, ref)
    except ValueError as exc:
        raise DanglingReference(f"{exc} (referenced by {held_by})") from None


#: Parsed chunks of offloaded lists, per database: a scatter's consecutive ticks read pages
#: from the same chunk, and a chunk never changes. A few chunks of at most 256 KiB each.
_pages: PerDatabase = weakref.WeakKeyDictionary()
PAGE_CACHE_CHUNKS = 8


def read_items(conn: Connection, ref: BlobRef, start: int, stop: int) -> dict[int, Any]:
    """Items ``start..stop-1`` of an offloaded list, reading only the chunks that hold them
    (and of those, only the ones this process has not parsed lately)."""
    stop = min(stop, ref.items or 0)
    if start >= stop:
        return {}
    first = (
        sa.select(sa.func.max(blob.c.first_item))
        .where(blob.c.id == ref.id, blob.c.first_item <= start)
        .scalar_subquery()
    )
    span = sa.and_(blob.c.first_item >= first, blob.c.first_item < stop)
    index = conn.execute(
        sa.select(blob.c.seq, blob.c.first_item).where(blob.c.id == ref.id, span)
    ).all()
    cache = cache_for(_pages, conn.engine, PAGE_CACHE_CHUNKS)
    keys = [f"{ref.id}#{r.seq}" for r in index]
    found, missing = cache.get_many(keys)
    if missing:
        wanted = [int(key.rsplit("#", 1)[1]) for key in missing]
        for chunk in _chunks(conn, ref, blob.c.seq.in_(wanted)):
            parsed = (chunk.first_item, json.loads(chunk.data))
            cache.put(f"{ref.id}#{chunk.seq}", parsed)
            found[f"{ref.id}#{chunk.seq}"] = parsed
    items = page_of([found[key] for key in keys if key in found], start, stop)
    if len(items) != stop - start:
        raise DanglingReference(
            f"blob {ref.id} (a list of {ref.items} items) is missing items {start}..{stop - 1}"
        )
    return items


def read_all(conn: Connection, refs: Iterable[BlobRef], held_by: str) -> dict[str, Any]:
    """Each reference's value by blob id, following references inside blob values (a value
    the tick offloaded may hold references it resolved to)."""
    values: dict[str, Any] = {}
    todo = list(refs)
    while todo:
        ref = todo.pop()
        if ref.id in values:
            continue
        values[ref.id] = read(conn, ref, held_by)
        todo.extend(r for r in refs_in(values[ref.id]) if r.id not in values)
    return {k: _replace(v, values) for k, v in values.items()}


def resolved(conn: Connection, value: Any, held_by: str) -> Any:
    """``value`` with every reference in it replaced by its value (no query when there is
    none: one walk over the value)."""
    refs = refs_in(value)
    if not refs:
        return value
    return _replace(value, read_all(conn, refs, held_by))


def resolved_on(engine: Engine, value: Any, held_by: str) -> Any:
    """``resolved`` on a connection of its own, opened only when ``value`` holds a reference."""
    if not refs_in(value):
        return value
    with engine.connect() as conn:
        return resolved(conn, value, held_by)


def resolved_many(engine: Engine, values: Mapping[str, Any]) -> dict[str, Any]:
    """Several values (what they are, for the error: ``{"input": ..., "node 'a'": ...}``) with
    their references resolved, on one connection opened only if one of them holds one."""
    holding = {what: refs_in(v) for what, v in values.items()}
    if not any(holding.values()):
        return dict(values)
    out = dict(values)
    with engine.connect() as conn:
        for what, refs in holding.items():
            if refs:
                out[what] = _replace(values[what], read_all(conn, refs, what))
    return out


def delete_for_runs(conn: Connection, run_ids: list[str]) -> None:
    """Prune: the blobs of these runs."""
    conn.execute(sa.delete(blob).where(blob.c.run_id.in_(run_ids)))


def read_needs(conn: Connection, inputs: TickInputs, needs: BlobNeeds) -> TickInputs:
    """A tick's inputs with what its computation needed read in (on the tick's connection):
    whole values by id, and the pages of offloaded lists its scatters dispatch."""
    values = dict(inputs.blobs)
    fresh = [ref for blob_id, ref in needs.values.items() if blob_id not in values]
    values.update(read_all(conn, fresh, f"run {inputs.run_id}"))
    items = {k: dict(v) for k, v in inputs.items.items()}
    for blob_id, (ref, spans) in needs.pages.items():
        for start, stop in spans:
            items.setdefault(blob_id, {}).update(read_items(conn, ref, start, stop))
    return dataclasses.replace(inputs, blobs=values, items=items)
