"""The step worker's side of large values (docs/large-values.md): a result over
``ductor_offload_bytes`` is written to ``eec_blob`` before the outcome that refers to it, and a
context patch, which lives in the run row, is held to 1 MiB (or the threshold when larger).

The blob is written in a short transaction of its own, before the outcome's: the outcome
write has several paths (the one-round-trip unleased write, the eager tick's transaction, a
replay after a lost commit), and each then carries only the small reference. A blob whose
outcome is never written (the attempt was closed first) belongs to the run all the same and
is pruned with it.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Engine

from ..store import blobs
from ..store.db import with_retry


def by_reference(
    engine: Engine, run_id: str, output: Any, threshold: int, text: str | None = None
) -> Any:
    """``output`` as the attempt row stores it: itself, or a reference to its new blob.
    ``text``: its JSON as its check made it (``payloads.JsonCheck.text``), if known."""
    text = blobs.large_text(output, threshold, text)
    if text is None:
        return output

    def store() -> Any:
        with engine.begin() as conn:
            return blobs.write(conn, run_id, output, text).to_json()

    return with_retry(store, what="store a large result")


#: A context patch may be this large even when ``ductor_offload_bytes`` is lower: 1 MiB, the
#: patch limit before large values (it was ``ductor_max_payload_bytes``, whose default was
#: 1 MiB then), so a patch that worked before still works.
CONTEXT_PATCH_BYTES = 1_048_576


def patch_limit(offload_bytes: int) -> int:
    """The most bytes a context patch may have: 1 MiB, or ``offload_bytes`` when larger (the
    check against ``ductor_max_payload_bytes`` comes first, so a lower one still wins)."""
    return max(offload_bytes, CONTEXT_PATCH_BYTES)


def patch_problem(patch: Any, what: str, offload_bytes: int) -> str | None:
    """Why a context patch cannot be kept in the run row, or None. The context is not
    offloaded: every tick reads and writes it (docs/large-values.md)."""
    if not patch:
        return None
    size = blobs.size_of(patch)
    limit = patch_limit(offload_bytes)
    if size <= limit:
        return None
    return (
        f"{what} is {size} bytes, over the context patch limit of {limit} bytes (1 MiB, or "
        "ductor_offload_bytes when larger): the context lives in the run row; return a "
        "large value as the step's result instead"
    )
