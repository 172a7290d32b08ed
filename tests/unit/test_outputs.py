"""A node's output reference (``NodeState.output``) and the one resolver every reader uses.

Stored rows keep the keys every version wrote (``output_token``, ``output_signal``,
``output_signals``, ``output_value``): a row written before the reference existed loads into
it, and writes back the same JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from ductor_celery.engine import NodeState, NodeStatus, RunState
from ductor_celery.engine.outputs import (
    AttemptOutput,
    ChildOutput,
    EventsOutput,
    GatherOutput,
    LiteralOutput,
    OutputRef,
    SignalOutput,
    output_ref,
    received_events,
    resolve_outputs,
)
from ductor_celery.engine.state import ChildWork, ScatterState

#: Node states as rows written before ``NodeState.output`` held them.
OLD_ROWS: list[tuple[dict[str, Any], Any]] = [
    ({"status": "succeeded", "generation": 1, "attempt": 1, "output_token": "r:a:1"},
     AttemptOutput("r:a:1")),
    ({"status": "succeeded", "output_signal": 4}, SignalOutput(4)),
    ({"status": "failed", "output_signal": 5, "error": {"type": "Rejected"}}, SignalOutput(5)),
    ({"status": "waiting", "output_signals": {"id_ok": 1}}, EventsOutput({"id_ok": 1})),
    ({"status": "succeeded", "output_signals": {"a": 2, "b": 3}}, EventsOutput({"a": 2, "b": 3})),
    ({"status": "succeeded", "output_value": {"timed_out": True}},
     LiteralOutput({"timed_out": True})),
    ({"status": "succeeded", "output_value": {}}, LiteralOutput({})),
    ({"status": "succeeded"}, None),
    ({"status": "pending"}, None),
]  # fmt: skip


@pytest.mark.parametrize(("stored", "expected"), OLD_ROWS)
def test_a_stored_node_state_loads_into_one_reference_and_writes_back_the_same_json(
    stored: dict[str, Any], expected: Any
) -> None:
    ns = NodeState.from_json(stored)
    assert ns.output == expected
    assert ns.to_json() == stored


def test_a_whole_old_run_state_round_trips_unchanged() -> None:
    stored = {
        "status": "running",
        "nodes": {f"n{i}": row for i, (row, _) in enumerate(OLD_ROWS)},
        "context": {"k": 1},
        "transitions": 9,
    }
    assert RunState.from_json(stored).to_json() == stored


def test_of_several_stored_keys_the_one_readers_always_read_first_wins() -> None:
    both = {"status": "succeeded", "output_token": "r:a:1", "output_value": {"x": 1}}
    assert NodeState.from_json(both).output == AttemptOutput("r:a:1")
    signal_and_value = {"status": "succeeded", "output_signal": 2, "output_value": {"x": 1}}
    assert NodeState.from_json(signal_and_value).output == SignalOutput(2)


def _scatter() -> ScatterState:
    return ScatterState(run="r", base=0, total=2, next=2, succeeded=2)


def test_readers_see_an_event_set_scatter_or_child_only_once_it_succeeded() -> None:
    waiting_events = NodeState(status=NodeStatus.WAITING, output=EventsOutput({"a": 1}))
    assert output_ref(waiting_events) is None
    assert received_events(waiting_events) == {"a": 1}
    done = NodeState(status=NodeStatus.SUCCEEDED, output=EventsOutput({"a": 1}))
    assert output_ref(done) == EventsOutput({"a": 1})
    running = NodeState(status=NodeStatus.RUNNING, work=_scatter())
    assert output_ref(running) is None
    gathered = NodeState(status=NodeStatus.SUCCEEDED, work=_scatter())
    assert output_ref(gathered) == GatherOutput(_scatter())
    child = NodeState(status=NodeStatus.SUCCEEDED, work=ChildWork("c1"))
    assert output_ref(child) == ChildOutput("c1")
    assert output_ref(NodeState(status=NodeStatus.WAITING, work=ChildWork("c1"))) is None
    # A rejected approval keeps its decision as its output; a step's attempt always counts.
    rejected = NodeState(status=NodeStatus.FAILED, output=SignalOutput(3))
    assert output_ref(rejected) == SignalOutput(3)
    assert received_events(rejected) == {}


class _Rows:
    """An ``OutputSource`` over dicts, counting its reads."""

    def __init__(self) -> None:
        self.reads: list[str] = []

    def attempt_outputs(self, tokens: list[str]) -> Mapping[str, Any]:
        self.reads.append(f"attempts {sorted(tokens)}")
        return {"r:a:1": {"x": 1}, "r:b:1": 2}

    def signal_payloads(self, ids: list[int]) -> Mapping[int, Any]:
        self.reads.append(f"signals {sorted(ids)}")
        return {1: "go", 2: {"approved": True}, 3: "id"}

    def gathered(self, node: str, scatter: ScatterState) -> Any:
        self.reads.append(f"gather {node}")
        return [node, scatter.total]

    def child_output(self, node: str, child_run: str) -> Any:
        self.reads.append(f"child {node}")
        return {"child": child_run}


def test_one_resolver_reads_each_kind_of_row_once_for_every_reference() -> None:
    refs: dict[str, OutputRef | None] = {
        "a": AttemptOutput("r:a:1"),
        "b": AttemptOutput("r:b:1"),
        "lost": AttemptOutput("r:lost:1"),
        "wait": SignalOutput(1),
        "review": SignalOutput(2),
        "kyc": EventsOutput({"id_ok": 3, "address_ok": 9}),
        "timeout": LiteralOutput({"timed_out": True}),
        "each": GatherOutput(_scatter()),
        "sub": ChildOutput("c1"),
        "pending": None,
    }
    rows = _Rows()
    assert resolve_outputs(refs, rows) == {
        "a": {"x": 1},
        "b": 2,
        "lost": None,
        "wait": "go",
        "review": {"approved": True},
        "kyc": {"id_ok": "id", "address_ok": None},
        "timeout": {"timed_out": True},
        "each": ["each", 2],
        "sub": {"child": "c1"},
        "pending": None,
    }
    assert rows.reads == [
        "attempts ['r:a:1', 'r:b:1', 'r:lost:1']",
        "signals [1, 2, 3, 9]",
        "gather each",
        "child sub",
    ]


def test_nothing_is_read_when_no_reference_points_at_a_row() -> None:
    rows = _Rows()
    refs: dict[str, OutputRef | None] = {"t": LiteralOutput(1), "p": None}
    assert resolve_outputs(refs, rows) == {"t": 1, "p": None}
    assert rows.reads == []
