"""NodeState as a tagged union: each node kind's part in ``work``, one flat stored object.

The stored keys are those every ductor version wrote; the variant is told by the keys present
(``scatter``, ``child_run``, ``deadline`` alone, attempt keys).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from ductor_celery.engine.state import (
    AttemptOutput,
    BranchState,
    ChildWork,
    EventsOutput,
    LiteralOutput,
    NodeState,
    ParkedWork,
    RunState,
    ScatterState,
    StepWork,
)
from ductor_celery.engine.status import NodeStatus


def at(second: int) -> datetime:
    return datetime(2026, 1, 1, 12, 0, second, tzinfo=UTC)


def iso(second: int) -> str:
    return at(second).isoformat()


def roundtrip(ns: NodeState) -> NodeState:
    return NodeState.from_json(json.loads(json.dumps(ns.to_json())))


STEP = NodeState(
    status=NodeStatus.RUNNING,
    generation=3,
    error={"type": "ValueError", "message": "boom"},
    started_at=at(1),
    work=StepWork(
        attempt=2,
        token="r:a:3",
        check_at=at(40),
        resends=1,
        resend_at=at(35),
        claimed_at=at(20),
        queued_until=at(30),
    ),
)
SCATTER = NodeState(
    status=NodeStatus.RUNNING,
    generation=5,
    started_at=at(2),
    work=ScatterState(
        run="r",
        base=1,
        total=10,
        next=4,
        succeeded=1,
        failed=1,
        branches={2: BranchState(token="r:each:4", generation=4, attempt=1, check_at=at(9))},
        errors={0: {"type": "PayloadTooLarge", "message": "too big"}},
        batch=2,
    ),
)
CHILD_SCATTER = NodeState(
    status=NodeStatus.WAITING,
    generation=1,
    started_at=at(3),
    work=ScatterState(
        run="r", base=1, total=3, next=1, branches={0: BranchState(token="c0")}, deadline=at(33)
    ),
)
CHILD = NodeState(
    status=NodeStatus.WAITING,
    generation=2,
    started_at=at(4),
    work=ChildWork(child_run="c1", deadline=at(34)),
)
PARKED = NodeState(
    status=NodeStatus.WAITING,
    started_at=at(5),
    output=EventsOutput({"paid": 7}),
    work=ParkedWork(deadline=at(50)),
)
CHECKPOINT = NodeState(
    status=NodeStatus.SUCCEEDED,
    started_at=at(6),
    finished_at=at(6),
    output=LiteralOutput({"k": 1}),
)


@pytest.mark.parametrize(
    ("ns", "keys"),
    [
        (
            STEP,
            {
                "status",
                "generation",
                "attempt",
                "token",
                "check_at",
                "resends",
                "resend_at",
                "claimed_at",
                "queued_until",
                "error",
                "started_at",
            },
        ),
        (SCATTER, {"status", "generation", "started_at", "scatter"}),
        (CHILD_SCATTER, {"status", "generation", "started_at", "scatter", "deadline"}),
        (CHILD, {"status", "generation", "started_at", "child_run", "deadline"}),
        (PARKED, {"status", "started_at", "output_signals", "deadline"}),
        (CHECKPOINT, {"status", "started_at", "finished_at", "output_value"}),
        (NodeState(), {"status"}),
    ],
    ids=["step", "scatter", "child_scatter", "child", "parked", "checkpoint", "pending"],
)
def test_each_kind_round_trips_through_its_flat_keys(ns: NodeState, keys: set[str]) -> None:
    stored = ns.to_json()
    assert set(stored) == keys
    back = roundtrip(ns)
    assert back == ns and type(back.work) is type(ns.work)
    assert back.to_json() == stored


def test_a_child_scatter_keeps_its_poll_beside_the_scatter_not_in_it() -> None:
    stored = CHILD_SCATTER.to_json()
    assert stored["deadline"] == iso(33) and "deadline" not in stored["scatter"]
    assert CHILD_SCATTER.deadline == at(33) and CHILD.deadline == at(34)
    assert PARKED.deadline == at(50) and STEP.deadline is None and SCATTER.deadline is None


#: Rows as the flat NodeState of earlier versions wrote them (every optional a field of its own).
OLD_ROWS: list[dict[str, Any]] = [
    {
        "status": "failed",
        "generation": 2,
        "attempt": 2,
        "error": {"type": "RuntimeError", "message": "bug"},
        "started_at": iso(1),
        "finished_at": iso(9),
        "awaiting_resume": True,
    },
    {
        "status": "running",
        "generation": 1,
        "attempt": 1,
        "retry_at": iso(30),
        "error": {"type": "E", "message": "m"},
        "started_at": iso(1),
    },
    {
        "status": "succeeded",
        "generation": 1,
        "attempt": 1,
        "started_at": iso(1),
        "finished_at": iso(2),
        "output_token": "r:a:1",
    },
    {
        "status": "succeeded",
        "generation": 1,
        "child_run": "c9",
        "started_at": iso(1),
        "finished_at": iso(2),
    },
    {"status": "waiting", "deadline": iso(40), "started_at": iso(1), "output_signals": {"a": 3}},
    {"status": "succeeded", "output_signal": 4, "started_at": iso(1), "finished_at": iso(2)},
    {"status": "failed", "generation": 1, "error": {"type": "X", "message": "refused"}},
    {
        "status": "succeeded",
        "generation": 12,
        "started_at": iso(1),
        "finished_at": iso(5),
        "scatter": {
            "run": "r",
            "base": 0,
            "total": 12,
            "next": 12,
            "succeeded": 12,
            "branches": {},
        },
    },
]


@pytest.mark.parametrize("row", OLD_ROWS)
def test_an_old_flat_row_reads_into_its_variant_and_writes_back_the_same(
    row: dict[str, Any],
) -> None:
    ns = NodeState.from_json(row)
    assert ns.to_json() == row
    expected = (
        ScatterState
        if "scatter" in row
        else ChildWork
        if "child_run" in row
        else ParkedWork
        if "deadline" in row
        else StepWork
        if "attempt" in row
        else type(None)
    )
    assert type(ns.work) is expected


def test_old_rows_read_the_same_fields_as_before() -> None:
    exhausted = NodeState.from_json(OLD_ROWS[0])
    assert exhausted.step.awaiting_resume and exhausted.step.attempt == 2
    assert NodeState.from_json(OLD_ROWS[1]).step.retry_at == at(30)
    assert NodeState.from_json(OLD_ROWS[2]).output == AttemptOutput("r:a:1")
    assert NodeState.from_json(OLD_ROWS[3]).child.child_run == "c9"
    assert NodeState.from_json(OLD_ROWS[4]).parked.deadline == at(40)


def test_a_row_mixing_the_keys_of_two_kinds_is_refused_not_read_in_part() -> None:
    with pytest.raises(ValueError, match="deadline"):
        NodeState.from_json({"status": "running", "attempt": 1, "deadline": iso(1)})
    with pytest.raises(ValueError, match="token"):
        NodeState.from_json({"status": "waiting", "child_run": "c", "token": "t"})
    with pytest.raises(ValueError, match="bogus"):
        NodeState.from_json({"status": "running", "bogus": 1})


def test_accessors_create_the_variant_of_a_node_not_started_and_refuse_another_kind() -> None:
    pending = NodeState()
    assert pending.scatter is None and pending.deadline is None and pending.work is None
    pending.step.attempt = 1
    assert isinstance(pending.work, StepWork) and pending.to_json()["attempt"] == 1
    with pytest.raises(TypeError):
        _ = PARKED.step
    with pytest.raises(TypeError):
        _ = STEP.child
    assert SCATTER.scatter is SCATTER.work and STEP.scatter is None


def test_an_unset_variant_stores_nothing_and_equals_none() -> None:
    ns = NodeState(status=NodeStatus.WAITING, work=ParkedWork())
    assert ns.to_json() == {"status": "waiting"}
    assert roundtrip(ns) == ns and roundtrip(ns).work is None
    assert NodeState(work=StepWork(attempt=1)) != NodeState()


@pytest.mark.parametrize("ns", [STEP, SCATTER, CHILD_SCATTER, CHILD, PARKED, CHECKPOINT])
def test_a_copy_shares_no_mutable_part(ns: NodeState) -> None:
    twin = ns.copy()
    assert twin == ns and (ns.work is None or twin.work is not ns.work)
    before = ns.to_json()
    work = twin.work
    if isinstance(work, StepWork):
        work.token = None
    elif isinstance(work, ScatterState):
        work.next += 1
        work.deadline = None
        for branch in work.branches.values():
            branch.token = None
        work.branches.clear()
        work.errors.clear()
    elif isinstance(work, ChildWork | ParkedWork):
        work.deadline = None
    twin.status = NodeStatus.CANCELLED
    assert ns.to_json() == before


def test_a_run_state_of_every_kind_round_trips() -> None:
    state = RunState(
        nodes={
            "step": STEP,
            "scatter": SCATTER,
            "kids": CHILD_SCATTER,
            "sub": CHILD,
            "wait": PARKED,
            "mark": CHECKPOINT,
            "later": NodeState(),
        }
    )
    stored = json.loads(json.dumps(state.to_json()))
    back = RunState.from_json(stored)
    assert back == state and back.to_json() == stored
    assert state.copy() == state
