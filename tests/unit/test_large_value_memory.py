"""Offloading copies a large value as little as it cheaply can (docs/large-values.md): the
size check measures an ASCII text without encoding it, and the blob writer makes one chunk at a
time instead of holding the whole value's bytes (before: about four copies in all)."""

from __future__ import annotations

import hashlib
import json
import tracemalloc
from typing import Any

from ductor_celery.definition.blobrefs import describe
from ductor_celery.payloads import check_json
from ductor_celery.store import blobs

MIB = 1024 * 1024
SIZE = 8 * MIB


class _Sink:
    """A connection that keeps only the size of each chunk it is given."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def execute(self, statement: Any) -> None:
        self.sizes.append(len(statement.compile().params["data"]))


def _peak(fn: Any) -> int:
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_writing_a_large_text_holds_one_chunk_not_a_copy_of_the_value() -> None:
    value = "x" * SIZE
    text = json.dumps(value)
    sink = _Sink()
    peak = _peak(lambda: blobs.write(sink, "r1", value, text))
    assert sum(sink.sizes) == SIZE + 2 and max(sink.sizes) <= MIB
    # A chunk and the statement made of it (before: the whole value three times over).
    assert peak < 4 * MIB, f"{peak / MIB:.1f} MiB held to write an 8 MiB value"


def test_the_reference_is_the_same_whether_the_text_is_ascii_or_not() -> None:
    for value in ("x" * (3 * MIB), "é" * (2 * MIB), ["a", "ü" * 10, {"k": 1}]):
        text = json.dumps(value, ensure_ascii=False)
        data = text.encode("utf-8")
        ref = describe(value, text, "0" * 32)
        assert ref.size == len(data) and ref.sha256 == hashlib.sha256(data).hexdigest()


def test_checking_an_ascii_value_does_not_encode_it() -> None:
    value = "x" * SIZE
    peak = _peak(lambda: check_json(value, "result", 64 * MIB))
    # Its JSON and the normalized value it returns: two copies, not a third for the bytes.
    assert peak < 2.4 * SIZE, f"{peak / MIB:.1f} MiB to check an 8 MiB value"
    assert check_json("é" * 10, "r", 15).problem is not None  # 22 bytes: measured as bytes
    assert check_json("e" * 10, "r", 12).problem is None
