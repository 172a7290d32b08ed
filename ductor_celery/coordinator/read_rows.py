"""The rows a tick's load reads, turned into the engine's inputs once for every store: an
unfolded attempt row into an ``AttemptResult``, a child run's row into a ``ChildSnapshot``.
``store/load.py`` and ``store/composed.py`` read them in SQL, ``fakes/load.py`` from dicts;
sharing this code is what makes the two loads agree (as ``rows.py`` does for the commits)."""

from __future__ import annotations

from typing import Any, Protocol

from ..engine import AttemptOutcome, AttemptResult
from ..engine.inputs import ChildSnapshot
from ..engine.outputs import checkpoint_of
from ..engine.status import CHILD_MISSING, RunStatus

#: The columns of an unfolded attempt, in the order ``attempt_result`` takes them.
RESULT_COLUMNS = (
    "token",
    "node",
    "outcome",
    "output",
    "error",
    "retryable",
    "patch",
    "branch",
    "tags",
)

_OUTCOMES = frozenset(AttemptOutcome)


def attempt_result(
    token: str,
    node: str,
    outcome: str | None,
    output: Any,
    error: dict[str, Any] | None,
    retryable: bool | None,
    patch: dict[str, Any] | None,
    branch: int | None,
    tags: list[list[str]] | None,
    *,
    checked: bool = False,
    output_text: str | None = None,
) -> AttemptResult:
    """A finished attempt not folded yet (its columns in ``RESULT_COLUMNS`` order). An
    outcome this version does not know (or none, which no writer leaves on a finished row)
    is read as failed: the node retries or fails, never waits on it forever. ``checked`` and
    ``output_text``: ``AttemptResult``'s (a carried outcome the step worker checked)."""
    return AttemptResult(
        token=token,
        node=node,
        outcome=AttemptOutcome(outcome) if outcome in _OUTCOMES else AttemptOutcome.FAILED,
        output=output,
        error=error,
        retryable=bool(retryable) if retryable is not None else True,
        patch=patch,
        branch=branch,
        tags=tags,
        checked=checked,
        output_text=output_text,
    )


class ChildRunRow(Protocol):
    """What a child's snapshot is made of: the newest run of its continue-as-new chain."""

    @property
    def run_id(self) -> str: ...

    @property
    def status(self) -> str: ...

    @property
    def output(self) -> Any: ...

    @property
    def error(self) -> Any: ...

    #: The run's stored state as JSON (read only when a checkpoint is awaited).
    @property
    def state(self) -> Any: ...


def child_snapshot(child: str, row: ChildRunRow | None, until: str | None) -> ChildSnapshot:
    """The snapshot of child run ``child`` (``row``: None when it does not exist), with the
    context at checkpoint ``until`` if it has passed it."""
    if row is None:
        return ChildSnapshot(run_id=child, status=CHILD_MISSING)
    reached: dict[str, Any] = {}
    if until is not None:
        passed, context = checkpoint_of(row.state, until)
        if passed:
            reached[until] = context
    return ChildSnapshot(
        run_id=row.run_id,
        status=row.status,
        output=row.output if row.status == RunStatus.SUCCEEDED else None,
        error=row.error,
        checkpoints=reached,
    )
