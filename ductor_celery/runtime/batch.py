"""A batch attempt in the step worker: a scatter with ``batch_size`` > 1 sends up to that many
items in one message and one attempt; the step function is still called once per item.

The attempt's arguments are ``{BATCH_ARG: {"base", "first", "items"}}``: ``items[k]`` holds
item ``first + k``'s resolved arguments, or ``None`` for an item the tick refused (its place
in the result stays ``None``; the gather puts the item's error there).

What the attempt row ends up holding (read by the tick and the gather, engine/scatter.py):
- succeeded: ``output`` is the list of the items' outputs, in item order; ``patch`` the items'
  context patches merged in item order.
- failed: ``output`` is ``{"done": {index: output}, "failed": {index: error}, "patches":
  {index: patch}}`` (indices as strings): ``done`` the items with a recorded output, ``failed``
  the items that failed for good (not retryable); ``error.items`` every item error of this
  attempt. The attempt is retryable if any item may succeed on a retry.
While it runs, the same ``{"done", ...}`` mapping is checkpointed into ``output`` at most
every ``CHECKPOINT_EVERY_S`` (store/attempts.batch_checkpoint), so a retry after a SIGKILL
or a timeout runs only the items without a recorded output. A retry never runs an item that
an earlier attempt of the batch recorded, whether as an output or as a final failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: Longest time between two checkpoints of a running batch (each is one UPDATE of the attempt
#: row, which also counts as a heartbeat).
CHECKPOINT_EVERY_S = 1.0


@dataclass(frozen=True, slots=True)
class ItemOutcome:
    """One item's call, as the worker's per-call runner reports it."""

    succeeded: bool
    output: Any = None
    patch: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    retryable: bool = True


@dataclass(slots=True)
class BatchOutcome:
    """What the batch attempt comes to: its attempt row's outcome, output, patch and error."""

    succeeded: bool
    output: Any
    patch: dict[str, Any] | None
    error: dict[str, Any] | None = None
    retryable: bool = False
    #: The items called by this attempt (not carried over from earlier ones).
    ran: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Progress:
    done: dict[str, Any] = field(default_factory=dict)
    failed: dict[str, Any] = field(default_factory=dict)
    patches: dict[str, Any] = field(default_factory=dict)

    def absorb(self, earlier: Any) -> None:
        """Take over what an earlier attempt of the batch recorded."""
        if not isinstance(earlier, dict):
            return
        for name in ("done", "failed", "patches"):
            part = earlier.get(name)
            if isinstance(part, dict):
                getattr(self, name).update(part)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"done": dict(self.done)}
        if self.failed:
            out["failed"] = dict(self.failed)
        if self.patches:
            out["patches"] = dict(self.patches)
        return out

    def merged_patch(self, indices: range) -> dict[str, Any] | None:
        merged: dict[str, Any] = {}
        for index in indices:
            patch = self.patches.get(str(index))
            if isinstance(patch, dict):
                merged.update(patch)
        return merged or None


def is_batch(args: dict[str, Any], batch_arg: str) -> bool:
    return set(args) == {batch_arg} and isinstance(args[batch_arg], dict)


def run_batch(
    spec: dict[str, Any],
    earlier: list[Any],
    call: Callable[[int, dict[str, Any]], tuple[ItemOutcome, BaseException | None]],
    checkpoint: Callable[[dict[str, Any]], None],
    clock: Callable[[], float] = time.monotonic,
) -> tuple[BatchOutcome, BaseException | None]:
    """Run the batch's items that have no recorded output, in item order.

    ``call(index, args)`` runs the step for one item and returns its outcome and an interrupt
    (SystemExit, KeyboardInterrupt) to re-raise once the attempt's outcome is written: the
    batch stops at it. ``earlier`` holds the outputs of the batch's earlier attempts.
    """
    first = int(spec["first"])
    items: list[dict[str, Any] | None] = list(spec["items"])
    span = range(first, first + len(items))
    progress = _Progress()
    for output in earlier:
        progress.absorb(output)
    errors: dict[str, Any] = {}
    ran: list[int] = []
    interrupt: BaseException | None = None
    last_checkpoint = clock()
    for index, args in zip(span, items, strict=True):
        key = str(index)
        if args is None or key in progress.done or key in progress.failed:
            continue
        outcome, interrupt = call(index, args)
        ran.append(index)
        if outcome.succeeded:
            progress.done[key] = outcome.output
            if outcome.patch:
                progress.patches[key] = outcome.patch
        elif outcome.retryable:
            errors[key] = outcome.error
        else:
            progress.failed[key] = outcome.error
        if interrupt is not None:
            break
        # (Not after the last item: the outcome, written next, records the same.)
        if index != span[-1] and clock() - last_checkpoint >= CHECKPOINT_EVERY_S:
            checkpoint(progress.as_json())
            last_checkpoint = clock()
    missing = [
        i for i, a in zip(span, items, strict=True) if a is not None and str(i) not in progress.done
    ]
    if not missing:
        output = [progress.done.get(str(i)) for i in span]
        return BatchOutcome(True, output, progress.merged_patch(span), ran=ran), interrupt
    item_errors = {**progress.failed, **errors}
    first_bad = min(item_errors, key=int) if item_errors else None
    if first_bad is None:
        # Stopped by an interrupt before reaching some items: they may run on a retry.
        message = f"stopped after {len(ran)} items; {len(missing)} items not run"
    else:
        detail = item_errors[first_bad] or {}
        total = len(items) - _refused(items)
        message = (
            f"{len(item_errors)} of {total} items failed; item {first_bad}: "
            f"{detail.get('type', 'Error')}: {detail.get('message', '')}"
        )
    error = {"type": "BatchFailed", "message": message, "items": item_errors}
    # A retry helps only if some item without an output did not fail for good.
    retryable = any(str(i) not in progress.failed for i in missing)
    return (
        BatchOutcome(False, progress.as_json(), progress.merged_patch(span), error, retryable, ran),
        interrupt,
    )


def _refused(items: list[dict[str, Any] | None]) -> int:
    return sum(1 for a in items if a is None)
