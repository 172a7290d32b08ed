"""An inline attempt's Celery request (runtime/task_events.py)."""

from __future__ import annotations

import pytest
from celery.app.task import Context

from ductor_celery.runtime.task_events import inline_request
from ductor_celery.store.attempts import ClaimedAttempt


def _claimed(token: str) -> ClaimedAttempt:
    return ClaimedAttempt(
        token=token,
        run_id="r" * 32,
        workflow_id="w",
        node="s1",
        branch=None,
        generation=1,
        attempt=1,
        step="c.step",
        args={"value": 1},
        context={},
    )


@pytest.mark.parametrize("hostname", ["w1@host", None])
def test_the_request_is_what_celerys_own_context_makes_of_its_fields(
    hostname: str | None,
) -> None:
    """Built without ``Context.__init__`` (its search for custom headers): a Celery whose
    ``Context`` came to set more in its ``__init__`` fails here, not in a worker."""
    token = "0123456789abcdef0123456789abcdef:s1:1"
    built = inline_request("c.step", _claimed(token), hostname, "ductor-steps")
    made = Context(
        id=token,
        task="c.step",
        args=[token],
        kwargs={},
        hostname=hostname,
        delivery_info={"routing_key": "ductor-steps"},
        root_id=token,
        correlation_id=token,
        retries=0,
        called_directly=False,
    )
    assert vars(built) == vars(made)
    # As a delivered task's: not called directly; what it was not given, Celery's defaults.
    assert built.called_directly is False and built.parent_id is None and built.eta is None
    assert built.get("replaced_task_nesting", 0) == 0 and built.timelimit is None


def test_each_request_is_its_own() -> None:
    claimed = _claimed("t:s1:1")
    first = inline_request("c.step", claimed, "h", "q")
    second = inline_request("c.step", claimed, "h", "q")
    first.delivery_info["priority"] = 9
    first.args.append("more")
    assert second.delivery_info == {"routing_key": "q"} and second.args == ["t:s1:1"]
