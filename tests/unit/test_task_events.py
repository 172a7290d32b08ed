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


def test_a_forked_child_leaves_its_parents_event_buffers_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A child forked while its parent holds buffered events, a publish put off on a timer,
    starts with no buffer and nothing put off: its parent's connection, lock and timer are
    not its own (``task_events._forget_after_fork``)."""
    import os

    from celery import Celery

    from ductor_celery.runtime import task_events

    monkeypatch.setattr(task_events, "PUBLISH_AT_MOST_EVERY_S", 30.0)
    app = Celery("fork_events", set_as_current=False, broker="memory://")
    app.conf.worker_send_task_events = True
    fields = {"name": "s", "args": "[]", "kwargs": "{}", "root_id": "t", "retries": 0}
    task_events._send(app, "w@h", "task-succeeded", "t1", fields)
    task_events.flush_events(app, "w@h")  # published: the next one within 30 s waits
    task_events._send(app, "w@h", "task-succeeded", "t2", fields)
    task_events.flush_events(app, "w@h", soon=True)
    buffer = task_events._local.buffer
    assert buffer.later is not None and buffer in task_events._put_off
    pid = os.fork()
    if pid == 0:  # the child: report by its exit code only
        clean = getattr(task_events._local, "buffer", None) is None and not task_events._put_off
        os._exit(0 if clean else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's is as it was, and goes out when its worker process stops.
    assert task_events._local.buffer is buffer and buffer.later is not None
    task_events.publish_put_off()
    assert buffer.later is None and not buffer.pending and buffer not in task_events._put_off
