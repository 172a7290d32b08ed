"""The vocabularies that were strings (issue 28, item 2): attempt outcomes and their groups,
tick outcomes, a child's "missing" status, the rows both loaders map the same way, and the
outbox intents, whose JSON is held here literally as every earlier version wrote it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from ductor_celery.coordinator import (
    COMPUTED_TICKS,
    SETTLED_TICKS,
    OutboxRow,
    TickOutcome,
    TickResult,
)
from ductor_celery.coordinator.read_rows import RESULT_COLUMNS, attempt_result, child_snapshot
from ductor_celery.coordinator.rows import (
    carrier_revokes,
    outbox_intents,
    outbox_row,
    step_intent,
    wakeup_intent,
)
from ductor_celery.engine import AttemptOutcome, RunState, TickPayload
from ductor_celery.engine.inputs import ChildSnapshot, Dispatch
from ductor_celery.engine.kinds import DispatchKind
from ductor_celery.engine.scatter import attempt_final, batch_attempt
from ductor_celery.engine.status import (
    CHILD_MISSING,
    CLOSED_BY_COORDINATOR,
    FAILED_CHILD_STATUSES,
    OPEN_RUN_STATUSES,
    RAN_TO_END,
    TERMINAL_RUN_STATUSES,
    WRITTEN_BY_WORKER,
    RunStatus,
)
from ductor_celery.store.export_format import _outcome_problem

# -- attempt outcomes --------------------------------------------------------------------------


def test_attempt_outcomes_keep_the_strings_the_column_holds() -> None:
    assert [o.value for o in AttemptOutcome] == ["succeeded", "failed", "cancelled", "timed_out"]
    assert AttemptOutcome.TIMED_OUT == "timed_out" and f"{AttemptOutcome.FAILED}" == "failed"


def test_attempt_outcome_groups() -> None:
    assert WRITTEN_BY_WORKER == {"succeeded", "failed", "cancelled"}
    assert CLOSED_BY_COORDINATOR == {"cancelled", "timed_out"}
    assert WRITTEN_BY_WORKER | CLOSED_BY_COORDINATOR == set(AttemptOutcome)
    # What a gather counts the output of: never a closed attempt's (a checkpoint may be there).
    assert RAN_TO_END == {"succeeded", "failed"} and RAN_TO_END <= WRITTEN_BY_WORKER


def test_an_export_accepts_exactly_the_attempt_outcomes_and_none() -> None:
    for outcome in [None, *AttemptOutcome, "succeeded"]:
        assert _outcome_problem(outcome) is None
    for wrong in ["missing", "committed", "SUCCEEDED", 1]:
        assert _outcome_problem(wrong) is not None


# -- the rows both loaders map -----------------------------------------------------------------


def test_an_attempt_row_becomes_its_result_with_an_outcome_member() -> None:
    row = ("tok", "a", "succeeded", {"x": 1}, None, None, {"k": 2}, 3, [["t", "v"]])
    assert len(row) == len(RESULT_COLUMNS)
    result = attempt_result(*row)
    assert result.outcome is AttemptOutcome.SUCCEEDED
    assert (result.output, result.retryable, result.patch, result.branch) == (
        {"x": 1},
        True,
        {"k": 2},
        3,
    )
    assert result.tags == [["t", "v"]]
    assert (
        attempt_result("t", "a", "cancelled", None, None, False, None, None, None).retryable
        is False
    )


@pytest.mark.parametrize("stored", [None, "exploded"])
def test_an_attempt_row_without_a_known_outcome_is_read_as_failed(stored: str | None) -> None:
    result = attempt_result("t", "a", stored, None, None, 1, None, None, None)
    assert result.outcome is AttemptOutcome.FAILED and result.retryable is True


def _child(status: str, output: object = None, state: object = None) -> SimpleNamespace:
    return SimpleNamespace(run_id="c2", status=status, output=output, error={"m": 1}, state=state)


def test_a_child_row_becomes_its_snapshot() -> None:
    assert child_snapshot("c1", None, None) == ChildSnapshot(run_id="c1", status=CHILD_MISSING)
    assert child_snapshot("c1", _child("succeeded", 7), None) == ChildSnapshot(
        run_id="c2", status="succeeded", output=7, error={"m": 1}
    )
    # Only a succeeded child's output is read (a failed one's column is not its output).
    assert child_snapshot("c1", _child("failed", 7), None).output is None
    passed = {"nodes": {"cp": {"status": "succeeded", "output_value": 5}}}
    assert child_snapshot("c1", _child("running", state=passed), "cp").checkpoints == {"cp": 5}
    assert child_snapshot("c1", _child("running", state={}), "cp").checkpoints == {}


def test_failed_children_are_the_terminal_statuses_but_succeeded_and_continued_or_missing() -> None:
    # The set engine/children.py spelled out before it was made from the groups.
    assert FAILED_CHILD_STATUSES == {"failed", "cancelled", "terminated", "timed_out", "missing"}
    assert FAILED_CHILD_STATUSES == (
        TERMINAL_RUN_STATUSES - {RunStatus.SUCCEEDED, RunStatus.CONTINUED}
    ) | {CHILD_MISSING}
    # "missing" is never stored: no run status spells it, open or terminal.
    assert CHILD_MISSING not in set(RunStatus) and CHILD_MISSING not in OPEN_RUN_STATUSES


def test_a_gather_counts_only_what_a_step_that_ran_to_its_end_wrote() -> None:
    assert attempt_final("succeeded", 1, {"e": 1}) == (True, 1)
    assert attempt_final("failed", 1, {"e": 1}) == (False, {"e": 1})
    assert batch_attempt("failed", {"done": {}}, {"e": 1}) == (False, {"done": {}}, {"e": 1})
    assert batch_attempt("timed_out", {"done": {"0": 1}}, {"e": 1}) == (False, None, {"e": 1})
    assert batch_attempt("cancelled", {"done": {"0": 1}}, None) == (False, None, None)


# -- tick outcomes -----------------------------------------------------------------------------


def test_tick_outcome_groups() -> None:
    assert SETTLED_TICKS == {"committed", "noop", "missing"}
    assert COMPUTED_TICKS == {"committed", "noop"} and COMPUTED_TICKS <= SETTLED_TICKS
    assert TickOutcome.BUSY not in SETTLED_TICKS and TickOutcome.CONFLICT not in SETTLED_TICKS


def test_a_tick_result_equals_only_a_tick_result() -> None:
    result = TickResult(TickOutcome.COMMITTED)
    assert result != "committed" and result.outcome == "committed"
    assert result == TickResult(TickOutcome.COMMITTED) and result != TickResult(TickOutcome.NOOP)
    assert str(result) == "committed"


# -- outbox intents: the JSON every version wrote ----------------------------------------------


def _json(value: object) -> str:
    return json.dumps(value, sort_keys=False)


def test_step_and_wakeup_intents_keep_their_json() -> None:
    assert _json(step_intent("r1", "r1:a:1", "a", "shop.pay", None)) == (
        '{"run_id": "r1", "kind": "step", "task": "shop.pay", "queue": null, '
        '"payload": {"token": "r1:a:1", "run_id": "r1", "node": "a"}}'
    )
    assert _json(step_intent("r1", "r1:a:1", "a", "shop.pay", "fast", 7)) == (
        '{"run_id": "r1", "kind": "step", "task": "shop.pay", "queue": "fast", '
        '"payload": {"token": "r1:a:1", "run_id": "r1", "node": "a", "priority": 7}}'
    )
    assert _json(wakeup_intent("r2")) == (
        '{"run_id": "r2", "kind": "wakeup", "task": "ductor.tick", "queue": null, '
        '"payload": {"run_id": "r2"}}'
    )


def test_revoke_intents_keep_their_json() -> None:
    payload = TickPayload(state=RunState())
    payload.dispatches = [
        Dispatch(DispatchKind.REVOKE, "r1", "a", "r1:a:1", "shop.pay", None),
        Dispatch(DispatchKind.REVOKE, "r1", "b", "r1:b:1", "shop.ship", "q", terminate=True),
        Dispatch(DispatchKind.WAKEUP, "p1", "", "", "", None),
    ]
    assert [_json(i) for i in outbox_intents(payload, set(), priority=2)] == [
        '{"run_id": "r1", "kind": "revoke", "task": "shop.pay", "queue": null, '
        '"payload": {"token": "r1:a:1", "run_id": "r1", "node": "a", "priority": 2}}',
        '{"run_id": "r1", "kind": "revoke", "task": "shop.ship", "queue": "q", '
        '"payload": {"token": "r1:b:1", "run_id": "r1", "node": "b", "priority": 2, '
        '"terminate": true}}',
        '{"run_id": "p1", "kind": "wakeup", "task": "ductor.tick", "queue": null, '
        '"payload": {"run_id": "p1"}}',
    ]
    assert [_json(i) for i in carrier_revokes(payload, {"r1:b:1": "m1"})] == [
        '{"run_id": "r1", "kind": "revoke", "task": "shop.ship", "queue": "q", '
        '"payload": {"token": "m1", "run_id": "r1", "node": "b", "terminate": true, '
        '"carrier_of": "r1:b:1"}}'
    ]


def test_an_intent_becomes_the_row_a_sweeper_reads_back() -> None:
    intent = step_intent("r1", "t1", "a", "s.a", "q", 3)
    row = outbox_row(12, intent)
    assert row == OutboxRow(
        12, "r1", DispatchKind.STEP, "s.a", "q", json.loads(_json(intent["payload"]))
    )
    row.payload["token"] = "changed"
    assert intent["payload"]["token"] == "t1", "the row does not share the intent's payload"
