"""Issue 22 item 7 as a property: times and durations from the whole calendar at the door.

Hypothesis draws datetimes from year 1 to 9999, naive or at any UTC offset up to +-14 hours
(so ``0001-01-01T00:00+14:00``, which is in year 0 in UTC, and ``9999-12-31T23:00-14:00``,
which is in year 10000), times around now, and durations of every shape (timedeltas of up to
999,999,999 days, floats with nan and infinities, huge and negative integers), and feeds them
to ``start(start_at=, deadline=, delay=)``, ``list_runs(since=, until=, cursor=)``, the bulk
controls' ``since`` and ``prune(older_than=)``. Each call is accepted, or refused with
``ValueError``, ``TypeError`` or a ``DuctorError``: never ``OverflowError`` or anything else,
and a refused call writes nothing. An accepted start's run reads back and ticks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from ductor_celery import Ductor, DuctorError, Workflow, bulk
from ductor_celery.engine.status import OPEN_RUN_STATUSES
from ductor_celery.limits import MAX_DURATION_S
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store.db import forget_engine
from ductor_celery.store.migrate import upgrade
from ductor_celery.store.runs import encode_cursor

#: How long any call at the door may take ("at once").
AT_ONCE_S = 3.0
REFUSALS = (ValueError, TypeError, DuctorError)

OFFSETS = st.timedeltas(min_value=timedelta(hours=-14), max_value=timedelta(hours=14)).map(timezone)
#: Anywhere in the calendar, naive or at any offset up to +-14 hours.
ANY_TIME = st.datetimes(timezones=st.one_of(st.none(), st.just(UTC), OFFSETS))
#: Around now: up to twenty years either way, at any offset (the ten-year bound's edges).
AROUND_NOW = st.tuples(
    st.timedeltas(min_value=timedelta(days=-7400), max_value=timedelta(days=7400)), OFFSETS
).map(lambda t: (datetime.now(UTC) + t[0]).astimezone(t[1]))
#: The calendar's first and last days, at any offset: half of them are no time in UTC.
ITS_ENDS = st.one_of(
    st.datetimes(max_value=datetime(1, 1, 2), timezones=OFFSETS),  # noqa: DTZ001
    st.datetimes(min_value=datetime(9999, 12, 31), timezones=OFFSETS),  # noqa: DTZ001
)
TIMES = st.one_of(ANY_TIME, AROUND_NOW, ITS_ENDS)
DURATIONS = st.one_of(
    st.timedeltas(),
    st.floats(),
    st.integers(min_value=-(10**20), max_value=10**400),
    st.sampled_from([MAX_DURATION_S, MAX_DURATION_S + 1, 0, 0.5, 86400 * 3650]),
)


class Door:
    def __init__(self, url: str) -> None:
        self.app = Celery(f"edges{id(self)}", broker="memory://", set_as_current=False)
        self.d = Ductor(self.app, database_url=url)
        wf = Workflow("w")
        wf.approval("ok")
        self.d.register(wf)
        self.d.start("w", workflow_id="wf-1")
        self.woken: list[str] = []
        self.d.client._wake = self.d.client._wake_started = self.woken.append

    def counts(self) -> dict[str, int]:
        engine = self.d.client.engine
        tables = [t for t in sa.inspect(engine).get_table_names() if t.startswith("eec_")]
        with engine.connect() as conn:
            return {
                t: conn.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one() for t in tables
            }

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` returns, or raises one of REFUSALS at once and writes nothing."""
        before = self.counts()
        woken = len(self.woken)
        started = time.monotonic()
        try:
            result = fn()
        except REFUSALS as exc:
            note(f"{what}: refused with {type(exc).__name__}: {exc}")
            assert time.monotonic() - started < AT_ONCE_S
            assert self.counts() == before, what
            assert len(self.woken) == woken, what
            return None
        note(f"{what}: accepted")
        return result


@pytest.fixture(params=["sqlite", "postgresql"])
def door(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Door]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/edges.sqlite3"
        upgrade(url)
    else:
        url = request.getfixturevalue("database_url")
    found = Door(url)
    yield found
    forget_engine(found.d.settings.database_url)  # its pooled connections back to the server


def _close(door: Door, run_id: str) -> None:
    """End an accepted run (unless its deadline already has), so the next start is new."""
    if door.d.get(run_id).status in OPEN_RUN_STATUSES:
        door.d.terminate(run_id)


PROPERTY = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@PROPERTY
@given(start_at=TIMES, deadline=st.one_of(st.none(), DURATIONS))
def test_start_at_and_deadline_from_the_whole_calendar(
    door: Door, start_at: datetime, deadline: Any
) -> None:
    handle = door.call("start", lambda: door.d.start("w", start_at=start_at, deadline=deadline))
    if handle is None:
        return
    view = door.d.get(handle.run_id)
    assert view.start_at == start_at
    assert view.start_at is not None
    assert abs((view.start_at - datetime.now(UTC)).total_seconds()) <= MAX_DURATION_S + 60
    run_tick(door.d.runtime, handle.run_id)  # a tick of the accepted run never raises
    _close(door, handle.run_id)


@PROPERTY
@given(delay=DURATIONS, deadline=st.one_of(st.none(), DURATIONS))
def test_delay_and_deadline_of_every_shape(door: Door, delay: Any, deadline: Any) -> None:
    handle = door.call("start", lambda: door.d.start("w", delay=delay, deadline=deadline))
    if handle is not None:
        run_tick(door.d.runtime, handle.run_id)
        _close(door, handle.run_id)


@PROPERTY
@given(when=TIMES, as_text=st.booleans(), bound=st.sampled_from(["since", "until"]))
def test_list_runs_bounds_from_the_whole_calendar(
    door: Door, when: datetime, as_text: bool, bound: str
) -> None:
    value: Any = when.isoformat() if as_text else when
    page = door.call("list_runs", lambda: door.d.list_runs(**{bound: value}))
    if page is not None:
        assert len(page) <= 1000


@PROPERTY
@given(when=TIMES)
def test_a_cursor_around_any_time(door: Door, when: datetime) -> None:
    cursor = encode_cursor((when, "r" * 32))
    door.call("list_runs", lambda: door.d.list_runs(cursor=cursor))


@PROPERTY
@given(when=TIMES)
def test_a_bulk_controls_since_from_the_whole_calendar(door: Door, when: datetime) -> None:
    door.call("bulk", lambda: bulk.select(door.d.client, "cancel", workflow="w", since=when))


@PROPERTY
@given(older_than=DURATIONS, dry_run=st.booleans())
def test_prune_older_than_of_every_shape(door: Door, older_than: Any, dry_run: bool) -> None:
    door.call("prune", lambda: door.d.prune(older_than=older_than, dry_run=dry_run))
