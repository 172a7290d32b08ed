"""The stored form of a workflow: frozen pydantic models, hashed and pinned by each run."""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from ..limits import (
    MAX_ATTEMPTS,
    MAX_BACKOFF,
    MAX_BATCH_SIZE,
    MAX_DURATION_S,
    MAX_ID_LENGTH,
    MAX_INT,
    MAX_LEASE_KEY_LENGTH,
)
from .paths import iter_paths

# The bounds below repeat, as a backstop, what the builder checks with a message naming the
# node: a spec read back from the database can then never carry a value that makes every tick
# raise (an infinite timeout overflowing ``now + seconds``, an id too long for its column).
#: A name or id as stored: node ids, workflow, step, queue and signal names (``VARCHAR(200)``).
Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_LENGTH)]
#: A duration that may be zero (sleeps, retry intervals): finite, at most ten years.
Seconds = Annotated[float, Field(ge=0, le=MAX_DURATION_S, allow_inf_nan=False)]
#: A timeout: positive, finite, at most ten years.
Timeout = Annotated[float, Field(gt=0, le=MAX_DURATION_S, allow_inf_nan=False)]
#: What a 32-bit signed integer column holds, from 0 (``Count``) or 1 (``PositiveCount``).
Count = Annotated[int, Field(ge=0, le=MAX_INT)]
PositiveCount = Annotated[int, Field(ge=1, le=MAX_INT)]
Ratio = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]

#: The one argument of a batch attempt (a scatter with ``batch_size`` > 1): the per-item
#: arguments travel under it. No step or scatter may name an argument so (the builder refuses
#: it), so a worker tells a batch attempt from a plain one by its arguments alone.
BATCH_ARG = "__ductor_batch__"

#: Signal names starting with this are ductor's own (approval decisions); users cannot send
#: them, so a node waiting for one would wait forever.
RESERVED_SIGNAL_PREFIX = "ductor."


class RetrySpec(BaseModel):
    """The retry policy as stored: exception classes become their qualified names."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_attempts: int = Field(default=3, ge=1, le=MAX_ATTEMPTS)
    initial_interval: Seconds = 1.0
    backoff: float = Field(default=2.0, ge=1, le=MAX_BACKOFF, allow_inf_nan=False)
    max_interval: Seconds = 60.0
    non_retryable: tuple[str, ...] = ()
    jitter: float = Field(default=0.0, ge=0, le=1, allow_inf_nan=False)
    #: What a node that has used every attempt does: fail (and the run with it) or pause the
    #: run with the node failed, until an operator resumes it (docs/operations.md).
    on_exhausted: Literal["fail", "pause"] = "fail"

    @model_serializer(mode="wrap")
    def _without_defaults_added_later(self, handler: Any) -> Any:
        # Left out at their defaults: a definition that does not use them keeps the hash it
        # had before they existed, so runs in flight and re-registered workflows match.
        data = handler(self)
        if isinstance(data, dict):
            if not data.get("jitter"):
                data.pop("jitter", None)
            if data.get("on_exhausted") == "fail":
                data.pop("on_exhausted", None)
        return data


class ConcurrencySpec(BaseModel):
    """A concurrency limit as stored: ``key`` is a path (or a literal) resolved per attempt."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str = Field(min_length=1, max_length=MAX_LEASE_KEY_LENGTH)
    limit: PositiveCount


class RateLimitSpec(BaseModel):
    """A rate limit as stored: ``limit`` attempts per ``period`` seconds per resolved ``key``
    (a path, or None for one bucket per step). See docs/flow-control.md."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    limit: PositiveCount
    period: Literal[1, 60, 3600]
    key: str | None = Field(default=None, min_length=1, max_length=MAX_LEASE_KEY_LENGTH)


class RunConcurrencySpec(BaseModel):
    """Run concurrency as stored: at most ``limit`` open runs per value of ``key`` (a
    ``$.input`` path, or a literal shared by every run); ``strategy`` says what a run beyond
    the limit does. See docs/flow-control.md."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str = Field(min_length=1, max_length=MAX_LEASE_KEY_LENGTH)
    limit: PositiveCount
    strategy: Literal["queue", "cancel_in_progress", "cancel_newest"] = "queue"


def allowed_failures(count: int | None, ratio: float | None, total: int) -> int:
    """How many of ``total`` branches may fail with the gather still succeeding (0: fail fast)."""
    if count is not None:
        return count
    if ratio is not None:
        return int(ratio * total)
    return 0


class _NodeBase(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: Id
    after: tuple[str, ...] = ()
    when: str | bool | None = None
    continue_on_failure: bool = False


def _without_unset_schedule_to_start(data: dict[str, Any]) -> dict[str, Any]:
    if data.get("schedule_to_start_timeout", 0) is None:
        del data["schedule_to_start_timeout"]
    return data


class AttemptNodeSpec(_NodeBase):
    """What every node that runs step attempts shares: the step, its arguments and policies."""

    step: Id
    args: dict[str, Any] = Field(default_factory=dict)
    retry: RetrySpec = Field(default_factory=RetrySpec)
    timeout: Timeout | None = None
    #: An attempt that has not heartbeaten (ctx.heartbeat) for this long is declared lost.
    heartbeat_timeout: Timeout | None = None
    queue: Id | None = None
    #: At most ``limit`` attempts of this step with the same resolved key run at once.
    concurrency: ConcurrencySpec | None = None
    #: An attempt not claimed within this long of its dispatch (no worker took its message,
    #: or it waited for a concurrency lease) times out and retries. Left out of the stored
    #: form when unset, so specs (and hashes) without it are what they were.
    schedule_to_start_timeout: Timeout | None = None
    #: At most ``limit`` attempts of this step per period per resolved key, counted at claim.
    #: Left out of the stored form when unset, like ``schedule_to_start_timeout``.
    rate_limit: RateLimitSpec | None = None

    @model_serializer(mode="wrap")
    def _dump_attempt(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = _without_unset_schedule_to_start(handler(self))
        for name in ("rate_limit", "compensate"):
            if data.get(name, 0) is None:
                del data[name]
        return data


#: A compensation's node id is its step node's id plus this suffix (``"charge~compensate"``).
#: User node ids cannot hold ``~`` (``validate.py``), so it never names a node of the graph.
COMPENSATION_SUFFIX = "~compensate"


def compensation_id(node: str) -> str:
    """The id the compensation of ``node`` runs under (its attempt rows, state, history)."""
    return f"{node}{COMPENSATION_SUFFIX}"


def compensated_node(node_id: str) -> str | None:
    """The node a compensation id compensates; ``None`` for any other id."""
    if node_id.endswith(COMPENSATION_SUFFIX):
        return node_id[: -len(COMPENSATION_SUFFIX)]
    return None


class CompensationSpec(AttemptNodeSpec):
    """The step that undoes a succeeded step node when its run fails (or is cancelled with
    ``compensate_on_cancel``): called with the node's ``output`` and the run's ``input``, with
    the compensation step's own retry policy, timeouts and queue (docs/compensation.md). Its
    ``id`` is ``compensation_id(<node>)``; its ``args`` stay empty (the engine passes them)."""

    kind: Literal["compensation"] = "compensation"


class StepNodeSpec(AttemptNodeSpec):
    """A node that runs one attempt of a step at a time until it succeeds or runs out of tries."""

    kind: Literal["step"] = "step"
    #: What undoes this node when the run fails (``wf.step(..., compensate=refund)``). Left out
    #: of the stored form when unset, so specs without it keep their hashes.
    compensate: CompensationSpec | None = None


class ScatterNodeSpec(AttemptNodeSpec):
    """Runs the step once per item of the list at ``over``, at most ``max_parallel`` at once;
    the output is the list of branch outputs in item order."""

    kind: Literal["scatter"] = "scatter"
    over: str
    #: The argument that receives the item (``None``: only ``args``, which may read ``$.item``).
    item_arg: str | None = "item"
    max_parallel: PositiveCount = 64
    tolerated_failures: Count | None = None
    tolerated_failure_ratio: Ratio | None = None
    #: Items per attempt: a branch is a batch of up to this many consecutive items, run in one
    #: attempt (``max_parallel`` then counts batches). Left out of the stored form when 1, so
    #: the specs (and hashes) of unbatched scatters are what they were before it existed.
    batch_size: int = Field(default=1, ge=1, le=MAX_BATCH_SIZE)

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = _without_unset_schedule_to_start(handler(self))
        if data.get("batch_size") == 1:
            del data["batch_size"]
        return data

    def branch_args(self) -> dict[str, Any]:
        """The argument template of one branch: ``args`` plus the item under ``item_arg``."""
        if self.item_arg is None:
            return dict(self.args)
        return {**self.args, self.item_arg: "$.item"}

    def allowed_failures(self, total: int) -> int:
        """How many branches may fail with the gather still succeeding (0: fail fast)."""
        return allowed_failures(self.tolerated_failures, self.tolerated_failure_ratio, total)


class SleepNodeSpec(_NodeBase):
    """A durable timer: waits ``seconds``, then succeeds with output ``None``."""

    kind: Literal["sleep"] = "sleep"
    seconds: Seconds


class _ParkedBase(_NodeBase):
    timeout: Timeout | None = None
    on_timeout: Literal["fail", "continue"] = "fail"


class WaitSignalNodeSpec(_ParkedBase):
    """Waits for the oldest unapplied signal named ``signal``; its payload is the output."""

    kind: Literal["wait_signal"] = "wait_signal"
    signal: Id


class ApprovalNodeSpec(_ParkedBase):
    """Waits for approve/reject; the decision is the output."""

    kind: Literal["approval"] = "approval"
    on_reject: Literal["fail", "continue"] = "fail"


class EventSetNodeSpec(_ParkedBase):
    """Waits for signals named in ``events``: all of them, any one, or N distinct ones."""

    kind: Literal["event_set"] = "event_set"
    events: tuple[Id, ...] = Field(min_length=1)
    mode: Literal["all", "any"] | PositiveCount = "all"

    def needed(self) -> int:
        if self.mode == "all":
            return len(set(self.events))
        if self.mode == "any":
            return 1
        return int(self.mode)


ParentClose = Literal["terminate", "cancel", "abandon"]


class _ChildBase(_NodeBase):
    """A node that starts child runs of another registered workflow."""

    workflow: Id
    #: The child definition pinned when the parent was registered (None: the latest by name).
    workflow_hash: str | None = None
    #: What happens to open children when this run is cancelled, terminated or fails.
    parent_close: ParentClose = "terminate"


class SubworkflowNodeSpec(_ChildBase):
    """Starts one child run and waits for it to finish, or only to reach checkpoint ``until``.

    The output is the child's output, or with ``until`` the child's context at the checkpoint.
    """

    kind: Literal["subworkflow"] = "subworkflow"
    input: Any = None
    until: str | None = None


class ChildScatterNodeSpec(_ChildBase):
    """One child run per item of ``over`` (at most ``max_parallel`` open at once); the output
    is the list of the children's outputs in item order."""

    kind: Literal["child_scatter"] = "child_scatter"
    over: str
    #: Each child's input; ``$.item`` is its item.
    input: Any = "$.item"
    max_parallel: PositiveCount = 64
    tolerated_failures: Count | None = None
    tolerated_failure_ratio: Ratio | None = None

    def allowed_failures(self, total: int) -> int:
        return allowed_failures(self.tolerated_failures, self.tolerated_failure_ratio, total)


class CheckpointNodeSpec(_NodeBase):
    """A named point: succeeds as soon as it is reached, its output the context at that moment.
    A parent's ``subworkflow(..., until=<this id>)`` proceeds when the child gets here."""

    kind: Literal["checkpoint"] = "checkpoint"


NodeSpec = Annotated[
    StepNodeSpec
    | ScatterNodeSpec
    | SubworkflowNodeSpec
    | ChildScatterNodeSpec
    | CheckpointNodeSpec
    | SleepNodeSpec
    | WaitSignalNodeSpec
    | ApprovalNodeSpec
    | EventSetNodeSpec,
    Field(discriminator="kind"),
]
CHILD_KINDS = frozenset({"subworkflow", "child_scatter"})

#: The signal name an approval decision for ``node`` travels under.
APPROVAL_SIGNAL_PREFIX = "ductor.approval:"


def approval_signal(node: str) -> str:
    return f"{APPROVAL_SIGNAL_PREFIX}{node}"


def node_templates(node: BaseModel) -> list[Any]:
    """Everything in a node that may hold paths: arguments, condition, lease key, rate key,
    scatter list, child input."""
    concurrency = getattr(node, "concurrency", None)
    rate_limit = getattr(node, "rate_limit", None)
    return [
        getattr(node, "args", None),
        getattr(node, "when", None),
        concurrency.key if concurrency is not None else None,
        rate_limit.key if rate_limit is not None else None,
        getattr(node, "over", None),
        getattr(node, "input", None),
    ]


class Graph:
    """Derived, read-only facts about a spec's graph, computed once per spec."""

    def __init__(self, spec: WorkflowSpec) -> None:
        self.nodes: dict[str, NodeSpec] = {n.id: n for n in spec.nodes}
        self.dependants: dict[str, list[str]] = {n.id: [] for n in spec.nodes}
        for n in spec.nodes:
            for dep in n.after:
                if dep in self.dependants:
                    self.dependants[dep].append(n.id)
        self.order: list[str] = _topological_order(spec)
        # Which node outputs each node reads (args and when), and which the run output reads.
        self.reads: dict[str, frozenset[str]] = {
            n.id: frozenset(p.node for p in iter_paths(node_templates(n)) if p.node is not None)
            for n in spec.nodes
        }
        self.output_reads: frozenset[str] = frozenset(
            p.node for p in iter_paths(spec.output) if p.node is not None
        )
        #: The nodes of each kind a tick drives in a pass of its own, in topological order:
        #: those passes look at these nodes only (engine/scatter.py ``drive_scatters``,
        #: engine/external.py ``absorb_external``, engine/children.py ``absorb_subworkflows``).
        self.scatters: tuple[str, ...] = self._of_kind(ScatterNodeSpec | ChildScatterNodeSpec)
        self.parked: tuple[str, ...] = self._of_kind(
            SleepNodeSpec | WaitSignalNodeSpec | ApprovalNodeSpec | EventSetNodeSpec
        )
        self.subworkflows: tuple[str, ...] = self._of_kind(SubworkflowNodeSpec)
        #: Compensation id -> its spec, for every step node with ``compensate=``.
        self.compensations: dict[str, CompensationSpec] = {
            n.compensate.id: n.compensate
            for n in spec.nodes
            if isinstance(n, StepNodeSpec) and n.compensate is not None
        }

    def _of_kind(self, kind: Any) -> tuple[str, ...]:
        return tuple(n for n in self.order if isinstance(self.nodes[n], kind))

    def declared(self, node_id: str) -> NodeSpec | CompensationSpec | None:
        """The node of this id, or the compensation it names (``"charge~compensate"``);
        None when the definition has neither."""
        return self.compensations.get(node_id) or self.nodes.get(node_id)


def _topological_order(spec: WorkflowSpec) -> list[str]:
    """Kahn's algorithm, stable in declaration order. Nodes on a cycle are left out."""
    indegree = {n.id: len(set(n.after)) for n in spec.nodes}
    dependants: dict[str, list[str]] = {n.id: [] for n in spec.nodes}
    for n in spec.nodes:
        for dep in set(n.after):
            dependants.setdefault(dep, []).append(n.id)
    ready = [n.id for n in spec.nodes if indegree[n.id] == 0]
    order: list[str] = []
    while ready:
        current = ready.pop(0)
        order.append(current)
        for child in dependants.get(current, []):
            indegree[child] -= 1
            if indegree[child] == 0:
                ready.append(child)
    return order


def _unsigned_zeros(value: Any) -> Any:
    if isinstance(value, float):
        return 0.0 if value == 0 else value
    if isinstance(value, dict):
        return {k: _unsigned_zeros(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unsigned_zeros(v) for v in value]
    return value


class WorkflowSpec(BaseModel):
    """A whole workflow: its name, version, nodes in declaration order and output template."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Id
    version: PositiveCount = 1
    nodes: tuple[NodeSpec, ...]
    output: Any = None
    #: The default deadline of its runs, in seconds from their start (``start(deadline=...)``
    #: overrides it). Left out of the stored form when unset, so a workflow without one keeps
    #: the hash it had before deadlines existed.
    deadline: Timeout | None = None
    #: At most ``limit`` open runs per key (docs/flow-control.md). Left out when unset.
    concurrency: RunConcurrencySpec | None = None
    #: The default priority of its runs, 0..9 (``start(priority=...)`` overrides it). Left out
    #: at 0.
    priority: Annotated[int, Field(ge=0, le=9)] = 0
    #: A cancelled run compensates its succeeded nodes too (a failed one always does).
    #: Left out at False.
    compensate_on_cancel: bool = False

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name, default in (
            ("deadline", None),
            ("concurrency", None),
            ("priority", 0),
            ("compensate_on_cancel", False),
        ):
            if data.get(name, default) == default:
                data.pop(name, None)
        return data

    def canonical_json(self) -> str:
        """The text the spec hash is taken of: the stored form, keys sorted, and ``-0.0``
        written as ``0.0``, since PostgreSQL's jsonb keeps no sign on zero: a spec read back
        from it must hash as the one stored."""
        return json.dumps(
            _unsigned_zeros(self.model_dump(mode="json")), sort_keys=True, separators=(",", ":")
        )

    @cached_property
    def spec_hash(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    @cached_property
    def graph(self) -> Graph:
        return Graph(self)
