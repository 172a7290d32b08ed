"""Replay: call a node's current step function with the arguments an exported attempt
received, in this process (docs/replay.md; ``testing.replay`` finds the Ductors).

It does with the recorded ``args`` what a step worker does with a claimed attempt's
(``runtime/outcome.py``, ``_call``): the secret references the node's template names are
resolved from this process's provider, the arguments are decoded and converted to the
function's annotations (``runtime/arguments.prepare``), and the function is called with a
``StepContext`` of that attempt. Nothing is written anywhere: it returns what the step returns
and raises what it raises, so a breakpoint in the step stops there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..definition.spec import BATCH_ARG, WorkflowSpec, compensated_node, compensation_id
from ..errors import ExportError
from ..store.export_format import ExportedRun
from . import batch
from .arguments import prepare
from .runtime import Runtime
from .secrets import AttemptSecrets, slots_for
from .step_context import Step, StepContext

__all__ = ["replay_attempt"]


def replay_attempt(
    exported: ExportedRun,
    node: str,
    *,
    attempt: int | None,
    branch: int | None,
    runtimes: Sequence[Runtime],
) -> Any:
    """Call ``node``'s step, as registered now in one of ``runtimes``, with the arguments its
    latest exported attempt received (``attempt``: that attempt number; ``branch``: that
    scatter branch). Returns what it returns, raises what it raises."""
    spec = WorkflowSpec.model_validate(exported.rows.definition["spec"])
    if not isinstance(node, str) or not _replayable(spec, node):
        known = ", ".join(
            [*spec.graph.order, *(compensation_id(n) for n in spec.graph.order if _saga(spec, n))]
        )
        raise ExportError(
            f"node {node!r} is not in workflow {spec.name!r} of {exported.source} (nodes: {known})"
        )
    chosen = _attempt_of(exported, node, attempt, branch)
    if batch.is_batch(chosen["args"], BATCH_ARG):
        raise ExportError(
            f"node {node!r} ran batched (batch_size > 1): its attempt holds many items; "
            "replay one by calling the step with that item's arguments"
        )
    registered, owner = _registered(chosen["step"], node, runtimes)
    secrets = AttemptSecrets(owner.settings.secret_provider)
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


def _saga(spec: WorkflowSpec, node: str) -> bool:
    """Whether ``node`` is a step node with ``compensate=``."""
    return getattr(spec.graph.nodes.get(node), "compensate", None) is not None


def _replayable(spec: WorkflowSpec, node: str) -> bool:
    """A node of the definition, or the compensation of one (``"charge~compensate"``: its
    attempts hold the ``output`` and ``input`` the compensation step received)."""
    compensated = compensated_node(node)
    return node in spec.graph.nodes or (compensated is not None and _saga(spec, compensated))


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
        wanted = " ".join(
            part
            for part in (
                "attempt" if number is None else f"attempt {number}",
                "" if branch is None else f"of branch {branch}",
            )
            if part
        )
        raise ExportError(f"node {node!r} has no {wanted} in {exported.source} (there: {there})")
    return max(found, key=lambda a: (a["generation"], a["attempt"]))


def _registered(name: str, node: str, runtimes: Sequence[Runtime]) -> tuple[Step, Runtime]:
    """The step registered under ``name`` now, in the one runtime of ``runtimes`` that has it
    (or several with the same function)."""
    found = [(step, rt) for rt in runtimes if (step := rt.step_named(name)) is not None]
    if not found:
        known = sorted({s for rt in runtimes for s in rt._steps})
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
