"""Where a node's output lives: one reference type (``OutputRef``) and one resolver.

A node's output is never in the run state itself (the run row stays small); the state holds
a reference to it, one of six kinds:

| reference | node | the output is |
|---|---|---|
| ``AttemptOutput(token)`` | step | the ``output`` column of that attempt row |
| ``SignalOutput(signal)`` | wait_signal, approval | the payload of that signal row |
| ``EventsOutput(events)`` | event_set | ``{event: payload}`` of those signal rows |
| ``LiteralOutput(value)`` | checkpoint, a timed-out wait | ``value``, small, kept inline |
| ``GatherOutput(scatter)`` | scatter | the branch outputs in item order |
| ``ChildOutput(child_run)`` | sub-workflow | the child's output (or context at ``until``) |

The first four are stored in ``NodeState.output`` (defined in ``state.py``); the last two
are derived from the node's own ``work`` (its ``ScatterState``, its ``ChildWork``'s
``child_run``) once it has succeeded (``output_ref``). Readers (the
tick's loader, the client's views, the in-memory store) resolve references with
``resolve_outputs`` over an ``OutputSource``: the one place that knows the six kinds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .state import (
    AttemptOutput,
    ChildWork,
    EventsOutput,
    LiteralOutput,
    NodeState,
    ScatterState,
    SignalOutput,
    StoredOutput,
    output_from_json,
)
from .status import NodeStatus

__all__ = [
    "AttemptOutput",
    "ChildOutput",
    "EventsOutput",
    "GatherOutput",
    "LiteralOutput",
    "OutputRef",
    "OutputSource",
    "SignalOutput",
    "StoredOutput",
    "output_ref",
    "checkpoint_of",
    "received_events",
    "resolve_outputs",
]


@dataclass(frozen=True, slots=True)
class GatherOutput:
    scatter: ScatterState


@dataclass(frozen=True, slots=True)
class ChildOutput:
    child_run: str


OutputRef = StoredOutput | GatherOutput | ChildOutput


def output_ref(ns: NodeState) -> OutputRef | None:
    """The reference to ``ns``'s output as readers see it (None: no output, read as None).

    A step's attempt and a wait's signal count whatever the status (a rejected approval
    shows its decision); an event set's events and a scatter's or sub-workflow's rows only
    once the node has succeeded (before, they are work in progress)."""
    out = ns.output
    if isinstance(out, EventsOutput):
        return out if ns.status == NodeStatus.SUCCEEDED else None
    if out is not None:
        return out
    if ns.status == NodeStatus.SUCCEEDED:
        work = ns.work
        if isinstance(work, ScatterState):
            return GatherOutput(work)
        if isinstance(work, ChildWork) and work.child_run is not None:
            return ChildOutput(work.child_run)
    return None


def received_events(ns: NodeState) -> Mapping[str, int]:
    """An event set's events received so far: event name -> signal row."""
    return ns.output.events if isinstance(ns.output, EventsOutput) else {}


def checkpoint_of(state: Mapping[str, Any] | None, node: str) -> tuple[bool, Any]:
    """In a run's stored state (a child's, read as JSON): whether checkpoint ``node`` has
    been passed, and its output (the run's context there)."""
    mark = ((state or {}).get("nodes") or {}).get(node) or {}
    out = output_from_json(mark)
    value = out.value if isinstance(out, LiteralOutput) else None
    return mark.get("status") == NodeStatus.SUCCEEDED.value, value


class OutputSource(Protocol):
    """The rows references point at, read in batches (a store, a view, a fake)."""

    def attempt_outputs(self, tokens: list[str]) -> Mapping[str, Any]: ...

    def signal_payloads(self, ids: list[int]) -> Mapping[int, Any]: ...

    def gathered(self, node: str, scatter: ScatterState) -> Any: ...

    def child_output(self, node: str, child_run: str) -> Any: ...


def resolve_outputs(refs: Mapping[str, OutputRef | None], source: OutputSource) -> dict[str, Any]:
    """Each node's output from its reference: one read of attempt rows and one of signal
    rows for them all, then a read per gathered scatter and per sub-workflow."""
    tokens: list[str] = []
    signals: list[int] = []
    for ref in refs.values():
        if isinstance(ref, AttemptOutput):
            tokens.append(ref.token)
        elif isinstance(ref, SignalOutput):
            signals.append(ref.signal)
        elif isinstance(ref, EventsOutput):
            signals.extend(ref.events.values())
    outputs = source.attempt_outputs(tokens) if tokens else {}
    payloads = source.signal_payloads(signals) if signals else {}
    resolved: dict[str, Any] = {}
    for node, ref in refs.items():
        if ref is None:
            resolved[node] = None
        elif isinstance(ref, AttemptOutput):
            resolved[node] = outputs.get(ref.token)
        elif isinstance(ref, SignalOutput):
            resolved[node] = payloads.get(ref.signal)
        elif isinstance(ref, EventsOutput):
            resolved[node] = {event: payloads.get(i) for event, i in ref.events.items()}
        elif isinstance(ref, LiteralOutput):
            resolved[node] = ref.value
        elif isinstance(ref, GatherOutput):
            resolved[node] = source.gathered(node, ref.scatter)
        else:
            resolved[node] = source.child_output(node, ref.child_run)
    return resolved
