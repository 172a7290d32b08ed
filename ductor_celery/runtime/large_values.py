"""The step worker's side of large values (docs/large-values.md): a result over
``ductor_offload_bytes`` is written to ``eec_blob`` before the outcome that refers to it, and a
context patch, which lives in the run row, is held to the threshold.

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


def by_reference(engine: Engine, run_id: str, output: Any, threshold: int) -> Any:
    """``output`` as the attempt row stores it: itself, or a reference to its new blob."""
    text = blobs.large_text(output, threshold)
    if text is None:
        return output

    def store() -> Any:
        with engine.begin() as conn:
            return blobs.write(conn, run_id, output, text).to_json()

    return with_retry(store, what="store a large result")


def patch_problem(patch: Any, what: str, threshold: int) -> str | None:
    """Why a context patch cannot be kept in the run row, or None."""
    if not patch:
        return None
    size = blobs.size_of(patch)
    if size <= threshold:
        return None
    return (
        f"{what} is {size} bytes, over ductor_offload_bytes={threshold}: the context lives "
        "in the run row; return a large value as the step's result instead"
    )
