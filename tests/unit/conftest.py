"""Checks every unit test's ticks make on the way."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest

from ductor_celery.engine import tick as engine_tick
from ductor_celery.engine.context import TickContext


@pytest.fixture(autouse=True)
def ready_walks_skip_only_what_finds_nothing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``start_ready_nodes`` skips its walk over the nodes when no status moved since its last
    walk (engine/schedule.py). In every tick of every unit test, each call is also made on a
    copy of the tick with the walk forced, and both must come out the same."""
    real = engine_tick.start_ready_nodes

    def checked(t: TickContext) -> bool:
        twin = copy.deepcopy(t)
        twin.ready_walked_at = -1
        walked = real(twin)
        moved = real(t)
        assert (moved, t.payload) == (walked, twin.payload), "a skipped walk would have moved"
        return moved

    monkeypatch.setattr(engine_tick, "start_ready_nodes", checked)
    yield
