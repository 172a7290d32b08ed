"""Issue 9, values side: bad values at the client and CLI door are refused at once, with the
documented exception, before anything is written (no row, no wake-up), on SQLite and on
PostgreSQL alike."""

from __future__ import annotations

import base64
import json
import shutil
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from click.testing import CliRunner

from ductor_celery import (
    Ductor,
    PayloadNotSerializable,
    PayloadTooLarge,
    RunStatus,
    Workflow,
    bulk,
)
from ductor_celery.cli import ductor as ductor_cli
from ductor_celery.limits import MAX_DURATION_S
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store.db import forget_engine

#: ductor_max_payload_bytes in these tests: small, so "too large" is cheap to build.
MAX_BYTES = 1000
LONG_NODE = "n" * 150  # fits its column, but not inside "ductor:decision:<run>:<node>:<at>"


def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        # A copy of the session's migrated file (conftest.py): what upgrade() makes, at once.
        shutil.copyfile(request.getfixturevalue("sqlite_template"), tmp_path / "bad.sqlite3")
        return f"sqlite:///{tmp_path}/bad.sqlite3"
    found: str = request.getfixturevalue("database_url")
    return found


class Door:
    """A Ductor with one open run (``wf-1``), the wake-ups it sends, and the eec_ row counts."""

    def __init__(self, url: str) -> None:
        self.app = Celery(f"bad{id(self)}", broker="memory://", set_as_current=False)
        self.app.conf.ductor_max_payload_bytes = MAX_BYTES
        self.d = Ductor(self.app, database_url=url)
        wf = Workflow("w")
        wf.approval(LONG_NODE)
        wf.wait_signal("go", signal="go", after=[LONG_NODE])
        self.d.register(wf)
        self.handle = self.d.start("w", input={"n": 1}, workflow_id="wf-1")
        self.woken: list[str] = []
        self.d.client._wake = self.d.client._wake_started = self.woken.append

    def counts(self) -> dict[str, int]:
        engine = self.d.client.engine
        tables = [t for t in sa.inspect(engine).get_table_names() if t.startswith("eec_")]
        assert "eec_workflow_run" in tables and "eec_workflow_signal" in tables
        with engine.connect() as conn:
            return {
                t: conn.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one() for t in tables
            }

    def refuses(self, error: type[Exception], call: Callable[[], Any], *needles: str) -> str:
        """``call`` raises ``error`` at once and leaves every eec_ table as it was."""
        before = self.counts()
        started = time.monotonic()
        with pytest.raises(error) as raised:
            call()
        assert time.monotonic() - started < 5.0
        assert type(raised.value) is error, raised.value
        for needle in needles:
            assert needle in str(raised.value)
        assert self.counts() == before
        assert self.woken == []
        return str(raised.value)


@pytest.fixture
def door(db_url: str) -> Iterator[Door]:
    found = Door(db_url)
    yield found
    # Each PostgreSQL test has a database of its own: give its pooled connections back, so a
    # long session never runs the server out of them.
    forget_engine(found.d.settings.database_url)


# -- start --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("workflow_id", "error", "needle"),
    [
        ("x" * 201, ValueError, "at most 200 characters"),
        ("a\x00b", ValueError, "NUL"),
        ("", ValueError, "must not be empty"),
        (5, TypeError, "workflow_id must be a string"),
    ],
)
def test_start_refuses_a_workflow_id_its_column_cannot_hold(
    door: Door, workflow_id: Any, error: type[Exception], needle: str
) -> None:
    door.refuses(error, lambda: door.d.start("w", workflow_id=workflow_id), needle)


@pytest.mark.parametrize(
    ("name", "error"), [("x" * 201, ValueError), ("w\x00", ValueError), (5, TypeError)]
)
def test_start_refuses_a_bad_workflow_name(door: Door, name: Any, error: type[Exception]) -> None:
    door.refuses(error, lambda: door.d.start(name), "workflow")


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (float("nan"), "NaN"),
        ({"a": float("inf")}, "Infinity"),
        ({"a": "x\x00"}, "NUL"),
        ({"k\x00": 1}, "NUL"),
        ("\ud800", "lone surrogate"),
        (nested(101), "nested deeper than 100"),
        (nested(5000), "nested deeper than 100"),
        (10**5000, "4300 digits"),
    ],
    ids=["nan", "inf", "nul", "nul-key", "surrogate", "depth-101", "depth-5000", "int-5000"],
)
def test_start_refuses_input_that_cannot_be_stored_exactly(
    door: Door, value: Any, needle: str
) -> None:
    door.refuses(PayloadNotSerializable, lambda: door.d.start("w", input=value), needle)


def test_start_refuses_input_over_the_payload_limit_in_utf8_bytes(door: Door) -> None:
    door.refuses(PayloadTooLarge, lambda: door.d.start("w", input="é" * 500), "1002 bytes")


# -- signal -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"name": "s" * 201}, ValueError, "signal name must be at most 200"),
        ({"name": "s\x00"}, ValueError, "NUL"),
        ({"name": ""}, ValueError, "must not be empty"),
        ({"name": 5}, TypeError, "signal name must be a string"),
        ({"name": "ductor.x"}, ValueError, "reserved"),
        ({"payload": float("nan")}, PayloadNotSerializable, "NaN"),
        ({"payload": {"a": "\x00"}}, PayloadNotSerializable, "NUL"),
        ({"payload": nested(5000)}, PayloadNotSerializable, "nested deeper"),
        ({"payload": "x" * MAX_BYTES}, PayloadTooLarge, "over ductor_max_payload_bytes"),
        ({"idempotency_key": ""}, ValueError, "idempotency_key must not be empty"),
        ({"idempotency_key": 7}, TypeError, "idempotency_key must be a string"),
        ({"idempotency_key": "k" * 201}, ValueError, "at most 200"),
        ({"idempotency_key": "k\x00"}, ValueError, "NUL"),
    ],
)
def test_signal_refuses_a_bad_name_payload_or_idempotency_key(
    door: Door, kwargs: dict[str, Any], error: type[Exception], needle: str
) -> None:
    args = {"name": "go", "payload": None, "idempotency_key": None, **kwargs}
    door.refuses(error, lambda: door.d.signal("wf-1", **args), needle)


# -- targets ------------------------------------------------------------------------------

TARGET_CALLS: dict[str, Callable[[Ductor, Any], Any]] = {
    "get": lambda d, t: d.get(t),
    "wait": lambda d, t: d.wait(t, timeout=0),
    "signal": lambda d, t: d.signal(t, "go"),
    "approve": lambda d, t: d.approve(t, LONG_NODE),
    "reject": lambda d, t: d.reject(t, LONG_NODE),
    "pause": lambda d, t: d.pause(t),
    "resume": lambda d, t: d.resume(t),
    "cancel": lambda d, t: d.cancel(t),
    "terminate": lambda d, t: d.terminate(t),
    "redrive": lambda d, t: d.redrive(t),
    "continue_as_new": lambda d, t: d.continue_as_new(t),
}


@pytest.mark.parametrize("call", sorted(TARGET_CALLS))
@pytest.mark.parametrize(
    ("target", "error"),
    [(5, TypeError), (None, TypeError), ("t" * 201, ValueError), ("wf-1\x00", ValueError)],
)
def test_every_target_must_be_an_id_of_at_most_200_characters(
    door: Door, call: str, target: Any, error: type[Exception]
) -> None:
    door.refuses(error, lambda: TARGET_CALLS[call](door.d, target), "target")


# -- reasons, approvers, comments ---------------------------------------------------------


@pytest.mark.parametrize("control", ["pause", "cancel", "terminate"])
@pytest.mark.parametrize(
    ("reason", "error", "needle"),
    [
        (5, TypeError, "reason must be a string or None"),
        ("why\x00", ValueError, "NUL"),
        ("\ud800", ValueError, "lone surrogate"),
        ("é" * MAX_BYTES, PayloadTooLarge, "reason is 2000 bytes"),
    ],
)
def test_a_control_reason_is_text_without_nul_within_the_payload_limit(
    door: Door, control: str, reason: Any, error: type[Exception], needle: str
) -> None:
    door.refuses(error, lambda: getattr(door.d, control)("wf-1", reason=reason), needle)


@pytest.mark.parametrize("verb", ["approve", "reject"])
@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"by": 5}, TypeError, "by must be a string"),
        ({"by": "b" * 201}, ValueError, "by must be at most 200"),
        ({"by": "b\x00"}, ValueError, "NUL"),
        ({"comment": 5}, TypeError, "comment must be a string or None"),
        ({"comment": "c\x00"}, ValueError, "NUL"),
        ({"comment": "c" * (MAX_BYTES + 1)}, PayloadTooLarge, "comment is 1001 bytes"),
        ({"node": 5}, TypeError, "node must be a string"),
        ({"node": "n" * 201}, ValueError, "node must be at most 200"),
    ],
)
def test_approve_and_reject_check_node_by_and_comment(
    door: Door, verb: str, kwargs: dict[str, Any], error: type[Exception], needle: str
) -> None:
    args = {"node": LONG_NODE, "by": None, "comment": None, **kwargs}
    node = args.pop("node")
    door.refuses(error, lambda: getattr(door.d, verb)("wf-1", node, **args), needle)


def test_a_decision_on_a_node_with_a_long_id_fits_the_key_column(door: Door) -> None:
    run_tick(door.d.runtime, door.handle.run_id)
    assert door.d.get("wf-1").nodes[LONG_NODE].status == "waiting"
    door.d.approve("wf-1", LONG_NODE, by="alice", comment="ok")
    run_tick(door.d.runtime, door.handle.run_id)
    node = door.d.get("wf-1").nodes[LONG_NODE]
    assert node.status == "succeeded" and node.output["by"] == "alice"


# -- wait and list_runs -------------------------------------------------------------------


@pytest.mark.timeout(30)  # without the check, wait(timeout=nan) never returns
@pytest.mark.parametrize(
    ("timeout", "error"),
    [
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (-1, ValueError),
        ("5", TypeError),
        (True, TypeError),
    ],
)
def test_wait_timeout_nan_is_refused_at_once(
    door: Door, timeout: Any, error: type[Exception]
) -> None:
    message = door.refuses(error, lambda: door.d.wait("wf-1", timeout=timeout), "timeout")
    if error is ValueError:
        assert "use None to wait forever" in message


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"limit": 0}, ValueError, "between 1 and 1000"),
        ({"limit": 1001}, ValueError, "between 1 and 1000"),
        ({"limit": True}, TypeError, "limit must be an integer"),
        ({"limit": 5.0}, TypeError, "limit must be an integer"),
        ({"status": "done"}, ValueError, "succeeded"),
        ({"status": 5}, TypeError, "status must be a string"),
        ({"workflow": 5}, TypeError, "workflow must be a string"),
        ({"workflow": "w\x00"}, ValueError, "NUL"),
    ],
)
def test_list_runs_checks_limit_status_and_workflow(
    door: Door, kwargs: dict[str, Any], error: type[Exception], needle: str
) -> None:
    door.refuses(error, lambda: door.d.list_runs(**kwargs), needle)
    assert [v.run_id for v in door.d.list_runs(status=RunStatus.PENDING, limit=1000)] == [
        door.handle.run_id
    ]


# -- the command line ---------------------------------------------------------------------


def _cli(door: Door, *args: str) -> Any:
    return CliRunner().invoke(ductor_cli, list(args), obj=SimpleNamespace(app=door.app))


@pytest.mark.parametrize(
    ("command", "text", "needle"),
    [
        ("start", "[" * 5000 + "]" * 5000, "--input is nested too deeply"),
        ("start", "1" * 5000, "--input is not valid JSON: an integer of 5000 digits"),
        ("start", '{"a": NaN}', "--input is not valid JSON: NaN"),
        ("start", "[-Infinity]", "-Infinity"),
        ("start", json.dumps(nested(101)), "--input is nested too deeply (at most 100 levels)"),
        ("signal", "[" * 5000 + "]" * 5000, "--payload is nested too deeply"),
        ("signal", "9" * 4301, "--payload is not valid JSON: an integer of 4301 digits"),
        ("signal", "NaN", "--payload is not valid JSON: NaN"),
    ],
)
def test_cli_bad_json_is_one_line_and_exit_1(
    door: Door, command: str, text: str, needle: str
) -> None:
    before = door.counts()
    if command == "start":
        result = _cli(door, "start", "w", "--input", text)
    else:
        result = _cli(door, "signal", "wf-1", "go", "--payload", text)
    assert result.exit_code == 1, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert door.counts() == before


@pytest.mark.parametrize("timeout", ["nan", "inf", "-1"])
def test_cli_start_wait_timeout_nan_is_one_line_and_starts_nothing(
    door: Door, timeout: str
) -> None:
    before = door.counts()
    result = _cli(door, "start", "w", "--wait", "--timeout", timeout)
    assert result.exit_code == 1, result.output
    assert result.stderr.count("\n") == 1 and "use None to wait forever" in result.stderr
    assert result.stdout == ""
    assert door.counts() == before


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("signal", "wf-1", "go", "--idempotency-key", "k" * 201), "idempotency_key"),
        (("show", "t" * 201), "target must be at most 200"),
        (("pause", "wf-1", "--reason", "é" * MAX_BYTES), "reason is 2000 bytes"),
        (("runs", "--status", "done"), "unknown run status 'done'"),
        (("start", "w", "--workflow-id", "x" * 201), "workflow_id must be at most 200"),
    ],
)
def test_cli_bad_values_are_one_line_and_exit_1(
    door: Door, args: tuple[str, ...], needle: str
) -> None:
    before = door.counts()
    result = _cli(door, *args)
    assert result.exit_code == 1, result.output
    assert result.stderr.count("\n") == 1 and needle in result.stderr
    assert door.counts() == before


# -- times at the edge of the calendar (issue 22 item 7) -----------------------------------

#: Year 1 at +14:00 is in year 0 in UTC; 9999-12-31 at -14:00 is in year 10000.
BEFORE_YEAR_1 = datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=14)))
AFTER_9999 = datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone(timedelta(hours=-14)))
FAR = datetime(9999, 12, 31, 23, tzinfo=UTC)
TEN_YEARS = timedelta(seconds=MAX_DURATION_S)


def crafted_cursor(at: str, run_id: str = "r" * 32) -> str:
    """A cursor as list_runs encodes one, around a time it never returns."""
    text = json.dumps([at, run_id], separators=(",", ":"))
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        # Accepted before, and then a deadline of an hour overflowed in the client (a
        # deadline of seconds was accepted and stored past the calendar's end).
        ({"start_at": FAR}, "start_at must be at most ten years (315360000 s) ahead, like delay"),
        ({"start_at": FAR, "deadline": 3600}, "start_at must be at most ten years"),
        ({"start_at": FAR, "deadline": 1}, "start_at must be at most ten years"),
        ({"start_at": BEFORE_YEAR_1}, "start_at 0001-01-01T00:00:00+14:00 is out of range"),
        ({"start_at": AFTER_9999}, "start_at 9999-12-31T23:59:59-14:00 is out of range"),
        ({"start_at": datetime(1, 1, 1, tzinfo=UTC)}, "at most ten years (315360000 s) in the"),
    ],
)
def test_start_refuses_a_start_at_beyond_ten_years_or_past_the_calendar(
    door: Door, kwargs: dict[str, Any], needle: str
) -> None:
    door.refuses(ValueError, lambda: door.d.start("w", **kwargs), needle)


def test_start_at_just_over_ten_years_ahead_is_refused_and_just_under_is_kept(door: Door) -> None:
    now = datetime.now(UTC)
    door.refuses(
        ValueError,
        lambda: door.d.start("w", start_at=now + TEN_YEARS + timedelta(hours=1)),
        "at most ten years",
    )
    # Its workflow's longest deadline counts from it, and still fits the calendar.
    at = now + TEN_YEARS - timedelta(hours=1)
    view = door.d.get(door.d.start("w", start_at=at, deadline=MAX_DURATION_S).run_id)
    assert view.status == RunStatus.PENDING and view.start_at == at
    assert view.deadline_at == at + TEN_YEARS


def test_a_workflow_deadline_with_a_far_start_writes_nothing(door: Door) -> None:
    wf = Workflow("long", deadline=MAX_DURATION_S)
    wf.approval("ok")
    door.d.register(wf)
    door.refuses(ValueError, lambda: door.d.start("long", start_at=FAR), "start_at")


def test_start_in_the_callers_transaction_refuses_a_far_start_at(door: Door) -> None:
    def start_joined() -> None:
        with door.d.client.engine.begin() as conn:
            door.d.start("w", start_at=FAR, connection=conn)

    door.refuses(ValueError, start_joined, "start_at must be at most ten years")


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"since": BEFORE_YEAR_1}, "since 0001-01-01T00:00:00+14:00 is out of range"),
        ({"since": "0001-01-01T00:00:00+14:00"}, "since 0001-01-01T00:00:00+14:00 is out of"),
        ({"until": AFTER_9999}, "until 9999-12-31T23:59:59-14:00 is out of range"),
        ({"until": "9999-12-31T23:59:59-14:00"}, "until 9999-12-31T23:59:59-14:00 is out of"),
        ({"cursor": crafted_cursor("0001-01-01T00:00:00+14:00")}, "cursor"),
        ({"cursor": crafted_cursor("9999-12-31T23:59:59-14:00")}, "cursor"),
        ({"cursor": crafted_cursor("2026-01-01T00:00:00")}, "cursor"),
    ],
)
def test_list_runs_refuses_times_past_either_end_of_the_calendar(
    door: Door, kwargs: dict[str, Any], needle: str
) -> None:
    door.refuses(ValueError, lambda: door.d.list_runs(**kwargs), needle)


def test_list_runs_takes_the_calendars_own_ends_in_utc(door: Door) -> None:
    first = datetime(1, 1, 1, tzinfo=UTC)
    last = datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)
    ids = [door.handle.run_id]
    assert [v.run_id for v in door.d.list_runs(since=first, until=last)] == ids
    assert list(door.d.list_runs(until=first)) == []
    assert list(door.d.list_runs(since=last)) == []
    cursor = crafted_cursor(last.isoformat(), "z" * 32)
    assert [v.run_id for v in door.d.list_runs(cursor=cursor)] == ids


def test_a_bulk_control_refuses_a_since_past_the_calendar(door: Door) -> None:
    door.refuses(
        ValueError,
        lambda: bulk.select(door.d.client, "cancel", workflow="w", since=BEFORE_YEAR_1),
        "since 0001-01-01T00:00:00+14:00 is out of range",
    )


@pytest.mark.parametrize("older_than", [timedelta(days=999_999_999), 1e300, 10**400])
def test_prune_refuses_an_age_past_ten_years(door: Door, older_than: Any) -> None:
    door.refuses(ValueError, lambda: door.d.prune(older_than=older_than), "older_than")


def test_a_schedule_whose_cron_never_fires_again_is_refused(door: Door) -> None:
    # A valid cron (it fired on 2020-01-01) with no fire time after now: croniter's own
    # error escaped before, after the definition had been written.
    door.refuses(
        ValueError,
        lambda: door.d.schedule("over", workflow="w", cron="0 0 1 1 * 0 2020"),
        "cron expression '0 0 1 1 * 0 2020' has no fire time after",
    )


CRAFTED = crafted_cursor("0001-01-01T00:00:00+14:00")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("prune", "--older-than", "99999999999d"), "--older-than must be at most ten years"),
        (("prune", "--older-than", "3651d", "--dry-run"), "--older-than must be at most ten"),
        (
            ("cancel", "--workflow", "w", "--since", "99999999999w", "--yes"),
            "--since must be at most ten years",
        ),
        (
            ("cancel", "--workflow", "w", "--since", "0001-01-01T00:00:00+14:00", "--yes"),
            "--since 0001-01-01T00:00:00+14:00 is out of range",
        ),
        (("runs", "--since", "0001-01-01T00:00:00+14:00"), "--since 0001-01-01T00:00:00+14:00"),
        (("runs", "--until", "9999-12-31T23:59:59-14:00"), "--until 9999-12-31T23:59:59-14:00"),
        (("runs", "--since", "99999999999w"), "--since '99999999999w' is more than ten years"),
        (("runs", "--cursor", CRAFTED), "is not a cursor that list_runs returned"),
        (("start", "w", "--delay", "1e20"), "delay must be at most 315360000 s"),
        (("start", "w", "--deadline", "inf"), "deadline must be a finite number"),
        (
            ("schedule", "add", "s", "--workflow", "w", "--every", "99999999999w"),
            "--every must be at most ten years",
        ),
        (
            ("schedule", "add", "s", "--workflow", "w", "--cron", "0 0 1 1 * 0 2020"),
            "has no fire time after",
        ),
    ],
)
def test_cli_times_past_ten_years_or_the_calendar_are_one_line_and_exit_1(
    door: Door, args: tuple[str, ...], needle: str
) -> None:
    before = door.counts()
    result = _cli(door, *args)
    assert result.exit_code == 1, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert door.counts() == before
    assert door.d.get("wf-1").status == RunStatus.PENDING
