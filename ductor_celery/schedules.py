"""The client's side of schedules: ``ductor.schedule(...)`` and friends.

A schedule is a row (``store/schedules.py``); the sweeper in the coordinator fires it. Here
every argument is checked before anything is written, and the workflow's definition (with the
definitions its child runs pin) is stored, so a coordinator that never registered it can
still start it.
"""

from __future__ import annotations

import functools
from datetime import datetime
from typing import Any

from . import limits
from .call_checks import check_id, check_payload
from .client import Client
from .engine.fire_times import check_cadence
from .errors import ScheduleNotFound
from .store import runs
from .store import schedules as rows
from .store.audit import Who, current_source
from .store.db import db_now, with_retry
from .views import RunHandle, ScheduleView

#: Fire times missed by more than this (a coordinator was down) are not caught up.
DEFAULT_CATCHUP_WINDOW_S = 300.0
#: ``<name>@<fire time>`` must fit a workflow id (the ISO time takes up to 32 characters).
MAX_SCHEDULE_NAME = limits.MAX_ID_LENGTH - 40


def check_schedule_name(name: Any) -> str:
    check_id(name, "schedule name")
    if len(name) > MAX_SCHEDULE_NAME:
        raise ValueError(
            f"schedule name must be at most {MAX_SCHEDULE_NAME} characters, got {len(name)}"
        )
    if "@" in name:
        raise ValueError(
            f"schedule name {limits.show(name)} must not contain '@' (run workflow ids are "
            "'<name>@<fire time>')"
        )
    return str(name)


class Schedules:
    def __init__(self, client: Client) -> None:
        self.client = client

    def schedule(
        self,
        name: str,
        workflow: str,
        *,
        cron: str | None = None,
        every: float | None = None,
        timezone: str = "UTC",
        input: Any = None,
        overlap: str = "skip",
        catchup_window: float = DEFAULT_CATCHUP_WINDOW_S,
        by: str | None = None,
    ) -> ScheduleView:
        check_schedule_name(name)
        check_id(workflow, "workflow")
        if by is not None:
            check_id(by, "by")
        cadence = check_cadence(cron, every, timezone)
        if overlap not in rows.OVERLAP_POLICIES:
            raise ValueError(
                f"unknown overlap policy {limits.show(overlap)} "
                f"(one of: {', '.join(rows.OVERLAP_POLICIES)})"
            )
        problem = limits.duration_problem(catchup_window, allow_zero=True)
        if problem is not None:
            kind = ValueError if limits.is_number(catchup_window) else TypeError
            raise kind(f"catchup_window {problem}")
        value = check_payload(
            input, f"input of schedule {name!r}", self.client.settings.max_payload_bytes
        )
        spec = self.client.find_definition(workflow)  # WorkflowNotFound: nothing written
        engine = self.client.engine
        now = self.client._read(db_now, engine)
        # A cron whose year field has run out is refused before anything is written.
        next_fire_at = cadence.next_fire(now, f"schedule {name!r}")
        for needed in self.client._with_children(spec):
            with_retry(
                functools.partial(runs.save_definition, engine, needed), what="save definition"
            )
        row = rows.ScheduleRow(
            name=name,
            workflow=workflow,
            cron=cadence.cron,
            every=cadence.every,
            timezone=cadence.timezone,
            input=value,
            overlap=overlap,
            catchup_window=float(catchup_window),
            paused=False,
            next_fire_at=next_fire_at,
            buffered_fire_at=None,
            last_workflow_id=None,
        )
        who = Who(by, current_source())
        with_retry(lambda: rows.save_schedule(engine, row, who), what="save schedule")
        return self.get(name)

    def unschedule(self, name: str, by: str | None = None) -> None:
        check_schedule_name(name)
        if by is not None:
            check_id(by, "by")
        who = Who(by, current_source())
        if not with_retry(
            lambda: rows.delete_schedule(self.client.engine, name, who), what="delete schedule"
        ):
            raise ScheduleNotFound(f"no schedule named {name!r}")

    def pause(self, name: str) -> None:
        check_schedule_name(name)
        engine = self.client.engine
        if not with_retry(lambda: rows.set_paused(engine, name, True, None), what="pause"):
            raise ScheduleNotFound(f"no schedule named {name!r}")

    def resume(self, name: str) -> None:
        """Fire times that passed while it was paused are not fired: it goes on from now."""
        found = self._row(name)
        engine = self.client.engine
        next_fire_at = found.cadence.next_after(self.client._read(db_now, engine))
        if not with_retry(
            lambda: rows.set_paused(engine, name, False, next_fire_at), what="resume"
        ):
            raise ScheduleNotFound(f"no schedule named {name!r}")

    def trigger(self, name: str) -> RunHandle:
        """Start a run now (even while paused, whatever the overlap policy)."""
        check_schedule_name(name)
        started = with_retry(lambda: rows.trigger(self.client.engine, name), what="trigger")
        if started is None:
            raise ScheduleNotFound(f"no schedule named {name!r}")
        run_id, workflow_id = started
        self.client._safe_wake(run_id)
        return RunHandle(run_id=run_id, workflow_id=workflow_id)

    def get(self, name: str) -> ScheduleView:
        found = self._row(name)
        now: datetime = self.client._read(db_now, self.client.engine)
        return view_of(found, now)

    def list(self) -> list[ScheduleView]:
        found = self.client._read(rows.list_schedules, self.client.engine)
        now: datetime = self.client._read(db_now, self.client.engine)
        return [view_of(r, now) for r in found]

    def _row(self, name: str) -> rows.ScheduleRow:
        check_schedule_name(name)
        found = self.client._read(rows.get_schedule, self.client.engine, name)
        if found is None:
            raise ScheduleNotFound(f"no schedule named {name!r}")
        return found


def view_of(row: rows.ScheduleRow, now: datetime) -> ScheduleView:
    """The row as a view. A paused schedule's ``next_fire_at`` is the time it would fire next
    if resumed at ``now`` (fire times passed while paused are never fired)."""
    next_fire_at = row.next_fire_at
    if row.paused:
        next_fire_at = row.cadence.next_after(now)
    return ScheduleView(
        name=row.name,
        workflow=row.workflow,
        cron=row.cron,
        every=row.every,
        timezone=row.timezone,
        input=row.input,
        overlap=row.overlap,
        catchup_window=row.catchup_window,
        paused=row.paused,
        next_fire_at=next_fire_at,
        buffered_fire_at=row.buffered_fire_at,
        last_workflow_id=row.last_workflow_id,
    )
