"""The run state the coordinator keeps in ``eec_workflow_run.state``: small and JSON-friendly.

It holds node statuses, the token each running node waits on, its timers and a reference
(``NodeState.output``) to the row that holds the output: never the outputs themselves, so
the run row's size is bounded by the number of nodes, not by what the steps return.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, TypeVar

from .status import NodeStatus, RunStatus

_T = TypeVar("_T")

#: The datetime fields of an attempt slot (``StepWork``, ``BranchState``).
_ATTEMPT_DATES = ("check_at", "resend_at", "claimed_at", "retry_at", "queued_until")


_FIELD_NAMES: dict[tuple[type, tuple[str, ...]], tuple[str, ...]] = {}


def _field_names(cls: type, skip: tuple[str, ...] = ()) -> tuple[str, ...]:
    """A dataclass's field names, looked up once per class (every tick dumps every node)."""
    names = _FIELD_NAMES.get((cls, skip))
    if names is None:
        names = _FIELD_NAMES[(cls, skip)] = tuple(f.name for f in fields(cls) if f.name not in skip)
    return names


def _dump(obj: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A dataclass as JSON: datetimes as ISO strings, unset (None or 0) fields left out."""
    key = (type(obj), skip)
    dumper = _DUMPERS.get(key)
    if dumper is None:
        dumper = _DUMPERS[key] = _dumper(*key)
    return dumper(obj)


_DUMPERS: dict[tuple[type, tuple[str, ...]], Callable[[Any], dict[str, Any]]] = {}


def _dumper(cls: type, skip: tuple[str, ...]) -> Callable[[Any], dict[str, Any]]:
    """``_dump`` for ``cls``, its fields written out one by one (as ``_copier`` does): every
    tick dumps every step node's bookkeeping, and a scatter's every branch. For each field,
    what the loop it replaces did: left out when None, or equal to 0 and not a dict (0,
    0.0, False); a datetime as its ISO text. Field names are the class's own identifiers."""
    lines = []
    for name in _field_names(cls, skip):
        lines.append(
            f"    v = obj.{name}\n"
            f"    if not (v is None or (v == 0 and not isinstance(v, dict))):\n"
            f"        out[{name!r}] = v.isoformat() if isinstance(v, datetime) else v\n"
        )
    source = f"def dump(obj):\n    out = {{}}\n{''.join(lines)}    return out\n"
    namespace: dict[str, Any] = {"datetime": datetime}
    exec(source, namespace)  # noqa: S102 - generated from the class's own field names
    return namespace["dump"]  # type: ignore[no-any-return]


_COPIERS: dict[type, Callable[[Any], Any]] = {}


def _shallow_copy(obj: _T) -> _T:
    """``copy.copy`` of a slotted dataclass without its reduce protocol, by a function made
    for its class (``_copier``): every tick copies every node's state, and a scatter's every
    branch, so this is one of the engine's hottest lines."""
    copier = _COPIERS.get(type(obj))
    if copier is None:
        copier = _COPIERS[type(obj)] = _copier(type(obj))
    return copier(obj)  # type: ignore[no-any-return]


def _copier(cls: type) -> Callable[[Any], Any]:
    """A function copying the fields of ``cls`` one by one, written out as ``dataclasses``
    writes ``__init__`` (about seven times faster than a loop of ``getattr``/``setattr`` over
    the names). Field names are Python identifiers from the class itself, never data."""
    # Plain assignment only where it is plain: a frozen class (or one with its own
    # ``__setattr__``) gets ``object.__setattr__``, as the loop it replaces did.
    plain = (
        not cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
        and cls.__setattr__ is object.__setattr__  # type: ignore[comparison-overlap]
    )
    assign = "twin.{0} = obj.{0}" if plain else "_set(twin, {0!r}, obj.{0})"
    lines = [f"    {assign.format(name)}\n" for name in _field_names(cls)]
    source = f"def copy(obj):\n    twin = _new(_cls)\n{''.join(lines)}    return twin\n"
    namespace: dict[str, Any] = {"_new": cls.__new__, "_cls": cls, "_set": object.__setattr__}
    exec(source, namespace)  # noqa: S102 - generated from the class's own field names
    return namespace["copy"]  # type: ignore[no-any-return]


def _dates(kwargs: dict[str, Any]) -> dict[str, Any]:
    for name in _ATTEMPT_DATES:
        if kwargs.get(name) is not None:
            kwargs[name] = datetime.fromisoformat(kwargs[name])
    return kwargs


@dataclass(frozen=True, slots=True)
class AttemptOutput:
    """A step's output: the ``output`` column of this attempt row."""

    token: str


@dataclass(frozen=True, slots=True)
class SignalOutput:
    """A wait's or approval's output: the payload of this signal row."""

    signal: int


@dataclass(frozen=True, slots=True)
class EventsOutput:
    """An event set's output: ``{event: payload}`` of these signal rows."""

    #: Event name -> the signal row that delivered it (while waiting: those received so far).
    events: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class LiteralOutput:
    """A small output kept in the state itself (a checkpoint's context, a continued
    timeout's ``{"timed_out": true}``)."""

    value: Any


#: What ``NodeState.output`` holds (``outputs.py``: the references readers resolve).
StoredOutput = AttemptOutput | SignalOutput | EventsOutput | LiteralOutput


def output_to_json(out: StoredOutput | None) -> dict[str, Any]:
    """The stored keys of an output reference, as every ductor version wrote them: one of
    ``output_token``, ``output_signal``, ``output_signals``, ``output_value`` (left out
    when unset, as other unset fields are)."""
    if isinstance(out, AttemptOutput):
        return {"output_token": out.token}
    if isinstance(out, SignalOutput):
        return {"output_signal": out.signal}
    if isinstance(out, EventsOutput):
        return {"output_signals": dict(out.events)} if out.events else {}
    if isinstance(out, LiteralOutput):
        value = out.value
        if value is None or (value == 0 and not isinstance(value, dict)):
            return {}
        return {"output_value": value}
    return {}


#: The keys an output reference is stored under (``output_to_json``).
_OUTPUT_KEYS = frozenset({"output_token", "output_signal", "output_signals", "output_value"})


def output_from_json(data: Mapping[str, Any]) -> StoredOutput | None:
    """The output reference of a stored node state. Rows from every version read the same:
    the keys are unchanged; were several present, the one readers always looked at first
    (token, signal, events, value) wins."""
    token = data.get("output_token")
    if token:
        return AttemptOutput(token)
    signal = data.get("output_signal")
    if signal is not None:
        return SignalOutput(int(signal))
    events = data.get("output_signals")
    if events:
        return EventsOutput({str(e): int(i) for e, i in events.items()})
    value = data.get("output_value")
    return None if value is None else LiteralOutput(value)


@dataclass(slots=True)
class BranchState:
    """One scatter branch in flight: the same attempt bookkeeping as a step node's."""

    token: str | None = None
    generation: int = 0
    attempt: int = 0
    check_at: datetime | None = None
    resends: int = 0
    resend_at: datetime | None = None
    claimed_at: datetime | None = None
    retry_at: datetime | None = None
    error: dict[str, Any] | None = None
    #: A batch (``batch_size`` > 1): how many of its items have a recorded output, as its
    #: latest failed attempt reported; they count as succeeded if the batch gives up.
    done: int = 0
    #: The in-flight attempt's schedule-to-start deadline (``StepWork.queued_until``).
    queued_until: datetime | None = None

    def to_json(self) -> dict[str, Any]:
        return _dump(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BranchState:
        return cls(**_dates(dict(data)))


@dataclass(slots=True)
class ScatterState:
    """A scatter's counters and its in-flight set; never one entry per finished branch.

    Branch outputs stay in attempt rows (run ``run``, node generations above ``base``) and are
    read once, when the gather completes.

    With ``batch`` > 1 a branch is a batch: branch ``b`` covers items
    ``[b * batch, min((b + 1) * batch, total))``; ``next``, ``succeeded`` and ``failed`` still
    count items, ``branches`` is keyed by batch index.
    """

    #: The run whose attempt rows hold the branches (kept across continue-as-new).
    run: str
    #: The node's generation when this scatter started: its branch attempts have higher ones.
    base: int
    total: int
    #: The next item index to start.
    next: int = 0
    succeeded: int = 0
    failed: int = 0
    #: Every branch finished within the failure policy: the next tick reads the gathered list.
    gathering: bool = False
    branches: dict[int, BranchState] = field(default_factory=dict)
    #: Branches refused before they had an attempt row (arguments too large): their errors,
    #: by item index.
    errors: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: Items per branch (the node's ``batch_size``); left out of the stored state when 1.
    batch: int = 1
    #: A child-run scatter: when its child runs are looked at again while it waits. Stored
    #: as the node's ``deadline`` key (``NodeState.to_json``), not in this object's JSON.
    deadline: datetime | None = None

    def to_json(self) -> dict[str, Any]:
        out = _dump(self, skip=("branches", "errors", "batch", "deadline"))
        out["run"], out["base"], out["total"] = self.run, self.base, self.total
        if self.batch != 1:
            out["batch"] = self.batch
        out["branches"] = {str(i): b.to_json() for i, b in self.branches.items()}
        if self.errors:
            out["errors"] = {str(i): e for i, e in self.errors.items()}
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ScatterState:
        kwargs = dict(data)
        kwargs["branches"] = {
            int(i): BranchState.from_json(b) for i, b in (data.get("branches") or {}).items()
        }
        kwargs["errors"] = {int(i): e for i, e in (data.get("errors") or {}).items()}
        return cls(**kwargs)

    def copy(self) -> ScatterState:
        return ScatterState(
            run=self.run,
            base=self.base,
            total=self.total,
            next=self.next,
            succeeded=self.succeeded,
            failed=self.failed,
            gathering=self.gathering,
            branches={i: _shallow_copy(b) for i, b in self.branches.items()},
            errors=dict(self.errors),
            batch=self.batch,
            deadline=self.deadline,
        )

    def dump_into(self, out: dict[str, Any]) -> None:
        """Its keys in the node's stored state: ``scatter``, and ``deadline`` beside it."""
        if self.deadline is not None:
            out["deadline"] = self.deadline.isoformat()
        out["scatter"] = self.to_json()

    def batch_items(self, branch: int) -> range:
        """The item indices branch ``branch`` runs (one item unless batched)."""
        first = branch * self.batch
        return range(first, min(first + self.batch, self.total))


@dataclass(slots=True)
class StepWork:
    """A step node's attempt bookkeeping (node kind ``step``). A scatter's branches keep the
    same in ``BranchState``: either is an attempt *slot* (``engine/slots.py``)."""

    #: Attempt number within the current retry budget (1-based once started).
    attempt: int = 0
    #: The one token whose result this node will accept.
    token: str | None = None
    #: When to look at the in-flight attempt again (resend if unclaimed, time out if claimed).
    check_at: datetime | None = None
    #: How many times the current attempt's message was re-sent while unclaimed.
    resends: int = 0
    #: When the unclaimed attempt's message is re-sent next.
    resend_at: datetime | None = None
    #: When the in-flight attempt was claimed, as learned at a check.
    claimed_at: datetime | None = None
    #: When the pending retry is due (status running, no token).
    retry_at: datetime | None = None
    #: Failed on its last attempt under ``on_exhausted="pause"``: the run is paused on it
    #: instead of failing, and a resume runs it again with a fresh budget (engine/exhausted.py).
    awaiting_resume: bool = False
    #: The in-flight attempt must be claimed by then (the step's ``schedule_to_start_timeout``
    #: after its dispatch), or it times out; cleared once a check finds it claimed.
    queued_until: datetime | None = None

    def dump_into(self, out: dict[str, Any]) -> None:
        out.update(_dump(self))

    def copy(self) -> StepWork:
        return _shallow_copy(self)


@dataclass(slots=True)
class ChildWork:
    """A sub-workflow node's child run (node kind ``subworkflow``)."""

    #: The child run it started (its output is read from there).
    child_run: str | None = None
    #: When the child run is looked at again while the node waits (``child_poll_after``).
    deadline: datetime | None = None

    def dump_into(self, out: dict[str, Any]) -> None:
        if self.child_run is not None:
            out["child_run"] = self.child_run
        if self.deadline is not None:
            out["deadline"] = self.deadline.isoformat()

    def copy(self) -> ChildWork:
        return ChildWork(self.child_run, self.deadline)


@dataclass(slots=True)
class ParkedWork:
    """A parked node's timer (node kinds ``sleep``, ``wait_signal``, ``approval``,
    ``event_set``; the events an event set received so far are its ``NodeState.output``)."""

    #: When its sleep ends or its wait times out (``None``: a wait without a timeout).
    deadline: datetime | None = None

    def dump_into(self, out: dict[str, Any]) -> None:
        if self.deadline is not None:
            out["deadline"] = self.deadline.isoformat()

    def copy(self) -> ParkedWork:
        return ParkedWork(self.deadline)


#: The kind-specific part of a node's state (``NodeState.work``). A checkpoint has none, and
#: nor has a node not started yet (or put back to pending): ``None``.
NodeWork = StepWork | ScatterState | ChildWork | ParkedWork

_W = TypeVar("_W", StepWork, ChildWork, ParkedWork)

#: The stored keys of each variant (besides those every node may have).
_VARIANT_KEYS: dict[type, frozenset[str]] = {
    StepWork: frozenset(_field_names(StepWork)),
    ScatterState: frozenset({"scatter", "deadline"}),
    ChildWork: frozenset({"child_run", "deadline"}),
    ParkedWork: frozenset({"deadline"}),
}


#: Each variant with every field unset, as ``_set_work`` compares (never handed out).
_UNSET_WORK: dict[type, NodeWork] = {cls: cls() for cls in (StepWork, ChildWork, ParkedWork)}


def _set_work(work: NodeWork | None) -> NodeWork | None:
    """``work``, or ``None`` for a variant with every field unset (it stores nothing)."""
    return None if work is None or work == _UNSET_WORK.get(type(work)) else work


def _date(value: Any) -> datetime | None:
    return None if value is None else datetime.fromisoformat(value)


def _work_from_json(rest: dict[str, Any]) -> NodeWork:
    """The variant of a stored node state, told by its keys beyond the common ones (``rest``,
    consumed): ``scatter``, else ``child_run``, else ``deadline`` alone, else attempt keys.
    A row with keys of no one variant is refused rather than read in part."""
    if "scatter" in rest:
        cls: type[NodeWork] = ScatterState
    elif "child_run" in rest:
        cls = ChildWork
    elif "deadline" in rest and len(rest) == 1:
        return ParkedWork(datetime.fromisoformat(rest["deadline"]))
    else:
        for name in _ATTEMPT_DATES:
            value = rest.get(name)
            if value is not None:
                rest[name] = datetime.fromisoformat(value)
        try:
            return StepWork(**rest)
        except TypeError:
            cls = StepWork  # a key StepWork has not: said below
    wrong = rest.keys() - _VARIANT_KEYS[cls]
    if wrong:
        raise ValueError(
            f"stored node state has keys {sorted(wrong)} besides those of {cls.__name__}"
        )
    deadline = _date(rest.get("deadline"))
    if cls is ChildWork:
        return ChildWork(rest["child_run"], deadline)
    scatter = ScatterState.from_json(rest["scatter"])
    scatter.deadline = deadline
    return scatter


@dataclass(slots=True, eq=False)
class NodeState:
    """One node's state: what every node kind has, and its kind's part in ``work``.

    The stored form (``to_json``) is one flat object, the same keys every ductor version
    wrote; ``from_json`` tells the variant by the keys present (``_work_from_json``).
    Use the accessors (``step``, ``parked``, ``child``, ``scatter``, ``deadline``) rather
    than ``work`` itself where the node's kind is known.
    """

    status: NodeStatus = NodeStatus.PENDING
    #: Attempts dispatched over the node's whole life (lost and timed-out ones included);
    #: each gets a new token, so a stale worker can never land on a newer attempt. Kept by
    #: every kind: a scatter's branch attempts count here too (above ``ScatterState.base``),
    #: a sub-workflow's and a child-run scatter's child run ids are made from it, and a node
    #: put back to pending (redrive, resume) keeps it, so its next attempt gets a new token.
    generation: int = 0
    #: Where the node's output lives (engine/outputs.py): the attempt row of a succeeded
    #: step, the signal row(s) of a wait, approval or event set (received so far, while it
    #: waits), or a small literal (a checkpoint's context, a continued timeout's
    #: ``{"timed_out": true}``). A scatter's and a sub-workflow's come from their ``work``.
    output: StoredOutput | None = None
    error: dict[str, Any] | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    #: The node kind's own part (``NodeWork``); ``None`` until the node starts. A variant
    #: whose fields are all unset stores nothing and reads back as ``None``: readers treat
    #: the two alike.
    work: NodeWork | None = None

    def __eq__(self, other: object) -> bool:
        """Equal when stored alike: a variant whose fields are all unset counts as none."""
        if not isinstance(other, NodeState):
            return NotImplemented
        return (
            self.status == other.status
            and self.generation == other.generation
            and self.output == other.output
            and self.error == other.error
            and self.started_at == other.started_at
            and self.finished_at == other.finished_at
            and _set_work(self.work) == _set_work(other.work)
        )

    __hash__ = None  # type: ignore[assignment]  # mutable, as a dataclass with eq

    def _variant(self, cls: type[_W]) -> _W:
        work = self.work
        if work is None:
            work = self.work = cls()
        if not isinstance(work, cls):
            raise TypeError(f"a node with {type(work).__name__} has no {cls.__name__}")
        return work

    @property
    def step(self) -> StepWork:
        """A step node's attempt bookkeeping, created if the node has none yet."""
        return self._variant(StepWork)

    @property
    def parked(self) -> ParkedWork:
        """A parked node's timer, created if the node has none yet."""
        return self._variant(ParkedWork)

    @property
    def child(self) -> ChildWork:
        """A sub-workflow node's child run, created if the node has none yet."""
        return self._variant(ChildWork)

    @property
    def scatter(self) -> ScatterState | None:
        """A scatter node's counters and branches (set by assigning ``work``), else None."""
        work = self.work
        return work if isinstance(work, ScatterState) else None

    @property
    def deadline(self) -> datetime | None:
        """The timer of a waiting node: a parked node's deadline, or when a sub-workflow's or
        child-run scatter's child runs are looked at again (read-only: set it on ``work``)."""
        work = self.work
        if work is None or isinstance(work, StepWork):
            return None
        return work.deadline

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.status.value}
        if self.generation:
            out["generation"] = self.generation
        work = self.work
        if work is not None:
            work.dump_into(out)
        if self.error is not None:
            out["error"] = self.error
        if self.started_at is not None:
            out["started_at"] = self.started_at.isoformat()
        if self.finished_at is not None:
            out["finished_at"] = self.finished_at.isoformat()
        if self.output is not None:
            out.update(output_to_json(self.output))
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NodeState:
        rest = dict(data)  # the common keys popped, the variant's are left
        pop = rest.pop
        ns = cls.__new__(cls)  # every field set below: __init__ skipped (every tick, every node)
        ns.status = NodeStatus(pop("status", "pending"))
        ns.generation = pop("generation", 0)
        ns.error = pop("error", None)
        started, finished = pop("started_at", None), pop("finished_at", None)
        ns.started_at = None if started is None else datetime.fromisoformat(started)
        ns.finished_at = None if finished is None else datetime.fromisoformat(finished)
        if _OUTPUT_KEYS.isdisjoint(rest):
            ns.output = None  # most nodes: nothing to decode
        else:
            ns.output = output_from_json(rest)
            for key in _OUTPUT_KEYS:
                pop(key, None)
        ns.work = _work_from_json(rest) if rest else None
        return ns

    def copy(self) -> NodeState:
        twin = _shallow_copy(self)
        if self.work is not None:
            twin.work = self.work.copy()
        return twin


#: The stored state's lists of nodes it names instead of holding (store/done_nodes.py): those
#: its attempt rows keep, and those never started. The store gives them back before a state
#: is decoded.
DONE_KEY = "done"
UNSTARTED_KEY = "unstarted"
#: Where such a state holds the nodes it does hold: its ``nodes`` is ``null``, which a version
#: before 0.3.18 cannot read (it fails, never takes named nodes for pending ones).
OPEN_KEY = "open"


@dataclass(slots=True)
class RunState:
    status: RunStatus = RunStatus.PENDING
    nodes: dict[str, NodeState] = field(default_factory=dict)
    context: dict[str, Any] = field(default_factory=dict)
    #: Number of transitions recorded so far; the next transition's seq.
    transitions: int = 0
    #: A continue-as-new waiting for in-flight attempts to drain: {"input": ..., "has_input": bool}.
    continue_pending: dict[str, Any] | None = None
    #: A delayed start (``start(delay=...)`` / ``start_at=``): the run stays pending until
    #: then (engine/delay.py); its timer row wakes it.
    start_at: datetime | None = None
    #: A redrive with ``input=``: the control row whose input replaced the run's (the run
    #: row's input column is never updated; engine/redrive.py).
    input_from: int | None = None
    #: A run deadline (``start(deadline=...)`` or the workflow's ``deadline``): past it the
    #: run ends ``timed_out`` (engine/deadline.py); its timer row wakes it then.
    deadline_at: datetime | None = None
    #: A cooperative cancel waiting for attempts in flight to stop (engine/cancel.py):
    #: ``{"reason": str, "grace_until": ISO time}``.
    cancel: dict[str, Any] | None = None
    #: The run's tags (engine/tags.py, docs/tags.md); ``eec_run_tag`` indexes the same pairs.
    tags: dict[str, str] = field(default_factory=dict)
    #: The saga of a run that failed (or was cancelled with ``compensate_on_cancel``) after
    #: step nodes with ``compensate=`` succeeded (engine/compensation.py): ``{"order": [node
    #: ids, the one to undo first first], "ending": run status it ends with, "reason": str,
    #: "error": the run's error, "active": bool}``. Kept once done (the view lists it, a
    #: redrive reads it); a redrive clears it.
    compensation: dict[str, Any] | None = None

    @classmethod
    def initial(
        cls,
        node_ids: list[str],
        start_at: datetime | None = None,
        deadline_at: datetime | None = None,
        tags: dict[str, str] | None = None,
    ) -> RunState:
        return cls(
            nodes={n: NodeState() for n in node_ids},
            start_at=start_at,
            deadline_at=deadline_at,
            tags=dict(tags or {}),
        )

    def copy(self) -> RunState:
        return RunState(
            status=self.status,
            nodes={k: v.copy() for k, v in self.nodes.items()},
            context=copy.deepcopy(self.context),
            transitions=self.transitions,
            continue_pending=copy.deepcopy(self.continue_pending),
            start_at=self.start_at,
            input_from=self.input_from,
            deadline_at=self.deadline_at,
            cancel=dict(self.cancel) if self.cancel else None,
            tags=dict(self.tags),
            compensation=copy.deepcopy(self.compensation),
        )

    def to_json(self) -> dict[str, Any]:
        rest = self.to_json_but_nodes()
        nodes = {k: v.to_json() for k, v in self.nodes.items()}
        return {"status": rest.pop("status"), "nodes": nodes, **rest}

    def to_json_but_nodes(self) -> dict[str, Any]:
        """The stored state without its ``nodes`` key (the store encodes each node's part on
        its own: store/state_text.py)."""
        return {
            "status": self.status.value,
            "context": self.context,
            "transitions": self.transitions,
            **({"continue_pending": self.continue_pending} if self.continue_pending else {}),
            **({"start_at": self.start_at.isoformat()} if self.start_at else {}),
            **({"input_from": self.input_from} if self.input_from is not None else {}),
            **({"deadline_at": self.deadline_at.isoformat()} if self.deadline_at else {}),
            **({"cancel": self.cancel} if self.cancel else {}),
            **({"tags": self.tags} if self.tags else {}),
            **({"compensation": self.compensation} if self.compensation else {}),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunState:
        for named in (DONE_KEY, UNSTARTED_KEY, OPEN_KEY):
            if named in data:
                # Nodes the stored state names instead of holding (store/done_nodes.py): a
                # state read without them given back would take succeeded steps for pending
                # ones, or lose nodes.
                raise ValueError(
                    f"a run state naming {named!r} nodes was read without them: {data[named]}"
                )
        return cls(
            status=RunStatus(data.get("status", "pending")),
            nodes={k: NodeState.from_json(v) for k, v in data.get("nodes", {}).items()},
            context=dict(data.get("context") or {}),
            transitions=int(data.get("transitions", 0)),
            continue_pending=data.get("continue_pending"),
            start_at=datetime.fromisoformat(data["start_at"]) if data.get("start_at") else None,
            input_from=int(data["input_from"]) if data.get("input_from") is not None else None,
            deadline_at=(
                datetime.fromisoformat(data["deadline_at"]) if data.get("deadline_at") else None
            ),
            cancel=data.get("cancel"),
            tags=dict(data.get("tags") or {}),
            compensation=data.get("compensation"),
        )
