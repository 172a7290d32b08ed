"""The engine's closed vocabulary: statuses and their groups, dispatch and control kinds, which
control each run status allows, and the result a handled control records.

The client and the coordinator read the one ``CONTROL_ALLOWED`` table; these tests hold the
table whole and check that both sides decide every (status, control) pair the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from support import NOW, RUN, pure_tick

from ductor_celery.call_checks import check_control
from ductor_celery.definition import RetryPolicy, Workflow
from ductor_celery.engine import ControlIn, RunState, RunStatus, TickInputs
from ductor_celery.engine.controls import control_problem
from ductor_celery.engine.kinds import (
    CONTROL_ALLOWED,
    CONTROL_APPLIED,
    ControlKind,
    DispatchKind,
    control_rejected,
    rejection_of,
    statuses_allowing,
)
from ductor_celery.engine.status import OPEN_RUN_STATUSES, TERMINAL_RUN_STATUSES
from ductor_celery.errors import InvalidOperation
from ductor_celery.runtime.dispatch import Dispatcher
from ductor_celery.store.outbox import OutboxRow, step_intent, wakeup_intent
from ductor_celery.store.schema import OPEN_STATUSES_SQL

PAIRS = [(status, kind) for status in RunStatus for kind in ControlKind]

# -- statuses ----------------------------------------------------------------------------------


def test_every_run_status_is_open_or_terminal_and_never_both() -> None:
    assert OPEN_RUN_STATUSES | TERMINAL_RUN_STATUSES == set(RunStatus)
    assert not OPEN_RUN_STATUSES & TERMINAL_RUN_STATUSES
    assert OPEN_RUN_STATUSES == {RunStatus.PENDING, RunStatus.RUNNING, RunStatus.PAUSED}


def test_the_open_run_predicate_is_made_from_the_open_statuses() -> None:
    # The very text migration 0001 gave the partial unique index (no migration needed);
    # tests/integration/test_migrations.py compares it with the migrated databases.
    assert OPEN_STATUSES_SQL == "status IN ('pending', 'running', 'paused')"
    named = OPEN_STATUSES_SQL.removeprefix("status IN (").removesuffix(")").split(", ")
    assert {s.strip("'") for s in named} == {s.value for s in OPEN_RUN_STATUSES}


def test_open_statuses_match_plain_strings_as_rows_and_snapshots_hold_them() -> None:
    assert "paused" in OPEN_RUN_STATUSES and "missing" not in OPEN_RUN_STATUSES
    assert "continued" in TERMINAL_RUN_STATUSES


# -- kinds are stored as the strings they always were -----------------------------------------


def test_kinds_keep_their_stored_strings() -> None:
    assert [k.value for k in DispatchKind] == ["step", "revoke", "wakeup"]
    assert [k.value for k in ControlKind] == [
        "pause",
        "resume",
        "cancel",
        "terminate",
        "redrive",
        "continue_as_new",
    ]
    assert DispatchKind.STEP == "step" and f"{ControlKind.CONTINUE_AS_NEW}" == "continue_as_new"
    assert step_intent("r", "t", "n", "s", None)["kind"] is DispatchKind.STEP
    assert wakeup_intent("r")["kind"] is DispatchKind.WAKEUP


@pytest.mark.parametrize("kind", [DispatchKind, ControlKind])
def test_parse_keeps_an_unknown_stored_kind_as_its_text(kind: Any) -> None:
    for member in kind:
        assert kind.parse(member.value) is member
    unknown = kind.parse("teleport")
    assert unknown == "teleport" and not isinstance(unknown, kind)


def test_a_control_result_is_made_and_read_in_one_place() -> None:
    assert CONTROL_APPLIED == "applied" and rejection_of(CONTROL_APPLIED) is None
    result = control_rejected("run is already failed")
    assert result == "rejected: run is already failed"
    assert rejection_of(result) == "run is already failed"
    assert rejection_of(None) is None
    assert rejection_of(control_rejected("")) == ""


# -- CONTROL_ALLOWED ---------------------------------------------------------------------------


def test_control_allowed_covers_every_status_with_known_kinds() -> None:
    assert set(CONTROL_ALLOWED) == set(RunStatus)
    assert all(kinds <= set(ControlKind) for kinds in CONTROL_ALLOWED.values())
    # Every control is allowed somewhere, and no terminal run can be paused or resumed.
    assert {k for kinds in CONTROL_ALLOWED.values() for k in kinds} == set(ControlKind)
    for status in TERMINAL_RUN_STATUSES:
        assert CONTROL_ALLOWED[status] <= {ControlKind.REDRIVE}
    for status in OPEN_RUN_STATUSES:
        assert {ControlKind.CANCEL, ControlKind.TERMINATE} <= CONTROL_ALLOWED[status]


def test_control_allowed_says_what_the_client_and_the_coordinator_always_did() -> None:
    expected = {
        ControlKind.PAUSE: {RunStatus.PENDING, RunStatus.RUNNING},
        ControlKind.RESUME: {RunStatus.PAUSED},
        ControlKind.CANCEL: OPEN_RUN_STATUSES,
        ControlKind.TERMINATE: OPEN_RUN_STATUSES,
        # A timed-out run (issue 14 item 2) is redriven like a failed one.
        ControlKind.REDRIVE: {
            RunStatus.FAILED,
            RunStatus.CANCELLED,
            RunStatus.TERMINATED,
            RunStatus.TIMED_OUT,
        },
        ControlKind.CONTINUE_AS_NEW: OPEN_RUN_STATUSES,
    }
    assert {kind: statuses_allowing(kind) for kind in ControlKind} == expected


@pytest.mark.parametrize(("status", "kind"), PAIRS)
def test_the_client_and_the_engine_agree(status: RunStatus, kind: ControlKind) -> None:
    allowed = kind in CONTROL_ALLOWED[status]
    assert (control_problem(status, kind) is None) is allowed
    assert (control_problem(status, kind.value) is None) is allowed  # as a row holds it
    if allowed:
        check_control("r1", status, kind)
        return
    with pytest.raises(InvalidOperation) as refused:
        check_control("r1", status, kind)
    allowed_in = ", ".join(sorted(s.value for s in statuses_allowing(kind)))
    assert str(refused.value) == (
        f"cannot {kind.value.replace('_', '-')} run r1: it is {status.value} "
        f"(allowed when {allowed_in})"
    )


@pytest.mark.parametrize(("status", "kind"), PAIRS)
def test_a_tick_applies_exactly_the_allowed_controls(status: RunStatus, kind: ControlKind) -> None:
    spec = Workflow("one").step("a", "s", retry=RetryPolicy(max_attempts=1)).build()
    state = RunState.initial(spec.graph.order)
    state.status = status
    inputs = TickInputs(run_id=RUN, control=ControlIn(7, kind, has_input=False))
    handled = pure_tick(spec, state, inputs, NOW).handled_control
    assert handled is not None and handled.id == 7
    if kind in CONTROL_ALLOWED[status]:
        assert handled.result == CONTROL_APPLIED
    else:
        assert rejection_of(handled.result) == control_problem(status, kind)


def test_an_unknown_control_is_rejected_by_name() -> None:
    assert control_problem(RunStatus.RUNNING, "explode") == "unknown control 'explode'"
    with pytest.raises(ValueError):
        ControlKind("explode")  # the client refuses it before any query


def test_the_refusals_keep_their_wording() -> None:
    assert control_problem(RunStatus.PAUSED, ControlKind.PAUSE) == (
        "run is paused, only a running run can be paused"
    )
    assert control_problem(RunStatus.FAILED, ControlKind.CANCEL) == "run is already failed"
    with pytest.raises(InvalidOperation, match=r"allowed when paused, pending, running\)"):
        check_control("r1", RunStatus.SUCCEEDED, ControlKind.CANCEL)


# -- the dispatcher ----------------------------------------------------------------------------


class _App:
    """What Dispatcher uses of a Celery app, recording what it is asked to send."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, list[Any]]] = []
        self.revoked: list[tuple[str, bool]] = []
        self.control = self

    @contextmanager
    def producer_or_acquire(self) -> Iterator[None]:
        yield None

    def send_task(self, name: str, args: list[Any], **_: Any) -> None:
        self.sent.append((name, args))

    def revoke(self, token: str, terminate: bool = False) -> None:
        self.revoked.append((token, terminate))


def test_the_dispatcher_sends_each_kind_and_logs_an_unknown_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = _App()
    rows = [
        OutboxRow(1, "r1", DispatchKind.STEP, "s.a", None, {"token": "r1:a:1", "node": "a"}),
        OutboxRow(2, "r1", "teleport", "x", None, {}),  # a newer ductor's kind, read back
        OutboxRow(3, "r1", DispatchKind.REVOKE, "s.a", None, {"token": "r1:a:0"}),
        OutboxRow(4, "r2", "wakeup", "ductor.tick", None, {"run_id": "r2"}),  # plain text too
        # terminate and a run deadline: the worker kills the step if it is running
        OutboxRow(5, "r1", DispatchKind.REVOKE, "s.a", None, {"token": "r1:a:2", "terminate": 1}),
    ]
    with caplog.at_level(logging.ERROR, logger="ductor_celery.dispatch"):
        Dispatcher(app, "steps", "coord").send(rows)
    assert app.sent == [("s.a", ["r1:a:1"]), ("ductor.tick", ["r2"])]
    # ... and the run's first-tick message, which runs the run's attempts inline
    assert app.revoked == [("r1:a:0", False), ("r1:a:2", True), ("r1:first_tick", True)]
    assert [r.getMessage() for r in caplog.records] == ["unknown outbox kind 'teleport' for run r1"]


def test_a_first_tick_message_is_sent_to_the_steps_queue_under_its_runs_id() -> None:
    sent: list[tuple[str, list[Any], dict[str, Any]]] = []

    class App(_App):
        def send_task(self, name: str, args: list[Any], **kw: Any) -> None:
            sent.append((name, args, kw))

    Dispatcher(App(), "steps", "coord").first_tick("r9")
    [(name, args, kw)] = sent
    assert (name, args, kw["queue"], kw["task_id"]) == (
        "ductor.first_tick",
        ["r9"],
        "steps",
        "r9:first_tick",
    )
