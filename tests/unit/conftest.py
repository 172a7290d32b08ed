"""Checks every unit test's ticks make on the way."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator

import pytest
from support import with_unstarted

from ductor_celery.engine import tick as engine_tick
from ductor_celery.engine.context import TickContext
from ductor_celery.engine.inputs import TickPayload
from ductor_celery.store import blobs
from ductor_celery.store.schema import dumps_json
from ductor_celery.store.state_text import state_text


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


@pytest.fixture(autouse=True)
def state_texts_are_the_states(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A commit on PostgreSQL stores ``state_text``, which reuses the texts of nodes unchanged
    since this thread's last one (store/state_text.py). Every tick of every unit test comes
    out of it as the very JSON ``to_json`` makes, all under one run id: a test's ticks reuse
    the texts of its earlier ones (and of earlier tests': identity decides, not the run)."""
    real = engine_tick._finish

    def checked(t: TickContext) -> TickPayload:
        payload = real(t)
        state = payload.state
        made = json.dumps(
            with_unstarted(json.loads(state_text("unit-test", state))), sort_keys=True
        )
        assert made == json.dumps(json.loads(dumps_json(state.to_json())), sort_keys=True)
        return payload

    monkeypatch.setattr(engine_tick, "_finish", checked)
    yield


@pytest.fixture(autouse=True)
def kept_argument_texts_are_the_arguments(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A new attempt may carry its arguments' JSON text from their check
    (``NewAttempt.args_text``), which the commit and the inline claim take instead of
    encoding them again. In every tick of every unit test, that text is exactly what encoding
    the attempt's arguments gives."""
    real = engine_tick._finish

    def checked(t: TickContext) -> TickPayload:
        payload = real(t)
        for a in payload.new_attempts:
            if a.args_text is not None:
                assert a.args_text == blobs._ENCODER.encode(a.args), a.token
        return payload

    monkeypatch.setattr(engine_tick, "_finish", checked)
    yield
