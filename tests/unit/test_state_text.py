"""The run state's stored text, with the texts of nodes unchanged since a thread's last commit
of the same run reused (store/state_text.py): always the JSON ``to_json`` makes."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import with_unstarted

from ductor_celery.engine.state import (
    AttemptOutput,
    ChildWork,
    EventsOutput,
    LiteralOutput,
    NodeState,
    ParkedWork,
    RunState,
    SignalOutput,
    StepWork,
)
from ductor_celery.engine.status import NodeStatus, RunStatus
from ductor_celery.store import state_text as state_text_module
from ductor_celery.store.schema import dumps_json
from ductor_celery.store.state_text import forget, state_text

T0 = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)


@pytest.fixture(autouse=True)
def nothing_kept() -> None:
    forget()


def as_stored(text: str) -> str:
    """A JSON text, normalized: equal only when every key, string and number is the same
    (a node named in the ``unstarted`` list given back, as PostgreSQL gives it back)."""
    return json.dumps(with_unstarted(json.loads(text)), sort_keys=True)


def expected(state: RunState) -> str:
    return as_stored(dumps_json(state.to_json()))


def chain(done: int, size: int = 10) -> RunState:
    """A chain's state with ``done`` steps succeeded and the next one running."""
    state = RunState.initial([f"step_{i}" for i in range(size)])
    state.status = RunStatus.RUNNING
    state.transitions = 2 * done + 1
    for i in range(done):
        node = state.nodes[f"step_{i}"]
        node.status, node.generation = NodeStatus.SUCCEEDED, 1
        node.output = AttemptOutput(f"r:step_{i}:1")
        node.started_at, node.finished_at = T0 + timedelta(seconds=i), T0 + timedelta(seconds=i)
        node.work = StepWork(attempt=1)
    if done < size:
        node = state.nodes[f"step_{done}"]
        node.status, node.generation, node.started_at = NodeStatus.RUNNING, 1, T0
        node.work = StepWork(attempt=1, token=f"r:step_{done}:1", check_at=T0, claimed_at=T0)
    return state


def count_encodings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    encoded: list[str] = []
    real = state_text_module._node_text

    def counting(name: str, node: NodeState) -> str:
        encoded.append(name)
        return real(name, node)

    monkeypatch.setattr(state_text_module, "_node_text", counting)
    return encoded


def test_a_tick_encodes_only_the_nodes_it_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next tick works on a copy of the last one's state (``compute_tick``): the nodes it
    did not touch hold the very same values, and their texts are reused."""
    encoded = count_encodings(monkeypatch)
    before = chain(3)
    assert as_stored(state_text("r", before)) == expected(before)
    assert len(encoded) == 4  # the started ones: the six never started are names

    after = before.copy()
    finished = after.nodes["step_3"]
    finished.status, finished.output, finished.finished_at = (
        NodeStatus.SUCCEEDED,
        AttemptOutput("r:step_3:1"),
        T0 + timedelta(seconds=9),
    )
    finished.step.token = finished.step.check_at = finished.step.claimed_at = None
    started = after.nodes["step_4"]
    started.status, started.generation, started.started_at = NodeStatus.RUNNING, 1, T0
    started.step.attempt, started.step.token = 1, "r:step_4:1"
    after.transitions += 2
    encoded.clear()
    assert as_stored(state_text("r", after)) == expected(after)
    assert encoded == ["step_3", "step_4"]


def test_equal_values_that_are_other_objects_are_encoded_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same instant at another offset is equal, but its text is not: a node whose value
    was replaced by an equal one gets its own text."""
    encoded = count_encodings(monkeypatch)
    before = chain(2)
    state_text("r", before)
    after = before.copy()
    plus_one = timezone(timedelta(hours=1))
    after.nodes["step_0"].started_at = after.nodes["step_0"].started_at.astimezone(plus_one)
    after.nodes["step_1"].step.attempt = True  # == 1, stored as true
    encoded.clear()
    text = state_text("r", after)
    assert as_stored(text) == expected(after)
    assert with_unstarted(json.loads(text))["nodes"]["step_0"]["started_at"].endswith("+01:00")
    assert with_unstarted(json.loads(text))["nodes"]["step_1"]["attempt"] is True
    assert encoded == ["step_0", "step_1"]


def test_nodes_holding_values_that_can_change_in_place_are_always_encoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An error, a literal output, an event set's: dicts, changed in place by nobody today,
    but never trusted to be the same object with the same contents."""
    encoded = count_encodings(monkeypatch)
    state = chain(1, size=4)
    state.nodes["step_1"].error = {"type": "ValueError", "message": "boom"}
    state.nodes["step_2"].output = LiteralOutput({"k": 1})
    state.nodes["step_3"].output = EventsOutput({"paid": 7})
    state_text("r", state)
    state.nodes["step_1"].error["message"] = "changed in place"
    state.nodes["step_2"].output.value["k"] = 2
    encoded.clear()
    assert as_stored(state_text("r", state)) == expected(state)
    assert encoded == ["step_1", "step_2", "step_3"]


def test_another_runs_texts_are_not_looked_at(monkeypatch: pytest.MonkeyPatch) -> None:
    encoded = count_encodings(monkeypatch)
    state = chain(2, size=3)
    state_text("r", state)
    encoded.clear()
    state_text("other", state)
    assert encoded == ["step_0", "step_1", "step_2"]


def test_the_runs_own_keys_are_stored_beside_its_nodes() -> None:
    state = chain(1, size=2)
    state.context = {"k": [1, 2.5, "x"]}
    state.tags = {"tenant": "acme"}
    state.deadline_at = T0 + timedelta(hours=1)
    state.cancel = {"reason": "r", "grace_until": T0.isoformat()}
    assert as_stored(state_text("r", state)) == expected(state)
    state.nodes.clear()
    assert as_stored(state_text("r", state)) == expected(state)


_DATES = st.sampled_from(
    [None, T0, T0 + timedelta(seconds=1), T0.astimezone(timezone(timedelta(hours=-5)))]
)


def _work(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["none", "step", "parked", "child"]))
    if kind == "step":
        return StepWork(
            attempt=draw(st.integers(0, 3)),
            token=draw(st.sampled_from([None, "t1", "t2"])),
            check_at=draw(_DATES),
            resends=draw(st.integers(0, 2)),
            claimed_at=draw(_DATES),
            awaiting_resume=draw(st.booleans()),
        )
    if kind == "parked":
        return ParkedWork(draw(_DATES))
    if kind == "child":
        return ChildWork(draw(st.sampled_from([None, "c1"])), draw(_DATES))
    return None


#: A field of each kind of work, with values it may be set to in place.
_WORK_FIELDS: dict[type, dict[str, Any]] = {
    StepWork: {
        "attempt": st.integers(0, 300),
        "token": st.sampled_from([None, "t1", "t2"]),
        "check_at": _DATES,
        "resends": st.integers(0, 2),
        "resend_at": _DATES,
        "claimed_at": _DATES,
        "retry_at": _DATES,
        "awaiting_resume": st.booleans(),
        "queued_until": _DATES,
    },
    ParkedWork: {"deadline": _DATES},
    ChildWork: {"child_run": st.sampled_from([None, "c1", "c2"]), "deadline": _DATES},
}


def test_every_field_of_every_kept_work_is_drawn() -> None:
    """The drawn changes reach every field a kept node's text is made of."""
    for cls, drawn in _WORK_FIELDS.items():
        assert set(drawn) == {f.name for f in dataclasses.fields(cls)}


@st.composite
def changes(draw: st.DrawFn) -> list[tuple[str, str, Any]]:
    """Ticks of one run: each a list of (node, field, new value), applied to a copy; a field
    ``work.<name>`` is one of the node's work, changed in place (if its work has it)."""
    node_fields = ["status", "generation", "output", "started_at", "finished_at", "work"]
    work_fields = sorted({f"work.{name}" for drawn in _WORK_FIELDS.values() for name in drawn})
    ticks = []
    for _ in range(draw(st.integers(1, 6))):
        tick = []
        for _ in range(draw(st.integers(0, 4))):
            field = draw(st.sampled_from([*node_fields, "error", *work_fields]))
            value: Any
            if field == "status":
                value = draw(st.sampled_from(list(NodeStatus)))
            elif field == "generation":
                value = draw(st.integers(0, 300))
            elif field == "output":
                value = draw(
                    st.sampled_from(
                        [None, AttemptOutput("t1"), SignalOutput(3), LiteralOutput({"a": 1})]
                    )
                )
            elif field in ("started_at", "finished_at"):
                value = draw(_DATES)
            elif field == "error":
                value = draw(st.sampled_from([None, {"type": "E", "message": "m"}]))
            elif field == "work":
                value = _work(draw)
            else:
                name = field.removeprefix("work.")
                strategy = next(f[name] for f in _WORK_FIELDS.values() if name in f)
                value = draw(strategy)
            tick.append((draw(st.sampled_from(["a", "b", "c"])), field, value))
        ticks.append(tick)
    return ticks


@settings(max_examples=500, deadline=None)
@given(changes())
def test_any_sequence_of_ticks_stores_what_to_json_makes(
    ticks: list[list[tuple[str, str, Any]]],
) -> None:
    forget()
    state = RunState.initial(["a", "b", "c"])
    assert as_stored(state_text("r", state)) == expected(state)
    for tick in ticks:
        state = state.copy()
        for node, field, value in tick:
            target: Any = state.nodes[node]
            if field.startswith("work."):  # a field of the node's work, changed in place
                field = field.removeprefix("work.")
                if not hasattr(target.work, field):
                    continue
                target = target.work
            setattr(target, field, value)
        assert as_stored(state_text("r", state)) == expected(state)
