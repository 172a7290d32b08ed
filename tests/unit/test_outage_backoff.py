"""The sweeper and heartbeats through a database outage (issue 24): failing sweeps back off
instead of asking a database that is away (or being failed over) every interval, each with a
traceback, and the first sweep that works brings the interval back; a step heartbeating in a
loop does not become a loop of connection attempts."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from ductor_celery.runtime import sweeper as sweeper_module
from ductor_celery.runtime.sweeper import Sweeper


def test_failing_sweeps_back_off_and_a_good_one_resets_the_interval(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sweeper_module, "SWEEP_BACKOFF_MAX_S", 0.16)
    rt: Any = SimpleNamespace(settings=SimpleNamespace(sweep_interval=0.01))
    sweeper = Sweeper(rt)
    calls: list[float] = []
    database_back = threading.Event()

    def sweep_once() -> dict[str, int]:
        calls.append(time.monotonic())
        if not database_back.is_set():
            raise OperationalError("SELECT 1", {}, Exception("connection refused\nhost 2: ..."))
        return {}

    monkeypatch.setattr(sweeper, "sweep_once", sweep_once)
    with caplog.at_level(logging.WARNING, logger="ductor_celery.sweeper"):
        sweeper.start()
        time.sleep(0.6)
        failing = len(calls)
        database_back.set()
        time.sleep(0.3)
        sweeper.stop()
    # Without backoff: some 60 sweeps in 0.6 s. With it: 0.01, 0.02, 0.04, 0.08, then 0.16 s.
    assert 3 <= failing <= 9, failing
    gaps = [b - a for a, b in zip(calls, calls[1:failing], strict=False)]
    assert gaps == sorted(gaps) or max(gaps) >= 0.15, gaps
    assert len(calls) - failing >= 5  # back to every 0.01 s once a sweep works
    # One line per failed sweep, no traceback, the error's first line only.
    records = [r for r in caplog.records if "database unreachable" in r.getMessage()]
    assert len(records) == failing
    assert all(r.exc_info is None and "host 2" not in r.getMessage() for r in records)


def test_heartbeats_pause_after_one_fails_to_reach_the_database(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step heartbeating in a loop while the database is away tries it about once a
    second, not at every call."""
    from ductor_celery.runtime import heartbeats

    tries: list[float] = []
    down = [True]

    def heartbeat(engine: Any, token: str, details: Any) -> bool:
        tries.append(time.monotonic())
        if down[0]:
            raise OperationalError("UPDATE", {}, Exception("connection refused"))
        return False

    monkeypatch.setattr(heartbeats.attempts, "heartbeat", heartbeat)
    monkeypatch.setattr(heartbeats, "HEARTBEAT_PAUSE_S", 0.2)
    pause = heartbeats.HeartbeatPause()
    began = time.monotonic()
    while time.monotonic() - began < 0.5:
        assert heartbeats.heartbeat(None, "t", {"n": 1}, 1000, pause=pause) is False
        time.sleep(0.005)
    assert 2 <= len(tries) <= 4, len(tries)  # about every 0.2 s, not ~100 times
    down[0] = False
    time.sleep(0.25)
    heartbeats.heartbeat(None, "t", None, 1000, pause=pause)
    heartbeats.heartbeat(None, "t", None, 1000, pause=pause)
    assert time.monotonic() - tries[-2] < 0.1  # back: every heartbeat is written again
