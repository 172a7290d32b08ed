"""Phase 3: absorb external input: signals, approvals, event sets and timers of parked nodes."""

from __future__ import annotations

from ..definition.spec import (
    APPROVAL_SIGNAL_PREFIX,
    ApprovalNodeSpec,
    EventSetNodeSpec,
    SleepNodeSpec,
    WaitSignalNodeSpec,
    approval_signal,
)
from ..limits import later
from .context import TickContext
from .inputs import AppliedSignal, SignalIn
from .outputs import received_events
from .state import EventsOutput, LiteralOutput, ParkedWork, SignalOutput
from .status import NodeStatus


def park_node(t: TickContext, node_id: str) -> None:
    """A parked node starts waiting: for a timer, a signal, a decision or a set of events."""
    spec = t.spec.graph.nodes[node_id]
    ns = t.nodes[node_id]
    ns.started_at = t.now
    if isinstance(spec, SleepNodeSpec):
        ns.work = ParkedWork(later(t.now, spec.seconds))
        what = f"sleeping {spec.seconds:g}s"
    else:
        assert isinstance(spec, WaitSignalNodeSpec | ApprovalNodeSpec | EventSetNodeSpec)
        ns.work = ParkedWork(later(t.now, spec.timeout) if spec.timeout else None)
        if isinstance(spec, WaitSignalNodeSpec):
            what = f"waiting for signal {spec.signal!r}"
        elif isinstance(spec, ApprovalNodeSpec):
            what = "waiting for approval"
        else:
            what = f"waiting for events {list(spec.events)} ({spec.mode})"
    t.move_node(node_id, NodeStatus.WAITING, what)


def absorb_external(t: TickContext) -> bool:
    """Feed signals and due timers to waiting nodes. Returns True if any node finished."""
    finished = False
    for node_id in t.spec.graph.parked:
        ns = t.nodes[node_id]
        if ns.status != NodeStatus.WAITING:
            continue
        spec = t.spec.graph.nodes[node_id]
        if isinstance(spec, SleepNodeSpec):
            done = _sleep(t, node_id)
        elif isinstance(spec, WaitSignalNodeSpec):
            done = _wait_signal(t, node_id, spec)
        elif isinstance(spec, ApprovalNodeSpec):
            done = _approval(t, node_id, spec)
        elif isinstance(spec, EventSetNodeSpec):
            done = _event_set(t, node_id, spec)
        else:
            continue  # never: ``graph.parked`` holds these four kinds only
        if not done and ns.status == NodeStatus.WAITING:
            done = _timeout(t, node_id)
        finished = finished or done
    _drop_stray_approvals(t)
    return finished


def _unapplied(t: TickContext) -> list[SignalIn]:
    taken = {a.id for a in t.payload.applied_signals}
    return [s for s in t.inputs.signals if s.id not in taken]


def _take(t: TickContext, signal: SignalIn, node: str | None) -> None:
    t.payload.applied_signals.append(AppliedSignal(signal.id, node))
    t.payload.changed = True


def _succeed(t: TickContext, node_id: str, reason: str) -> None:
    ns = t.nodes[node_id]
    ns.parked.deadline = None
    ns.finished_at = t.now
    t.move_node(node_id, NodeStatus.SUCCEEDED, reason)


def _sleep(t: TickContext, node_id: str) -> bool:
    ns = t.nodes[node_id]
    if ns.deadline is not None and ns.deadline <= t.now:
        _succeed(t, node_id, "timer fired")
        return True
    return False


def _wait_signal(t: TickContext, node_id: str, spec: WaitSignalNodeSpec) -> bool:
    for signal in _unapplied(t):
        if signal.name == spec.signal:
            _take(t, signal, node_id)
            t.nodes[node_id].output = SignalOutput(signal.id)
            t.outputs[node_id] = signal.payload
            _succeed(t, node_id, f"signal {spec.signal!r} received (#{signal.id})")
            return True
    return False


def _approval(t: TickContext, node_id: str, spec: ApprovalNodeSpec) -> bool:
    name = approval_signal(node_id)
    for signal in _unapplied(t):
        if signal.name != name:
            continue
        _take(t, signal, node_id)
        ns = t.nodes[node_id]
        decision = signal.payload if isinstance(signal.payload, dict) else {}
        who = decision.get("by")
        ns.output = SignalOutput(signal.id)
        t.outputs[node_id] = signal.payload
        if decision.get("approved"):
            _succeed(t, node_id, f"approved by {who!r}")
        elif spec.on_reject == "continue":
            _succeed(t, node_id, f"rejected by {who!r} (on_reject=continue)")
        else:
            ns.parked.deadline = None
            ns.finished_at = t.now
            ns.error = {
                "type": "Rejected",
                "message": f"rejected by {who!r}: {decision.get('comment') or ''}".strip(),
            }
            t.move_node(node_id, NodeStatus.FAILED, f"rejected by {who!r}")
        return True
    return False


def _event_set(t: TickContext, node_id: str, spec: EventSetNodeSpec) -> bool:
    ns = t.nodes[node_id]
    received = dict(received_events(ns))
    for signal in _unapplied(t):
        if signal.name in spec.events and signal.name not in received:
            _take(t, signal, node_id)
            received[signal.name] = signal.id
            t.record(node_id, ns.status, ns.status, f"event {signal.name!r} received")
            if len(received) >= spec.needed():
                break
    ns.output = EventsOutput(received) if received else None
    if len(received) >= spec.needed():
        fresh = {s.id: s.payload for s in t.inputs.signals}
        t.outputs[node_id] = {
            event: fresh[i] if i in fresh else t.inputs.received.get(i)
            for event, i in received.items()
        }
        _succeed(t, node_id, f"events received: {sorted(received)}")
        return True
    return False


def _timeout(t: TickContext, node_id: str) -> bool:
    ns = t.nodes[node_id]
    spec = t.spec.graph.nodes[node_id]
    if ns.deadline is None or ns.deadline > t.now or isinstance(spec, SleepNodeSpec):
        return False
    assert isinstance(spec, WaitSignalNodeSpec | ApprovalNodeSpec | EventSetNodeSpec)
    if spec.on_timeout == "continue":
        ns.output = LiteralOutput({"timed_out": True})
        t.outputs[node_id] = ns.output.value
        _succeed(t, node_id, f"timed out after {spec.timeout:g}s (on_timeout=continue)")
        return True
    ns.parked.deadline = None
    ns.finished_at = t.now
    ns.error = {"type": "Timeout", "message": f"no input within {spec.timeout:g}s"}
    t.move_node(node_id, NodeStatus.FAILED, f"timed out after {spec.timeout:g}s")
    return True


def _drop_stray_approvals(t: TickContext) -> None:
    """A decision for a node that stopped waiting (it timed out first) is applied to nothing."""
    for signal in _unapplied(t):
        if not signal.name.startswith(APPROVAL_SIGNAL_PREFIX):
            continue
        node_id = signal.name[len(APPROVAL_SIGNAL_PREFIX) :]
        ns = t.nodes.get(node_id)
        if ns is None or ns.status != NodeStatus.WAITING:
            _take(t, signal, None)
            status = ns.status.value if ns is not None else "unknown"
            t.record(node_id, status, status, "approval ignored: node was not waiting")
