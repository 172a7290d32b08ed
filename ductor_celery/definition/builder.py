"""The Workflow builder users write, turned into a validated WorkflowSpec at register time.

The builder only records what it is told; every check happens in ``build()`` so that a bad
definition is reported by ``register`` with a message naming the node or path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel

from ..errors import DefinitionError
from .retry import RetryPolicy
from .spec import (
    CHILD_KINDS,
    ApprovalNodeSpec,
    CheckpointNodeSpec,
    ChildScatterNodeSpec,
    ConcurrencySpec,
    EventSetNodeSpec,
    NodeSpec,
    RetrySpec,
    ScatterNodeSpec,
    SleepNodeSpec,
    StepNodeSpec,
    SubworkflowNodeSpec,
    WaitSignalNodeSpec,
    WorkflowSpec,
)
from .validate import validate_spec


@runtime_checkable
class StepLike(Protocol):
    """What the builder needs to know of a step (``@ductor.step`` objects satisfy it)."""

    name: str
    retry: RetryPolicy
    timeout: float | None
    queue: str | None


#: Looks a step up by name at build time; returns None for an unknown step.
StepResolver = Callable[[str], StepLike | None]
#: Looks a registered workflow up by name at build time; None for an unknown one.
WorkflowResolver = Callable[[str], WorkflowSpec | None]


class Workflow:
    """A DAG of nodes: ``Workflow("order", version=1)``, then ``wf.step(...)`` and friends."""

    def __init__(self, name: str, version: int = 1) -> None:
        if not isinstance(name, str) or not name:
            raise DefinitionError(f"a workflow name must be a non-empty string, got {name!r}")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise DefinitionError(
                f"workflow {name!r}: version must be a positive integer, got {version!r}"
            )
        self.name = name
        self.version = version
        self._nodes: list[dict[str, Any]] = []
        self._output: Any = None

    def __repr__(self) -> str:
        return f"Workflow({self.name!r}, version={self.version}, nodes={len(self._nodes)})"

    @property
    def node_ids(self) -> list[str]:
        return [n["id"] for n in self._nodes]

    def step(
        self,
        id: str,
        step: StepLike | str,
        *,
        after: Iterable[str] | None = None,
        args: Mapping[str, Any] | None = None,
        when: str | bool | None = None,
        continue_on_failure: bool = False,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
    ) -> Workflow:
        """Add a node that runs ``step`` with ``args`` once every node in ``after`` finished."""
        return self._add(
            "step",
            id,
            after,
            when,
            step=step,
            args=args,
            continue_on_failure=continue_on_failure,
            retry=retry,
            timeout=timeout,
        )

    def scatter(
        self,
        id: str,
        step: StepLike | str | None = None,
        *,
        over: str,
        item_arg: str | None = "item",
        args: Mapping[str, Any] | None = None,
        max_parallel: int = 64,
        tolerated_failures: int | None = None,
        tolerated_failure_ratio: float | None = None,
        workflow: str | None = None,
        as_child_runs: bool = False,
        input: Any = "$.item",
        parent_close: str = "terminate",
        after: Iterable[str] | None = None,
        when: str | bool | None = None,
        continue_on_failure: bool = False,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
    ) -> Workflow:
        """Run ``step`` once per item of the list at ``over`` (at most ``max_parallel`` at
        once); the output is the list of branch outputs, in item order.

        With ``workflow=...`` and ``as_child_runs=True`` each item is a child run of that
        workflow instead (its input: ``input``, where ``$.item`` is the item).

        Fail fast by default; with ``tolerated_failures=N`` or ``tolerated_failure_ratio=r``
        the gather finishes with ``{"error": ...}`` in the failed branches' places.
        """
        if as_child_runs or workflow is not None:
            return self._add(
                "child_scatter",
                id,
                after,
                when,
                workflow=workflow,
                as_child_runs=as_child_runs,
                step=step,
                over=over,
                input=input,
                args=args,
                max_parallel=max_parallel,
                tolerated_failures=tolerated_failures,
                tolerated_failure_ratio=tolerated_failure_ratio,
                parent_close=parent_close,
                continue_on_failure=continue_on_failure,
            )
        return self._add(
            "scatter",
            id,
            after,
            when,
            step=step,
            args=args,
            continue_on_failure=continue_on_failure,
            retry=retry,
            timeout=timeout,
            over=over,
            item_arg=item_arg,
            max_parallel=max_parallel,
            tolerated_failures=tolerated_failures,
            tolerated_failure_ratio=tolerated_failure_ratio,
        )

    def subworkflow(
        self,
        id: str,
        *,
        workflow: str,
        input: Any = None,
        until: str | None = None,
        parent_close: str = "terminate",
        after: Iterable[str] | None = None,
        when: str | bool | None = None,
        continue_on_failure: bool = False,
    ) -> Workflow:
        """Start a child run of ``workflow`` and wait for it to finish (its output becomes this
        node's), or with ``until`` only until it reaches that checkpoint (the child's context
        there becomes this node's output; the child keeps running)."""
        return self._add(
            "subworkflow",
            id,
            after,
            when,
            workflow=workflow,
            input=input,
            until=until,
            parent_close=parent_close,
            continue_on_failure=continue_on_failure,
        )

    def checkpoint(
        self,
        id: str,
        *,
        after: Iterable[str] | None = None,
        when: str | bool | None = None,
    ) -> Workflow:
        """A named point a parent can wait for (``subworkflow(..., until=id)``); its output is
        the run's context when it is reached."""
        return self._add("checkpoint", id, after, when)

    def sleep(
        self,
        id: str,
        *,
        seconds: float,
        after: Iterable[str] | None = None,
        when: str | bool | None = None,
    ) -> Workflow:
        """A durable timer: a row and the sweeper, never a broker countdown."""
        return self._add("sleep", id, after, when, seconds=seconds)

    def wait_signal(
        self,
        id: str,
        *,
        signal: str,
        timeout: float | None = None,
        on_timeout: str = "fail",
        after: Iterable[str] | None = None,
        when: str | bool | None = None,
        continue_on_failure: bool = False,
    ) -> Workflow:
        """Wait for a signal named ``signal``; its payload becomes the node's output."""
        return self._add(
            "wait_signal",
            id,
            after,
            when,
            signal=signal,
            timeout=timeout,
            on_timeout=on_timeout,
            continue_on_failure=continue_on_failure,
        )

    def approval(
        self,
        id: str,
        *,
        timeout: float | None = None,
        on_timeout: str = "fail",
        on_reject: str = "fail",
        after: Iterable[str] | None = None,
        when: str | bool | None = None,
        continue_on_failure: bool = False,
    ) -> Workflow:
        """Wait for ``ductor.approve``/``ductor.reject``; the decision is the output."""
        return self._add(
            "approval",
            id,
            after,
            when,
            timeout=timeout,
            on_timeout=on_timeout,
            on_reject=on_reject,
            continue_on_failure=continue_on_failure,
        )

    def event_set(
        self,
        id: str,
        *,
        events: Iterable[str],
        mode: str | int = "all",
        timeout: float | None = None,
        on_timeout: str = "fail",
        after: Iterable[str] | None = None,
        when: str | bool | None = None,
        continue_on_failure: bool = False,
    ) -> Workflow:
        """Wait for a set of named signals: ``all``, ``any``, or N distinct ones."""
        return self._add(
            "event_set",
            id,
            after,
            when,
            events=tuple(events) if events is not None else (),
            mode=mode,
            timeout=timeout,
            on_timeout=on_timeout,
            continue_on_failure=continue_on_failure,
        )

    def _add(
        self,
        kind: str,
        id: str,
        after: Iterable[str] | None,
        when: str | bool | None,
        **fields: Any,
    ) -> Workflow:
        self._nodes.append({"kind": kind, "id": id, "after": after, "when": when, **fields})
        return self

    def output(self, template: Any) -> Workflow:
        """The run's output: a literal, a path, or dicts and lists of them."""
        self._output = template
        return self

    def build(
        self,
        resolve_step: StepResolver | None = None,
        resolve_workflow: WorkflowResolver | None = None,
    ) -> WorkflowSpec:
        """Validate and freeze. Raises DefinitionError naming the offending node or path.

        ``resolve_workflow`` finds the workflows that sub-workflow and child-run scatter nodes
        start; their definitions are pinned (by hash) into this one.
        """
        nodes = [self._build_node(raw, resolve_step, resolve_workflow) for raw in self._nodes]
        try:
            spec = WorkflowSpec(
                name=self.name, version=self.version, nodes=tuple(nodes), output=self._output
            )
        except ValueError as exc:  # pydantic: the output is not JSON-like
            raise DefinitionError(f"workflow {self.name!r}: invalid output: {exc}") from None
        validate_spec(spec)
        return spec

    def _build_node(
        self,
        raw: dict[str, Any],
        resolve_step: StepResolver | None,
        resolve_workflow: WorkflowResolver | None,
    ) -> NodeSpec:
        node_id = raw["id"]
        where = f"workflow {self.name!r}, node {node_id!r}"
        if raw["kind"] in CHILD_KINDS:
            return _build_child(raw, where, resolve_workflow)
        if raw["kind"] not in ("step", "scatter"):
            return self._build_parked(raw, where)
        if raw["kind"] == "scatter":
            _check_scatter_options(raw, where)
        step = raw["step"]
        if isinstance(step, str):
            step_name = step
            found = resolve_step(step) if resolve_step is not None else None
            if resolve_step is not None and found is None:
                raise DefinitionError(
                    f"{where}: unknown step {step!r} (decorate it with @ductor.step)"
                )
            step = found if found is not None else step
        elif isinstance(step, StepLike):
            step_name = step.name
            if resolve_step is not None and resolve_step(step_name) is None:
                raise DefinitionError(
                    f"{where}: step {step_name!r} is not registered with this Ductor"
                )
        else:
            raise DefinitionError(
                f"{where}: unknown step {step!r}: pass a @ductor.step function or its name"
            )
        after = raw["after"]
        if after is None:
            after = ()
        elif isinstance(after, str):
            after = (after,)
        args = raw["args"] or {}
        if not isinstance(args, Mapping):
            raise DefinitionError(f"{where}: args must be a mapping of argument name to value")
        policy: RetryPolicy | None = raw["retry"] or (
            step.retry if isinstance(step, StepLike) else None
        )
        retry = policy.to_spec() if policy is not None else RetrySpec()
        timeout = raw["timeout"]
        if timeout is None and isinstance(step, StepLike):
            timeout = step.timeout
        if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
            raise DefinitionError(f"{where}: timeout must be a positive number of seconds")
        common: dict[str, Any] = {
            "id": node_id,
            "step": step_name,
            "after": tuple(after),
            "args": dict(args),
            "when": raw["when"],
            "continue_on_failure": bool(raw["continue_on_failure"]),
            "retry": retry,
            "timeout": timeout,
            "queue": step.queue if isinstance(step, StepLike) else None,
            "heartbeat_timeout": getattr(step, "heartbeat_timeout", None),
            "concurrency": _concurrency_of(step),
        }
        try:
            if raw["kind"] == "step":
                return StepNodeSpec(**common)
            return ScatterNodeSpec(
                **common,
                over=raw["over"],
                item_arg=raw["item_arg"],
                max_parallel=raw["max_parallel"],
                tolerated_failures=raw["tolerated_failures"],
                tolerated_failure_ratio=raw["tolerated_failure_ratio"],
            )
        except ValueError as exc:
            raise DefinitionError(f"{where}: {_detail(exc)}") from None

    def _build_parked(self, raw: dict[str, Any], where: str) -> NodeSpec:
        fields = dict(raw)
        after = fields.pop("after")
        fields["after"] = () if after is None else (after,) if isinstance(after, str) else after
        if fields.get("when") is None:
            fields.pop("when")
        model = _PARKED_MODELS[fields["kind"]]
        if fields["kind"] == "event_set":
            mode = fields.get("mode")
            events = fields.get("events") or ()
            if not events:
                raise DefinitionError(f"{where}: event_set needs at least one event")
            if isinstance(mode, int) and not isinstance(mode, bool):
                if not 1 <= mode <= len(set(events)):
                    raise DefinitionError(
                        f"{where}: mode={mode} must be between 1 and the number of distinct "
                        f"events ({len(set(events))})"
                    )
            elif mode not in ("all", "any"):
                raise DefinitionError(
                    f"{where}: mode must be 'all', 'any' or a number, got {mode!r}"
                )
        try:
            node: NodeSpec = model.model_validate(fields)  # type: ignore[assignment]
        except ValueError as exc:
            raise DefinitionError(f"{where}: {_detail(exc)}") from None
        return node


def _build_child(
    raw: dict[str, Any], where: str, resolve_workflow: WorkflowResolver | None
) -> NodeSpec:
    fields = {k: v for k, v in raw.items() if v is not None or k == "input"}
    fields["after"] = _after(raw["after"])
    if raw["kind"] == "child_scatter":
        if not raw["as_child_runs"] or raw["workflow"] is None or raw["step"] is not None:
            raise DefinitionError(
                f"{where}: a scatter over child runs takes workflow=<name> and "
                "as_child_runs=True, and no step"
            )
        if raw["args"]:
            raise DefinitionError(f"{where}: child runs take input=..., not args=")
        _check_over(raw["over"], where)
        _check_tolerance(raw, where)
        for name in ("as_child_runs", "step", "args"):
            fields.pop(name, None)
    if raw["parent_close"] not in ("terminate", "cancel", "abandon"):
        raise DefinitionError(
            f"{where}: parent_close must be 'terminate', 'cancel' or 'abandon', "
            f"got {raw['parent_close']!r}"
        )
    child_name = raw["workflow"]
    if not isinstance(child_name, str) or not child_name:
        raise DefinitionError(f"{where}: workflow must be the name of a registered workflow")
    child = resolve_workflow(child_name) if resolve_workflow is not None else None
    if child is not None:
        # Registered already: pin its definition. One registered later (or this workflow
        # itself) is resolved by name when a run starts: the newest definition then.
        fields["workflow_hash"] = child.spec_hash
        until = raw.get("until")
        if until is not None and not isinstance(child.graph.nodes.get(until), CheckpointNodeSpec):
            raise DefinitionError(
                f"{where}: workflow {child_name!r} has no checkpoint {until!r} "
                "(add wf.checkpoint(...) to it)"
            )
    model = SubworkflowNodeSpec if raw["kind"] == "subworkflow" else ChildScatterNodeSpec
    try:
        node: NodeSpec = model.model_validate(fields)
    except ValueError as exc:
        raise DefinitionError(f"{where}: {_detail(exc)}") from None
    return node


def _detail(exc: ValueError) -> str:
    """A pydantic validation error in one line: the field and what is wrong with it."""
    lines = str(exc).splitlines()
    return "; ".join(line.strip() for line in lines[1:3]) if len(lines) > 1 else str(exc)


def _after(after: Any) -> tuple[str, ...]:
    if after is None:
        return ()
    if isinstance(after, str):
        return (after,)
    return tuple(after)


def _check_over(over: Any, where: str) -> None:
    if not isinstance(over, str) or not over.startswith(("$.input", "$.nodes.")):
        raise DefinitionError(
            f"{where}: over={over!r} must be a path to a list under $.input or "
            "$.nodes.<id>.output (they never change while the scatter runs)"
        )


def _check_tolerance(raw: dict[str, Any], where: str) -> None:
    if raw["tolerated_failures"] is not None and raw["tolerated_failure_ratio"] is not None:
        raise DefinitionError(
            f"{where}: give tolerated_failures or tolerated_failure_ratio, not both"
        )
    for name in ("max_parallel", "tolerated_failures"):
        value = raw[name]
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise DefinitionError(f"{where}: {name} must be an integer, got {value!r}")


def _check_scatter_options(raw: dict[str, Any], where: str) -> None:
    if raw["step"] is None:
        raise DefinitionError(f"{where}: scatter needs a step to run for each item")
    _check_over(raw["over"], where)
    _check_tolerance(raw, where)
    item_arg = raw["item_arg"]
    if item_arg is not None:
        if not isinstance(item_arg, str) or not item_arg.isidentifier():
            raise DefinitionError(f"{where}: item_arg must be an argument name, got {item_arg!r}")
        if item_arg in (raw["args"] or {}):
            raise DefinitionError(
                f"{where}: item_arg {item_arg!r} is also given in args; rename one of them"
            )


def _concurrency_of(step: object) -> ConcurrencySpec | None:
    limit = getattr(step, "concurrency", None)
    return limit.to_spec() if limit is not None else None


_PARKED_MODELS: dict[str, type[BaseModel]] = {
    "checkpoint": CheckpointNodeSpec,
    "sleep": SleepNodeSpec,
    "wait_signal": WaitSignalNodeSpec,
    "approval": ApprovalNodeSpec,
    "event_set": EventSetNodeSpec,
}
