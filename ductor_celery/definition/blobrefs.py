"""Large values by reference: the reference format and how a value is cut into chunks.

A value over ``ductor_offload_bytes`` once serialized is stored in ``eec_blob`` and the row that
would have held it holds a reference instead (docs/large-values.md)::

    {"__ductor_blob__": {"id": "<32 hex>", "size": 5242880, "sha256": "<64 hex>",
                         "items": 100000}}

``items`` is the length of an offloaded list (``None`` for any other value): a scatter over it
reads its items a page at a time (``page_of``) without reading the list.

The marker key cannot be forged: every value that enters ductor from outside (a run's input, a
signal's payload, a step's result, a context patch) is refused at the door when a dict in it
uses the key (``reserved_key_problem``), so a reference in a row was always written by ductor.

Pure, and in ``definition/`` because paths (``paths.py``) read inside references; the engine
sees references as opaque values, and the store writes and reads the chunks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

#: The reserved key of a reference.
REF_KEY = "__ductor_blob__"

#: Bytes of serialized JSON per ``eec_blob`` row of any value but a list.
CHUNK_BYTES = 1_048_576

#: Bytes per row of an offloaded list, cut at item boundaries (a chunk holds whole items, at
#: least one, so an item larger than this is a chunk of its own). Smaller than ``CHUNK_BYTES``:
#: a scatter's tick reads the chunks holding the page it dispatches, so a chunk bounds what a
#: tick reads for a page of a few items.
LIST_CHUNK_BYTES = 262_144

_QUOTED_KEY = json.dumps(REF_KEY)

#: Both ends of a chunk of list items: ``[`` + items joined by ``,`` + ``]``.
_SEPARATOR = b","


@dataclass(frozen=True, slots=True)
class BlobRef:
    """What a reference says about its blob."""

    id: str
    size: int
    sha256: str
    #: The length of an offloaded list; None for any other value.
    items: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            REF_KEY: {"id": self.id, "size": self.size, "sha256": self.sha256, "items": self.items}
        }


def ref_of(value: Any) -> BlobRef | None:
    """The reference ``value`` is, or None (any other value, a malformed reference too)."""
    if type(value) is not dict or len(value) != 1 or REF_KEY not in value:
        return None
    body = value[REF_KEY]
    if type(body) is not dict:
        return None
    blob_id, size, sha, items = (body.get(k) for k in ("id", "size", "sha256", "items"))
    if not isinstance(blob_id, str) or not isinstance(sha, str):
        return None
    if type(size) is not int or (items is not None and type(items) is not int):
        return None
    return BlobRef(blob_id, size, sha, items)


def may_hold_ref(text: str) -> bool:
    """Whether a value whose JSON is ``text`` may hold a reference (the key appears in it)."""
    return _QUOTED_KEY in text


def reserved_key_problem(text: str, value: Any) -> str | None:
    """The check at the client's doors (``payloads.check_json(door=...)``): a value from
    outside may not use the reserved key anywhere; the problem names where. ``text`` is the
    value's JSON: the walk runs only when the key appears in it at all."""
    if not may_hold_ref(text):
        return None
    return reserved_key_in(value)


def reserved_key_in(value: Any) -> str | None:
    """``reserved_key_problem`` without the text (a step's checked result): a walk over the
    value's dicts and lists (paths are spelled only once the key is found), which a result of
    a few scalars ends at once."""
    plain = [value]
    while plain:
        item = plain.pop()
        if type(item) is dict:
            if REF_KEY in item:
                break
            plain.extend(item.values())
        elif type(item) is list:
            plain.extend(item)
    else:
        return None
    stack: list[tuple[Any, str]] = [(value, "$")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            if REF_KEY in item:
                shown = path if len(path) <= 120 else "…" + path[-120:]
                return f"the key {REF_KEY!r} at {shown} is reserved for references to large values"
            stack += [(v, f"{path}.{k}") for k, v in item.items()]
        elif isinstance(item, list):
            stack += [(v, f"{path}[{i}]") for i, v in enumerate(item)]
    return None


def contains_ref(value: Any) -> bool:
    """Whether a stored value holds a reference anywhere (a walk: call it on values read from
    rows, which are small unless they were offloaded)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is dict:
            if REF_KEY in item and ref_of(item) is not None:
                return True
            stack.extend(item.values())
        elif type(item) is list:
            stack.extend(item)
    return False


def refs_in(value: Any) -> list[BlobRef]:
    """Every reference inside a stored value, outermost first."""
    found: list[BlobRef] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is dict:
            ref = ref_of(item)
            if ref is not None:
                found.append(ref)
                continue
            stack.extend(item.values())
        elif type(item) is list:
            stack.extend(item)
    return found


def replace_refs(value: Any, values: Mapping[str, Any]) -> Any:
    """``value`` with each reference whose id is in ``values`` replaced by that value."""
    ref = ref_of(value)
    if ref is not None:
        return values[ref.id] if ref.id in values else value
    if type(value) is dict:
        return {k: replace_refs(v, values) for k, v in value.items()}
    if type(value) is list:
        return [replace_refs(v, values) for v in value]
    return value


def placeholder_for(ref: BlobRef) -> str:
    """What a list of runs shows instead of a large value (it never reads one)."""
    return f"large value ({ref.size} bytes)"


def with_placeholders(value: Any) -> Any:
    """``value`` with each reference replaced by its ``placeholder_for`` text: no read."""
    refs = refs_in(value)
    if not refs:
        return value
    return replace_refs(value, {ref.id: placeholder_for(ref) for ref in refs})


@dataclass(frozen=True, slots=True)
class Chunk:
    """One ``eec_blob`` row: its place and, for a list, the index of its first item."""

    seq: int
    data: bytes
    first_item: int | None = None


def chunks_of(value: Any, text: str, chunk_bytes: int | None = None) -> list[Chunk]:
    """Cut a value (``text`` is its JSON) into chunks. A list is cut between items, each chunk
    a JSON array of whole items with the index of its first (``LIST_CHUNK_BYTES``); anything
    else into slices of its UTF-8 text (``CHUNK_BYTES``)."""
    return list(iter_chunks(value, text, chunk_bytes))


def iter_chunks(value: Any, text: str, chunk_bytes: int | None = None) -> Iterator[Chunk]:
    """``chunks_of``, one chunk at a time: the writer holds one chunk, not a second copy of
    the whole value."""
    if isinstance(value, list) and value:
        yield from _list_chunks(value, chunk_bytes or LIST_CHUNK_BYTES)
        return
    for seq, piece in enumerate(utf8_pieces(text, chunk_bytes or CHUNK_BYTES)):
        yield Chunk(seq, piece)


def utf8_pieces(text: str, piece_bytes: int) -> Iterator[bytes]:
    """``text``'s UTF-8 bytes in consecutive pieces of ``piece_bytes``. An ASCII text (most
    large values) is encoded a slice at a time, never whole; any other is encoded whole once
    and sliced through a memoryview (one copy per piece, not a second copy of the whole)."""
    if text.isascii():  # O(1) in CPython; characters are bytes
        for start in range(0, max(len(text), 1), piece_bytes):
            yield text[start : start + piece_bytes].encode("ascii")
        return
    whole = memoryview(text.encode("utf-8"))
    for start in range(0, max(len(whole), 1), piece_bytes):
        yield bytes(whole[start : start + piece_bytes])


def _list_chunks(items: list[Any], chunk_bytes: int) -> Iterator[Chunk]:
    dumps = json.JSONEncoder(ensure_ascii=False, allow_nan=False).encode
    page: list[bytes] = []
    size = 2  # the brackets
    first = 0
    seq = 0
    for index, item in enumerate(items):
        data = dumps(item).encode("utf-8")
        if page and size + 1 + len(data) > chunk_bytes:
            yield Chunk(seq, b"[" + _SEPARATOR.join(page) + b"]", first)
            seq, page, size, first = seq + 1, [], 2, index
        size += len(data) + (1 if page else 0)
        page.append(data)
    yield Chunk(seq, b"[" + _SEPARATOR.join(page) + b"]", first)


def value_of(chunks: list[Chunk], ref: BlobRef) -> Any:
    """The value back from all of its chunks in order; ``ValueError`` naming the blob when they
    do not make the value its reference describes (a chunk missing, or altered)."""
    if ref.items is not None:
        items: list[Any] = []
        for chunk in chunks:
            items.extend(json.loads(chunk.data))
        if len(items) != ref.items:
            raise ValueError(f"blob {ref.id} holds {len(items)} items, its reference {ref.items}")
        # The reference's size and SHA-256 are of the whole list's JSON ("[a, b]", the
        # encoder's separator), which the chunks ("[a,b]" each) do not hold as such: the items
        # are encoded again, one at a time, into the hash.
        size, digest = _list_digest(items)
        if size != ref.size or digest != ref.sha256:
            raise ValueError(f"blob {ref.id} does not match its reference (size or sha256)")
        return items
    data = b"".join(chunk.data for chunk in chunks)
    if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.sha256:
        raise ValueError(f"blob {ref.id} does not match its reference (size or sha256)")
    return json.loads(data)


def _list_digest(items: list[Any]) -> tuple[int, str]:
    """Bytes and SHA-256 of a list's JSON as ``describe`` measured it, item by item."""
    dumps = json.JSONEncoder(ensure_ascii=False, allow_nan=False).encode
    digest = hashlib.sha256(b"[")
    size = 2
    for index, item in enumerate(items):
        data = dumps(item).encode("utf-8")
        if index:
            digest.update(b", ")
            size += 2
        digest.update(data)
        size += len(data)
    digest.update(b"]")
    return size, digest.hexdigest()


def page_of(chunks: list[tuple[int, list[Any]]], start: int, stop: int) -> dict[int, Any]:
    """Items ``start..stop-1`` of an offloaded list from the chunks that hold them, each given
    as (its first item's index, its items): those whose first item is at most ``stop - 1``,
    from the last one starting at or before ``start``."""
    found: dict[int, Any] = {}
    for first, items in chunks:
        for offset, item in enumerate(items):
            if start <= first + offset < stop:
                found[first + offset] = item
    return found


def describe(value: Any, text: str, blob_id: str) -> BlobRef:
    """The reference to ``value`` stored under ``blob_id`` (``text``: its JSON)."""
    digest = hashlib.sha256()
    size = 0
    for piece in utf8_pieces(text, CHUNK_BYTES):  # no second whole copy of the value
        digest.update(piece)
        size += len(piece)
    items = len(value) if isinstance(value, list) and value else None
    return BlobRef(blob_id, size, digest.hexdigest(), items)


@dataclass(slots=True)
class BlobNeeds:
    """What a tick's paths needed and its load had not read: whole values (a path reads inside
    one) and pages of offloaded lists (a scatter dispatches those items)."""

    values: dict[str, BlobRef]
    #: blob id -> (its reference, the spans of items needed: (first item, one past the last)).
    #: Several scatters over one list each add their span: none overwrites another's.
    pages: dict[str, tuple[BlobRef, list[tuple[int, int]]]]

    def __bool__(self) -> bool:
        return bool(self.values or self.pages)


class BlobValues:
    """The large values a tick's load has read, by blob id, and what it asked for that was not
    read (``needs``): the tick is then computed again with them (coordinator/loop.py), so a
    payload computed without a value is never committed."""

    __slots__ = ("values", "items", "needs")

    def __init__(
        self,
        values: Mapping[str, Any] | None = None,
        items: Mapping[str, Mapping[int, Any]] | None = None,
    ) -> None:
        self.values: Mapping[str, Any] = values or {}
        self.items: Mapping[str, Mapping[int, Any]] = items or {}
        self.needs = BlobNeeds({}, {})

    def value(self, ref: BlobRef) -> tuple[bool, Any]:
        """(True, the value) if it was read, else (False, None) and it is needed."""
        if ref.id in self.values:
            return True, self.values[ref.id]
        self.needs.values[ref.id] = ref
        return False, None

    def page(self, ref: BlobRef, start: int, stop: int) -> Mapping[int, Any] | None:
        """Items ``start..stop-1`` of an offloaded list if they were read, else None (and the
        page is needed)."""
        have = self.items.get(ref.id, {})
        if all(i in have for i in range(start, stop)):
            return have
        spans = self.needs.pages.setdefault(ref.id, (ref, []))[1]
        if (start, stop) not in spans:  # a scatter looked at twice in one computation
            spans.append((start, stop))
        return None
