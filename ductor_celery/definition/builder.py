"""The Workflow builder users write, turned into a validated WorkflowSpec at register time.

The builder only records what it is told; every check happens in ``build()`` so that a bad
definition is reported by ``register`` with a message naming the node or path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel

from ..errors import DefinitionError
from ..limits import MAX_ID_LENGTH, duration_problem, id_problem, int_problem
from .checks import (
    after_ids,
    check_batch_lease,
    check_batch_rate,
    check_events,
    check_literals,
    check_over,
    check_scatter_options,
    check_timeout,
    check_tolerance,
    check_when,
    refuse,
    signal_problem,
)
from .retry import RateLimit, RetryPolicy, RunConcurrency, priority_problem
from .spec import (
    BATCH_ARG,
    CHILD_KINDS,
    COMPENSATION_SUFFIX,
    ApprovalNodeSpec,
    CheckpointNodeSpec,
    ChildScatterNodeSpec,
    CompensationSpec,
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
    compensation_id,
)
from .validate import check_node_id, short, validate_spec


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

    def __init__(
        self,
        name: str,
        version: int = 1,
        *,
        deadline: float | None = None,
        concurrency: RunConcurrency | None = None,
        priority: int = 0,
        compensate_on_cancel: bool = False,
    ) -> None:
        problem = id_problem(name)
        if problem is not None:
            raise DefinitionError(f"workflow name {short(name)}: the name {problem}")
        problem = int_problem(version, minimum=1)
        if problem is not None:
            raise DefinitionError(f"workflow {name!r}: version {problem}")
        # Seconds from a run's start; each run may set its own with start(deadline=...).
        check_timeout(f"workflow {name!r}", "deadline", deadline)
        if concurrency is not None and not isinstance(concurrency, RunConcurrency):
            raise DefinitionError(
                f"workflow {name!r}: concurrency= takes a RunConcurrency(key, limit, strategy), "
                f"got {short(concurrency)}"
            )
        problem = priority_problem(priority)
        if problem is not None:
            raise DefinitionError(f"workflow {name!r}: {problem}")
        self.name = name
        self.version = version
        self.deadline = deadline
        self.concurrency = concurrency
        self.priority = priority
        if not isinstance(compensate_on_cancel, bool):
            raise DefinitionError(
                f"workflow {name!r}: compensate_on_cancel must be True or False, "
                f"got {short(compensate_on_cancel)}"
            )
        self.compensate_on_cancel = compensate_on_cancel
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
        rate_limit: RateLimit | None = None,
        compensate: StepLike | str | None = None,
    ) -> Workflow:
        """Add a node that runs ``step`` with ``args`` once every node in ``after`` finished.

        ``retry``, ``timeout`` and ``rate_limit`` given here replace the step's own.
        ``compensate``: a step called as ``compensate(ctx, output, input)`` to undo this node
        when the run fails after it succeeded (docs/compensation.md); it runs with its own
        retry policy, timeouts and queue."""
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
            rate_limit=rate_limit,
            compensate=compensate,
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
        batch_size: int = 1,
        workflow: str | None = None,
        as_child_runs: bool = False,
        input: Any = "$.item",
        parent_close: str = "terminate",
        after: Iterable[str] | None = None,
        when: str | bool | None = None,
        continue_on_failure: bool = False,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
        rate_limit: RateLimit | None = None,
    ) -> Workflow:
        """Run ``step`` once per item of the list at ``over`` (at most ``max_parallel`` at
        once); the output is the list of branch outputs, in item order.

        With ``workflow=...`` and ``as_child_runs=True`` each item is a child run of that
        workflow instead (its input: ``input``, where ``$.item`` is the item).

        Fail fast by default; with ``tolerated_failures=N`` or ``tolerated_failure_ratio=r``
        the gather finishes with ``{"error": ...}`` in the failed branches' places.

        ``batch_size=n`` sends up to ``n`` consecutive items in one message and one attempt
        (``max_parallel`` then counts batches); the step is still called once per item, and a
        retry of a batch runs only its items without a recorded output. Tolerances count items.
        """
        if as_child_runs or workflow is not None:
            if rate_limit is not None:
                raise DefinitionError(
                    f"workflow {self.name!r}, node {short(id)}: rate_limit= limits step "
                    "attempts; a scatter over child runs starts runs (limit the child's steps)"
                )
            if batch_size != 1:
                raise DefinitionError(
                    f"workflow {self.name!r}, node {short(id)}: "
                    f"batch_size={short(batch_size)} batches step attempts; a scatter over "
                    "child runs starts one run per item (leave batch_size at 1)"
                )
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
            rate_limit=rate_limit,
            over=over,
            item_arg=item_arg,
            max_parallel=max_parallel,
            tolerated_failures=tolerated_failures,
            tolerated_failure_ratio=tolerated_failure_ratio,
            batch_size=batch_size,
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
            events=events,
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
        output = check_literals(self._output, f"workflow {self.name!r}", "output")
        try:
            spec = WorkflowSpec(
                name=self.name,
                version=self.version,
                nodes=tuple(nodes),
                output=output,
                deadline=self.deadline,
                concurrency=self.concurrency.to_spec() if self.concurrency else None,
                priority=self.priority,
                compensate_on_cancel=self.compensate_on_cancel,
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
        check_node_id(node_id, f"workflow {self.name!r}")
        where = f"workflow {self.name!r}, node {node_id!r}"
        check_when(raw["when"], where)
        if raw["kind"] in CHILD_KINDS:
            return _build_child(raw, where, resolve_workflow)
        if raw["kind"] not in ("step", "scatter"):
            return self._build_parked(raw, where)
        if raw["kind"] == "scatter":
            check_scatter_options(raw, where)
        step_name, step = _resolve_step(raw["step"], where, resolve_step)
        args = raw["args"] or {}
        if not isinstance(args, Mapping):
            raise DefinitionError(f"{where}: args must be a mapping of argument name to value")
        names = [name for name in args if not isinstance(name, str)]
        if names:
            raise DefinitionError(
                f"{where}: args: argument names are strings, got {short(names[0])}"
            )
        args = check_literals(dict(args), where, "args")
        if BATCH_ARG in args:
            raise DefinitionError(
                f"{where}: args: the argument name {BATCH_ARG!r} is reserved (batch attempts)"
            )
        settings = _attempt_settings(raw, step, where)
        if raw["kind"] == "scatter":
            check_batch_lease(raw["batch_size"], settings["concurrency"], where)
            check_batch_rate(raw["batch_size"], settings["rate_limit"], where)
        common: dict[str, Any] = {
            "id": node_id,
            "step": step_name,
            "after": after_ids(raw["after"], where),
            "args": dict(args),
            "when": raw["when"],
            "continue_on_failure": bool(raw["continue_on_failure"]),
            **settings,
        }
        try:
            if raw["kind"] == "step":
                compensate = _compensation(raw.get("compensate"), node_id, where, resolve_step)
                return StepNodeSpec(**common, compensate=compensate)
            return ScatterNodeSpec(
                **common,
                over=raw["over"],
                item_arg=raw["item_arg"],
                max_parallel=raw["max_parallel"],
                tolerated_failures=raw["tolerated_failures"],
                tolerated_failure_ratio=raw["tolerated_failure_ratio"],
                batch_size=raw["batch_size"],
            )
        except ValueError as exc:
            raise DefinitionError(f"{where}: {_detail(exc)}") from None

    def _build_parked(self, raw: dict[str, Any], where: str) -> NodeSpec:
        fields = dict(raw)
        fields["after"] = after_ids(fields.pop("after"), where)
        if fields.get("when") is None:
            fields.pop("when")
        model = _PARKED_MODELS[fields["kind"]]
        if fields["kind"] == "sleep":
            refuse(where, "seconds", duration_problem(fields["seconds"], allow_zero=True))
        elif "timeout" in fields:
            check_timeout(where, "timeout", fields["timeout"])
        if fields["kind"] == "wait_signal":
            refuse(where, "signal", signal_problem(fields["signal"]))
        if fields["kind"] == "event_set":
            fields["events"] = check_events(fields["events"], fields["mode"], where)
        try:
            node: NodeSpec = model.model_validate(fields)  # type: ignore[assignment]
        except ValueError as exc:
            raise DefinitionError(f"{where}: {_detail(exc)}") from None
        return node


def _resolve_step(
    step: Any, where: str, resolve_step: StepResolver | None
) -> tuple[str, StepLike | str]:
    """The step's name and, when known, its ``@ductor.step`` object."""
    if isinstance(step, str):
        refuse(where, "step name", id_problem(step))
        found = resolve_step(step) if resolve_step is not None else None
        if resolve_step is not None and found is None:
            raise DefinitionError(f"{where}: unknown step {step!r} (decorate it with @ductor.step)")
        return step, found if found is not None else step
    if isinstance(step, StepLike):
        refuse(where, "step name", id_problem(step.name))
        if resolve_step is not None and resolve_step(step.name) is None:
            raise DefinitionError(f"{where}: step {step.name!r} is not registered with this Ductor")
        return step.name, step
    raise DefinitionError(
        f"{where}: unknown step {short(step)}: pass a @ductor.step function or its name"
    )


def _compensation(
    step: Any, node_id: str, where: str, resolve_step: StepResolver | None
) -> CompensationSpec | None:
    """The compensation of a step node (``compensate=``): a registered step, with its own
    settings. Its id (the node's plus ``~compensate``) must fit the node columns."""
    if step is None:
        return None
    where = f"{where}, compensate="
    longest = MAX_ID_LENGTH - len(COMPENSATION_SUFFIX)
    if len(node_id) > longest:
        raise DefinitionError(
            f"{where}: a node with a compensation has an id of at most {longest} characters"
        )
    step_name, known = _resolve_step(step, where, resolve_step)
    settings = _attempt_settings({"retry": None, "timeout": None}, known, where)
    return CompensationSpec(id=compensation_id(node_id), step=step_name, **settings)


def _attempt_settings(raw: dict[str, Any], step: StepLike | str, where: str) -> dict[str, Any]:
    """Retry, timeouts, queue and lease of a step or scatter node: the node's own settings,
    else the step's. Each is checked here, where a message can name the node: a value accepted
    now and unusable later (an infinite timeout) would make every tick of the run raise."""
    known = step if isinstance(step, StepLike) else None
    policy = raw["retry"] if raw["retry"] is not None else getattr(known, "retry", None)
    if policy is not None and not isinstance(policy, RetryPolicy):
        raise DefinitionError(f"{where}: retry= takes a RetryPolicy(...), got {short(policy)}")
    timeout = raw["timeout"] if raw["timeout"] is not None else getattr(known, "timeout", None)
    check_timeout(where, "timeout", timeout)
    heartbeat_timeout = getattr(known, "heartbeat_timeout", None)
    check_timeout(where, "heartbeat_timeout", heartbeat_timeout)
    schedule_to_start = getattr(known, "schedule_to_start_timeout", None)
    check_timeout(where, "schedule_to_start_timeout", schedule_to_start)
    queue = getattr(known, "queue", None)
    if queue is not None:
        refuse(where, "queue", id_problem(queue))
    rate = raw.get("rate_limit")
    if rate is None:
        rate = getattr(known, "rate_limit", None)
    if rate is not None and not isinstance(rate, RateLimit):
        raise DefinitionError(
            f"{where}: rate_limit= takes a RateLimit('N/s', key=...), got {short(rate)}"
        )
    return {
        "retry": policy.to_spec() if policy is not None else RetrySpec(),
        "timeout": timeout,
        "heartbeat_timeout": heartbeat_timeout,
        "schedule_to_start_timeout": schedule_to_start,
        "queue": queue,
        "concurrency": _concurrency_of(known),
        "rate_limit": rate.to_spec() if rate is not None else None,
    }


def _build_child(
    raw: dict[str, Any], where: str, resolve_workflow: WorkflowResolver | None
) -> NodeSpec:
    fields = {k: v for k, v in raw.items() if v is not None or k == "input"}
    fields["after"] = after_ids(raw["after"], where)
    fields["input"] = check_literals(raw["input"], where, "input")
    if raw["kind"] == "child_scatter":
        if not raw["as_child_runs"] or raw["workflow"] is None or raw["step"] is not None:
            raise DefinitionError(
                f"{where}: a scatter over child runs takes workflow=<name> and "
                "as_child_runs=True, and no step"
            )
        if raw["args"]:
            raise DefinitionError(f"{where}: child runs take input=..., not args=")
        check_over(raw["over"], where)
        check_tolerance(raw, where)
        for name in ("as_child_runs", "step", "args"):
            fields.pop(name, None)
    if raw["parent_close"] not in ("terminate", "cancel", "abandon"):
        raise DefinitionError(
            f"{where}: parent_close must be 'terminate', 'cancel' or 'abandon', "
            f"got {short(raw['parent_close'])}"
        )
    child_name = raw["workflow"]
    problem = id_problem(child_name)
    if problem is not None:
        raise DefinitionError(
            f"{where}: workflow must be the name of a registered workflow; it {problem}"
        )
    until = raw.get("until")
    if until is not None:
        refuse(where, "until (a checkpoint node id)", id_problem(until))
    child = resolve_workflow(child_name) if resolve_workflow is not None else None
    if child is not None:
        # Registered already: pin its definition. One registered later (or this workflow
        # itself) is resolved by name when a run starts: the newest definition then.
        fields["workflow_hash"] = child.spec_hash
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
