"""What a tick reads besides the state, and the decisions it returns (TickPayload)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..definition.blobrefs import BlobNeeds
from ..definition.spec import WorkflowSpec
from .kinds import ControlKind, ControlResult, DispatchKind
from .state import RunState
from .status import AttemptOutcome, RunStatus


@dataclass(frozen=True, slots=True)
class EngineConfig:
    resend_unclaimed_after: float = 30.0
    default_step_timeout: float = 300.0
    max_payload_bytes: int = 67_108_864
    #: Values larger than this are stored by reference (docs/large-values.md); only the size
    #: of a context patch is held to it here (the context lives in the run row).
    offload_bytes: int = 262_144
    max_transitions: int = 10_000
    #: A node waiting on child runs looks at them at least this often, whatever wake-ups were
    #: lost on the way (a cheap backstop: one small commit per period).
    child_poll_after: float = 60.0
    #: How long a cancel waits for attempts in flight to stop on their own (engine/cancel.py).
    cancel_grace: float = 30.0


@dataclass(frozen=True, slots=True)
class AttemptResult:
    """A finished attempt row that has not been folded into the run yet."""

    token: str
    node: str
    #: What its worker wrote (``WRITTEN_BY_WORKER``).
    outcome: AttemptOutcome
    output: Any = None
    error: dict[str, Any] | None = None
    retryable: bool = True
    patch: dict[str, Any] | None = None
    branch: int | None = None
    #: The tags the step set (``ctx.tag``): ``[[key, value], ...]`` in the order it set them,
    #: applied only if it succeeded (engine/tags.py, ``StepTags``).
    tags: list[list[str]] | None = None
    #: Its output and context patch passed the step worker's own checks in the process that
    #: computes with it (an outcome carried by its eager tick, not read from a row): the
    #: guard against bad rows (``advance._bad_success``) does not check them again.
    checked: bool = False
    #: A checked output's JSON text as its check made it (the step worker's
    #: ``Outcome.output_text``): the commit's parameter is taken from it instead of encoding
    #: the output again. Not part of the result's value.
    output_text: str | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class AttemptCheck:
    """The claim status of an in-flight attempt whose check time is due."""

    token: str
    claimed_at: datetime | None
    finished: bool
    heartbeat_at: datetime | None = None
    #: Unclaimed because it waits for a concurrency lease (not because a message was lost):
    #: the release that grants it sends its message, so the coordinator does not re-send.
    lease_waiting: bool = False


@dataclass(frozen=True, slots=True)
class SignalIn:
    """An accepted signal not applied yet, in the order it was accepted."""

    id: int
    name: str
    payload: Any = None


@dataclass(frozen=True, slots=True)
class ControlIn:
    """The oldest unhandled operator control of the run."""

    id: int
    #: A str only for a kind this version does not know (a row written by a newer ductor):
    #: the tick rejects it as unknown.
    kind: ControlKind | str
    reason: str | None = None
    input: Any = None
    has_input: bool = False
    #: A redrive from a node: that node (it and every node after it rerun).
    node: str | None = None
    #: A continue-as-new to another definition (``version=``): the successor's spec hash;
    #: its spec is in ``TickInputs.successor_spec``.
    spec_hash: str | None = None


@dataclass(frozen=True, slots=True)
class ChildSnapshot:
    """What a parent reads of a child run it waits on (the newest run of its
    continue-as-new chain). ``status`` is a ``RunStatus`` value, or ``CHILD_MISSING`` when the
    child row does not exist."""

    run_id: str
    status: str
    output: Any = None
    error: dict[str, Any] | None = None
    #: Checkpoints the child has reached that the parent waits for: name -> context there.
    checkpoints: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TickInputs:
    run_id: str
    input: Any = None
    results: tuple[AttemptResult, ...] = ()
    checks: dict[str, AttemptCheck] = field(default_factory=dict)
    #: Outputs of nodes that succeeded in earlier ticks and that pending nodes read.
    outputs: dict[str, Any] = field(default_factory=dict)
    config: EngineConfig = field(default_factory=EngineConfig)
    signals: tuple[SignalIn, ...] = ()
    control: ControlIn | None = None
    #: Payloads of signals already applied to event sets still waiting (by signal id).
    received: dict[int, Any] = field(default_factory=dict)
    #: Gathered outputs of scatters whose branches all finished (node -> list in item order).
    gathered: dict[str, list[Any]] = field(default_factory=dict)
    #: Snapshots of the child runs the run waits on, by the child run id it started.
    children: dict[str, ChildSnapshot] = field(default_factory=dict)
    #: A continue-as-new to another definition (``version=``) being applied or drained: that
    #: definition (``successor_spec_hash`` names the one the loader should read).
    successor_spec: WorkflowSpec | None = None
    #: Run concurrency (docs/flow-control.md): whether the run holds one of its key's slots
    #: (always True for a workflow without a limit); ``refused``: why the run is cancelled
    #: instead of waiting (``cancel_newest``); ``wake``: runs asked to cancel to make room
    #: (``cancel_in_progress``), which this tick wakes.
    admitted: bool = True
    refused: str | None = None
    wake: tuple[str, ...] = ()
    #: Large values (docs/large-values.md) read for this tick's paths, by blob id, and pages
    #: of offloaded lists a scatter dispatches (blob id -> item index -> item).
    blobs: dict[str, Any] = field(default_factory=dict)
    items: dict[str, dict[int, Any]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class NewAttempt:
    token: str
    node: str
    step: str
    queue: str | None
    generation: int
    attempt: int
    args: dict[str, Any]
    #: When set, the store copies the args of this earlier attempt (a retry) instead.
    args_from: str | None
    timeout: float
    #: A concurrency lease the attempt must hold before it may run: the resolved key (step
    #: name included) and the limit. A retry (``args_from``) keeps its first attempt's key.
    lease_key: str | None = None
    lease_limit: int | None = None
    #: The scatter branch this attempt runs (None for a plain step node).
    branch: int | None = None
    #: The rate-limit bucket the attempt takes a token from when claimed (step name
    #: included), N and the period in seconds. A retry keeps its first attempt's key.
    rate_key: str | None = None
    rate_limit: int | None = None
    rate_period: float | None = None
    #: ``args``' JSON text as their payload check made it (``payloads.JsonCheck.text``), for
    #: the store and the inline claim to take instead of encoding them again; None when not
    #: known. Not part of the attempt's value; dropped wherever ``args`` is replaced.
    args_text: str | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class ClosedAttempt:
    """An attempt the coordinator closes itself (timed out, or cancelled with its run)."""

    token: str
    outcome: AttemptOutcome  # one of CLOSED_BY_COORDINATOR
    error: dict[str, Any]
    #: For metrics only (not compared): the attempt's step, and whether it timed out because
    #: its worker went silent (no heartbeat) rather than ran too long.
    step: str | None = field(default=None, compare=False)
    lost: bool = field(default=False, compare=False)


@dataclass(frozen=True, slots=True)
class Dispatch:
    """A message to send after commit. ``step`` dispatches carry the attempt token."""

    kind: DispatchKind
    run_id: str
    node: str
    token: str
    step: str
    queue: str | None
    #: A revoke that also kills the step if it is running (``revoke(terminate=True)``):
    #: terminate and a run deadline; cancel only drops queued messages.
    terminate: bool = False


@dataclass(frozen=True, slots=True)
class Transition:
    node: str | None  # None: the run itself
    from_status: str | None
    to_status: str
    reason: str


@dataclass(frozen=True, slots=True)
class AppliedSignal:
    id: int
    node: str | None  # None: ignored (its node was no longer waiting)


@dataclass(frozen=True, slots=True)
class HandledControl:
    id: int
    result: ControlResult  # CONTROL_APPLIED, or control_rejected(why)


@dataclass(frozen=True, slots=True)
class SuccessorRun:
    """The run a continue-as-new starts, written in the same commit."""

    run_id: str
    state: RunState
    input: Any
    #: ``continue_as_new(version=...)``: the successor's definition and its version
    #: (None: the predecessor's own).
    spec_hash: str | None = None
    version: int | None = None


@dataclass(frozen=True, slots=True)
class ChildStart:
    """A child run to insert in the same commit (a duplicate id is ignored: ids are
    deterministic, so a recomputed tick never starts two)."""

    run_id: str
    workflow: str
    spec_hash: str | None
    input: Any
    node: str
    #: Appended to the parent's workflow id to make the child's.
    workflow_id_suffix: str


@dataclass(frozen=True, slots=True)
class ChildControl:
    """A control for a child run (its parent closed): cancel or terminate."""

    run_id: str
    kind: ControlKind
    reason: str


@dataclass(slots=True)
class TickPayload:
    state: RunState
    changed: bool = False
    new_attempts: list[NewAttempt] = field(default_factory=list)
    closed: list[ClosedAttempt] = field(default_factory=list)
    folded: list[str] = field(default_factory=list)
    dispatches: list[Dispatch] = field(default_factory=list)
    transitions: list[Transition] = field(default_factory=list)
    next_wake_at: datetime | None = None
    output: Any = None
    error: dict[str, Any] | None = None
    applied_signals: list[AppliedSignal] = field(default_factory=list)
    handled_control: HandledControl | None = None
    successor: SuccessorRun | None = None
    #: A redrive reopened a finished run: the store clears its output, error and finish time.
    reopened: bool = False
    #: The run ended in this tick (its last move was to a terminal status): the store writes
    #: its output, error and finish time, wakes its parent and tells waiters. Not the same as
    #: "terminal now and not at load": a redrive can reopen a run and finish it in one tick.
    finished: bool = False
    child_starts: list[ChildStart] = field(default_factory=list)
    child_controls: list[ChildControl] = field(default_factory=list)
    #: A checkpoint was reached: a parent waiting for it is woken.
    checkpoint_reached: bool = False
    #: A cooperative cancel was requested: the commit sets ``cancel_requested_at`` on these
    #: open attempts, which their workers read back with their next heartbeat.
    cancel_requested: list[str] = field(default_factory=list)
    #: Tags this tick added or changed (a succeeded attempt's ``ctx.tag``): the commit
    #: upserts them into ``eec_run_tag``, as the state already holds them.
    tags_set: dict[str, str] = field(default_factory=dict)
    #: Large values the tick's paths read inside that its inputs did not hold: never
    #: committed; the loop reads them and computes the tick again (coordinator/loop.py).
    needs: BlobNeeds | None = None

    @property
    def status(self) -> RunStatus:
        return self.state.status
