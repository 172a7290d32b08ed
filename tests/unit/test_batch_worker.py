"""The step worker's batch loop (runtime/batch.py): which items it calls, what it records, when
it checkpoints, and what a retry takes over from earlier attempts."""

from __future__ import annotations

from typing import Any

from ductor_celery.runtime.batch import CHECKPOINT_EVERY_S, ItemOutcome, run_batch


def _spec(first: int, n: int, refused: tuple[int, ...] = ()) -> dict[str, Any]:
    items = [None if first + k in refused else {"x": first + k} for k in range(n)]
    return {"base": 0, "first": first, "items": items}


class _Calls:
    def __init__(self, fail: dict[int, bool] | None = None, interrupt_at: int | None = None):
        self.fail = fail or {}  # item -> retryable
        self.interrupt_at = interrupt_at
        self.called: list[int] = []

    def __call__(self, index: int, args: dict[str, Any]) -> tuple[ItemOutcome, Any]:
        self.called.append(index)
        stop = SystemExit(3) if index == self.interrupt_at else None
        if index in self.fail or stop is not None:
            error = {"type": "Boom", "message": f"item {index}"}
            return ItemOutcome(False, error=error, retryable=self.fail.get(index, True)), stop
        return ItemOutcome(True, args["x"] * 2, patch={f"p{index}": index}), None


def test_every_item_runs_once_and_the_result_is_the_list_in_order() -> None:
    calls = _Calls()
    done, interrupt = run_batch(_spec(10, 4), [], calls, lambda _p: None)
    assert interrupt is None and done.succeeded
    assert done.output == [20, 22, 24, 26]
    assert done.patch == {"p10": 10, "p11": 11, "p12": 12, "p13": 13}
    assert calls.called == [10, 11, 12, 13]


def test_a_refused_item_is_not_called_and_keeps_its_place_as_none() -> None:
    calls = _Calls()
    done, _ = run_batch(_spec(0, 3, refused=(1,)), [], calls, lambda _p: None)
    assert done.succeeded and done.output == [0, None, 4]
    assert calls.called == [0, 2]


def test_failures_are_recorded_per_item_and_the_rest_still_run() -> None:
    calls = _Calls(fail={1: True, 2: False})
    done, _ = run_batch(_spec(0, 4), [], calls, lambda _p: None)
    assert not done.succeeded and done.retryable
    assert calls.called == [0, 1, 2, 3]
    assert done.output["done"] == {"0": 0, "3": 6}
    assert done.output["failed"] == {"2": {"type": "Boom", "message": "item 2"}}
    assert set(done.error["items"]) == {"1", "2"}
    assert done.error["message"].startswith("2 of 4 items failed; item 1: Boom: item 1")
    assert done.patch == {"p0": 0, "p3": 3}  # applied if the batch gives up


def test_only_final_failures_left_means_a_retry_cannot_help() -> None:
    done, _ = run_batch(_spec(0, 2), [], _Calls(fail={0: False}), lambda _p: None)
    assert not done.succeeded and not done.retryable


def test_a_retry_runs_only_the_items_without_a_recorded_output() -> None:
    first, _ = run_batch(_spec(0, 4), [], _Calls(fail={1: True, 3: False}), lambda _p: None)
    calls = _Calls()
    second, _ = run_batch(_spec(0, 4), [first.output], calls, lambda _p: None)
    assert calls.called == [1]  # 0 and 2 have outputs, 3 failed for good
    assert not second.succeeded and not second.retryable
    assert second.output["done"] == {"0": 0, "1": 2, "2": 4}
    assert second.patch == {"p0": 0, "p1": 1, "p2": 2}


def test_a_retry_that_completes_gives_the_whole_list_with_every_patch() -> None:
    first, _ = run_batch(_spec(0, 3), [], _Calls(fail={2: True}), lambda _p: None)
    second, _ = run_batch(_spec(0, 3), [first.output], _Calls(), lambda _p: None)
    assert second.succeeded and second.output == [0, 2, 4]
    assert second.patch == {"p0": 0, "p1": 1, "p2": 2}


def test_an_interrupt_stops_the_batch_and_the_items_after_it_stay_runnable() -> None:
    calls = _Calls(interrupt_at=1)
    done, interrupt = run_batch(_spec(0, 4), [], calls, lambda _p: None)
    assert isinstance(interrupt, SystemExit)
    assert calls.called == [0, 1]
    assert not done.succeeded and done.retryable
    assert done.output["done"] == {"0": 0}


def test_progress_is_checkpointed_at_most_once_per_interval() -> None:
    now = [0.0]
    saved: list[dict[str, Any]] = []

    def call(index: int, args: dict[str, Any]) -> tuple[ItemOutcome, None]:
        now[0] += CHECKPOINT_EVERY_S / 2  # two items per interval
        return ItemOutcome(True, index), None

    done, _ = run_batch(_spec(0, 6), [], call, saved.append, clock=lambda: now[0])
    assert done.succeeded
    assert [sorted(map(int, p["done"])) for p in saved] == [[0, 1], [0, 1, 2, 3]]


def test_a_checkpoint_of_a_killed_attempt_spares_its_items_on_the_retry() -> None:
    """The checkpoint is the same mapping a failed attempt records, so a retry reads either."""
    now = [0.0]
    saved: list[dict[str, Any]] = []

    def call(index: int, args: dict[str, Any]) -> tuple[ItemOutcome, None]:
        now[0] += CHECKPOINT_EVERY_S
        return ItemOutcome(True, index), None

    run_batch(_spec(0, 2), [], call, saved.append, clock=lambda: now[0])
    calls = _Calls()
    retry, _ = run_batch(_spec(0, 4), [saved[0]], calls, lambda _p: None)
    assert calls.called == [1, 2, 3]
    assert retry.succeeded and retry.output == [0, 2, 4, 6]
