"""``next_read.nodes_as_read``: a node taken as it is must be what a read decodes, variant
for variant (docs/next-read-from-commit.md, "The nodes kept"). A read is the node's JSON as
``jsonb`` returns it (``_as_jsonb``), decoded; the integration test checks that against
PostgreSQL itself."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from ductor_celery.engine.state import (
    AttemptOutput,
    ChildWork,
    EventsOutput,
    LiteralOutput,
    NodeState,
    ParkedWork,
    ScatterState,
    SignalOutput,
    StepWork,
)
from ductor_celery.engine.status import NodeStatus
from ductor_celery.store.next_read import _as_jsonb, nodes_as_read
from ductor_celery.store.schema import dumps_json

AT = datetime(2026, 12, 5, 6, 0, tzinfo=UTC)


def _read(node: NodeState) -> NodeState:
    return NodeState.from_json(_as_jsonb(json.loads(dumps_json(node.to_json()))))


CASES = {
    "pending": NodeState(),
    "a step started": NodeState(
        NodeStatus.RUNNING, work=StepWork(attempt=1, token="t", check_at=AT)
    ),
    "a step with every field unset": NodeState(NodeStatus.PENDING, work=StepWork()),
    "a step succeeded": NodeState(
        NodeStatus.SUCCEEDED, 1, AttemptOutput("r:n:1"), None, AT, AT, StepWork(attempt=1)
    ),
    "a step failed": NodeState(
        NodeStatus.FAILED, error={"type": "E", "message": "m", "traceback": "t", "a": -0.0}
    ),
    "a timer": NodeState(NodeStatus.RUNNING, work=ParkedWork(AT)),
    "a timer unset": NodeState(NodeStatus.RUNNING, work=ParkedWork()),
    "a child run": NodeState(NodeStatus.RUNNING, work=ChildWork("child", AT)),
    "a child run not started, polled": NodeState(NodeStatus.RUNNING, work=ChildWork(None, AT)),
    "a child run not started": NodeState(NodeStatus.RUNNING, work=ChildWork()),
    "a signal's output": NodeState(NodeStatus.SUCCEEDED, output=SignalOutput(3)),
    "an event set's": NodeState(NodeStatus.SUCCEEDED, output=EventsOutput({"zz": 1, "b": 2})),
    "a checkpoint's": NodeState(
        NodeStatus.SUCCEEDED, output=LiteralOutput({"zz": {"b": 1, "a": -0.0}, "é": 1, "bb": 2})
    ),
    "a scatter": NodeState(
        NodeStatus.RUNNING,
        work=ScatterState("r", 0, 30, errors={12: {"m": 1}, 3: {"m": 2}}),
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_a_kept_node_is_what_a_read_decodes(name: str) -> None:
    node = CASES[name]
    kept = nodes_as_read({"n": node})["n"]
    read = _read(node)
    assert kept == read
    assert type(kept.work) is type(read.work)
    assert dumps_json(kept.to_json()) == dumps_json(read.to_json())
    # What needs no decoding is not decoded: the node itself, not a copy.
    plain = not name.startswith(("a step failed", "an event", "a checkpoint", "a scatter"))
    plain = plain and name not in (
        "a step with every field unset",
        "a timer unset",
        "a child run not started, polled",
        "a child run not started",
    )
    assert (kept is node) == plain


def test_nodes_come_in_jsonb_order() -> None:
    nodes = {name: NodeState() for name in ("é", "zz", "bb", "s10", "s9", "a")}
    # By length in bytes ("é" is two), then bytewise, as PostgreSQL orders an object's keys.
    assert list(nodes_as_read(nodes)) == ["a", "bb", "s9", "zz", "é", "s10"]
