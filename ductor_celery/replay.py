"""``testing.replay``: call a node's current step function with the arguments an exported
attempt received, in this process (docs/replay.md).

It does with the recorded ``args`` what a step worker does with a claimed attempt's
(``runtime/steps.py``, ``_call``): the secret references the node's template names are
resolved from this process's provider, the arguments are decoded and converted to the
function's annotations (``runtime/arguments.prepare``), and the function is called with a
``StepContext`` of that attempt. Nothing is written anywhere: it returns what the step returns
and raises what it raises, so a breakpoint in the step stops there.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .definition.spec import BATCH_ARG, WorkflowSpec
from .exports import ExportedRun, ExportError, read_export
from .runtime import batch
from .runtime.arguments import prepare
from .runtime.secrets import AttemptSecrets, slots_for
from .runtime.step_context import Step, StepContext

if TYPE_CHECKING:
    from .ductor import Ductor

__all__ = ["replay"]


def replay(
    file: str | os.PathLike[str] | dict[str, Any],
    node: str,
    *,
    attempt: int | None = None,
    branch: int | None = None,
    ductor: Ductor | None = None,
) -> Any:
    """Call ``node``'s step, as registered in this process now, with the arguments its latest
    exported attempt received (``attempt=``: that attempt number; ``branch=``: that scatter
    branch). Returns what it returns, raises what it raises. ``ductor``: the Ductor whose
    steps to use (default: the one Ductor of this process that registers the step)."""
    exported = read_export(file)
    spec = WorkflowSpec.model_validate(exported.rows.definition["spec"])
    if not isinstance(node, str) or node not in spec.graph.nodes:
        known = ", ".join(spec.graph.order)
        raise ExportError(
            f"node {node!r} is not in workflow {spec.name!r} of {exported.source} (nodes: {known})"
        )
    chosen = _attempt_of(exported, node, attempt, branch)
    if batch.is_batch(chosen["args"], BATCH_ARG):
        raise ExportError(
            f"node {node!r} ran batched (batch_size > 1): its attempt holds many items; "
            "replay one by calling the step with that item's arguments"
        )
    registered, owner = _registered(chosen["step"], node, ductor)
    secrets = AttemptSecrets(owner.runtime.settings.secret_provider if owner else None)
    slots = slots_for(spec.spec_hash, node, lambda _hash: spec)
    kwargs = prepare(registered.fn, registered.name, secrets.fill(dict(chosen["args"]), slots))
    document = exported.document
    ctx = StepContext(
        run_id=exported.run_id,
        workflow_id=str(exported.rows.run["workflow_id"]),
        node=node,
        branch=chosen["branch"],
        attempt=chosen["attempt"],
        input_fn=lambda: document["input"],
        context=document["context"],
        secret_fn=secrets.get,
    )
    return registered.fn(ctx, **kwargs)


def _attempt_of(
    exported: ExportedRun, node: str, number: int | None, branch: int | None
) -> dict[str, Any]:
    mine = [a for a in exported.rows.attempts if a["node"] == node]
    if not mine:
        raise ExportError(
            f"node {node!r} has no attempt in {exported.source} (a node that never ran, or "
            "one that runs no step: a sleep, a wait, an approval, a sub-workflow)"
        )
    found = [
        a
        for a in mine
        if (number is None or a["attempt"] == number) and (branch is None or a["branch"] == branch)
    ]
    if not found:
        there = ", ".join(
            f"attempt {a['attempt']}" + ("" if a["branch"] is None else f" of branch {a['branch']}")
            for a in mine
        )
        raise ExportError(
            f"node {node!r} has no attempt {number if number is not None else ''}"
            f"{'' if branch is None else f' of branch {branch}'} in {exported.source} "
            f"(there: {there})"
        )
    return max(found, key=lambda a: (a["generation"], a["attempt"]))


def _registered(name: str, node: str, ductor: Ductor | None) -> tuple[Step, Ductor | None]:
    """The step registered under ``name`` now: in ``ductor``, else in the one Ductor of this
    process that has it."""
    owners = [ductor] if ductor is not None else _ductors()
    found = [(step, d) for d in owners if (step := d.runtime.step_named(name)) is not None]
    if not found:
        known = sorted({s for d in owners for s in d._steps})
        raise ExportError(
            f"step {name!r} (node {node!r}) is not registered in this process "
            f"(registered: {', '.join(known) or 'none'}); import the module that defines it"
        )
    if len({id(step.fn) for step, _ in found}) > 1:
        raise ExportError(
            f"step {name!r} is registered by {len(found)} Ductors of this process with "
            "different functions: pass ductor= to choose"
        )
    return found[0]


def _ductors() -> list[Ductor]:
    """Every Ductor of this process: each lives on its Celery app (``app._ductor``)."""
    from celery._state import _get_active_apps

    from .ductor import Ductor

    return [
        d
        for app in list(_get_active_apps())
        if isinstance(d := getattr(app, "_ductor", None), Ductor)
    ]
