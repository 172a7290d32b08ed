"""Issue 11, "bad input by the thousand": forged and truncated messages put straight on the
queues, consumed by real ``celery worker`` processes while real runs are in flight.

The broker is a hint channel (DESIGN.md section 1): whatever lands on ``ductor-steps`` or
``ductor-coord`` must never change run state on its own. A step message is worth only the
attempt its token names (claimed by token, for that step); a tick is worth only a re-read of
the run it names. So every message below must be logged and dropped: no attempt claimed or
created, no run, transition, signal, control, timer, lease or outbox row written, and the
workers keep consuming, which the runs in flight prove by finishing correctly afterwards.

``test_forged_messages_are_logged_and_dropped_and_change_nothing`` covers what the workers
survive today; ``test_a_malformed_task_envelope_neither_kills_nor_wedges_the_worker`` the
envelopes that kill (or wedge) a Celery 5.7 worker before any task code runs (a Celery bug
ductor guards its queues against: runtime/poison.py).
"""

from __future__ import annotations

import json
import pickle
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from brokers import is_amqp, queue_length

from ductor_celery import NodeStatus, RunStatus

pytestmark = [pytest.mark.e2e, pytest.mark.broker_core]

STEPS = "ductor-steps"
COORD = "ductor-coord"
EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}

#: Every ductor table, and how to order its rows for a snapshot.
TABLES = {
    "eec_workflow_definition": "spec_hash",
    "eec_workflow_run": "run_id",
    "eec_workflow_step_attempt": "token",
    "eec_workflow_transition": "run_id, seq",
    "eec_workflow_history": "run_id, seq",
    "eec_workflow_signal": "id",
    "eec_workflow_control": "id",
    "eec_workflow_outbox": "id",
    "eec_workflow_timer": "run_id",
    "eec_concurrency_lease": "key, slot",
    "eec_workflow_wake": "run_id",
}


def headers(task: Any, task_id: str | None = None, **extra: Any) -> dict[str, Any]:
    """Celery's protocol-2 headers, as ``send_task`` writes them."""
    tid = task_id or f"forged-{uuid.uuid4().hex[:12]}"
    found = {
        "lang": "py",
        "task": task,
        "id": tid,
        "shadow": None,
        "eta": None,
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": tid,
        "parent_id": None,
        "argsrepr": "forged",
        "kwargsrepr": "{}",
        "origin": "forger@test",
        "ignore_result": True,
    }
    found.update(extra)
    return found


def body(args: Any, kwargs: Any = None) -> str:
    return json.dumps([args, kwargs or {}, EMBED])


class Forger:
    """Puts messages straight on a queue: through ``send_task`` (a well-formed envelope with
    bad arguments) or through kombu's producer (any body, content type and headers)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.conn = app.connection_for_write()
        self.producer = self.conn.Producer()
        #: (queue, task id, what was sent, the outcomes allowed) of each ``task`` message.
        self.tasks: list[tuple[str, str, str, frozenset[str]]] = []

    def task(
        self, queue: str, name: str, args: Any = None, kwargs: Any = None, *, expect: str
    ) -> None:
        """``expect``: what the task must come to, "|"-separated: a result ductor's task
        returned ("duplicate", "wrong-step", "missing", "noop"), or "raised" (it refused its
        arguments with an exception: nothing claimed, nothing run)."""
        task_id = f"forged-{uuid.uuid4().hex[:12]}"
        self.app.send_task(
            name,
            args=args,
            kwargs=kwargs,
            queue=queue,
            task_id=task_id,
            producer=self.producer,
            serializer="json",
        )
        what = f"{name}{args!r:.60}{kwargs!r:.40}"
        self.tasks.append((queue, task_id, what, frozenset(expect.split("|"))))

    def raw(
        self,
        queue: str,
        payload: str | bytes,
        *,
        content_type: str = "application/json",
        hdrs: dict[str, Any] | None = None,
    ) -> None:
        self.producer.publish(
            payload,
            exchange="",  # the default exchange: straight to the queue named by the key
            routing_key=queue,
            content_type=content_type,
            content_encoding="binary" if isinstance(payload, bytes) else "utf-8",
            headers=hdrs,
            serializer=None,
        )

    def close(self) -> None:
        self.conn.release()


def snapshot(engine: sa.Engine, skip_runs: set[str]) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every ``eec_`` table, except those of runs allowed to move meanwhile."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    with engine.connect() as conn:
        for table, order in TABLES.items():
            rows = conn.execute(sa.text(f"SELECT * FROM {table} ORDER BY {order}")).mappings()
            out[table] = [
                tuple(sorted((k, json.dumps(v, sort_keys=True, default=str)) for k, v in r.items()))
                for r in rows
                if r.get("run_id") not in skip_runs
            ]
    return out


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def node_status(ductor: Any, run_id: str, node: str) -> NodeStatus:
    return ductor.get(run_id).nodes[node].status


def token_of(cluster: Any, run_id: str, node: str) -> str:
    [row] = [a for a in cluster.attempts(run_id) if a.node == node]
    return str(row.token)


def sentinel(forger: Forger, worker: Any, queue: str) -> None:
    """A well-formed no-op message behind everything forged: once a worker has finished it,
    every message queued before it was taken (the queues are FIFO; prefetch 1)."""
    task_id = f"sentinel-{uuid.uuid4().hex[:12]}"
    if queue == STEPS:
        forger.app.send_task(
            "e2e.echo",
            args=[f"no-such-{task_id}"],
            queue=queue,
            task_id=task_id,
            producer=forger.producer,
        )
    else:
        forger.app.send_task(
            "ductor.tick",
            args=[f"no-such-{task_id}"],
            queue=queue,
            task_id=task_id,
            producer=forger.producer,
        )
    wait_for(
        lambda: f"[{task_id}] succeeded" in worker.log_path.read_text(),
        60,
        f"the sentinel on {queue}:\n{worker.log_tail()}",
    )


def outcome(log: str, task_id: str) -> str:
    """What a worker's log says became of one task message: the task's return value, "raised",
    "unregistered" (refused before any code ran), or "unseen"."""
    for record in re.split(r"\n(?=\[\d{4}-)", log):  # one log record, tracebacks included
        if task_id not in record:
            continue
        found = re.search(rf"\[{task_id}\] succeeded in [0-9.e-]+s: '([a-z-]+)'", record)
        if found:
            return found.group(1)
        if f"[{task_id}] raised unexpected" in record:
            return "raised"
        if "Received unregistered task of type" in record:
            return "unregistered"
    return "unseen"


def queues_empty(broker_url: str) -> bool:
    return queue_length(broker_url, STEPS) == 0 and queue_length(broker_url, COORD) == 0


def test_forged_messages_are_logged_and_dropped_and_change_nothing(
    cluster_factory: Any, client_for: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The slow step must outlast the barrage: its timeout is in the definition the client
    # stores, so the client's process reads it too.
    monkeypatch.setenv("E2E_SLOW_TIMEOUT", "60")
    cluster = cluster_factory(E2E_SLOW_TIMEOUT="60")
    steps = cluster.start_steps(concurrency=2)
    coord = cluster.start_coordinator()
    ductor = client_for(cluster)
    import e2e_app

    # -- runs in every position a forged message could aim at ---------------------------------
    done = ductor.wait(ductor.start("diamond", input={"x": 1}).run_id, timeout=60)
    assert done.status == RunStatus.SUCCEEDED, cluster.logs()
    waiting = ductor.start("signals", workflow_id="forged-signals")  # parks on a signal
    running = ductor.start("slow", input={"seconds": 8})  # a step in flight throughout
    wait_for(
        lambda: node_status(ductor, waiting.run_id, "paid") == NodeStatus.WAITING,
        60,
        "the signal wait",
    )
    wait_for(
        lambda: any(a.claimed_at for a in cluster.attempts(running.run_id)),
        60,
        "the slow step's claim",
    )
    first = token_of(cluster, waiting.run_id, "first")  # e2e.echo, finished
    slow = token_of(cluster, running.run_id, "slow")  # e2e.slow, claimed and running
    join = token_of(cluster, done.run_id, "join")  # e2e.collect, finished
    start = token_of(cluster, done.run_id, "start")  # e2e.add, finished
    # The slow run moves on its own meanwhile (its step finishes): compared apart, below.
    before = snapshot(cluster.engine, skip_runs={running.run_id})

    forger = Forger(e2e_app.app)
    try:
        # -- step messages: well-formed envelopes, bad arguments -------------------------------
        # What they may come to: ductor's own "nothing to claim" answers, "malformed" for a
        # token no token column holds (checked before any query), or the task's refusal of a
        # wrong signature.
        refused = "malformed"
        for args, kwargs, expect in [
            (["no-such-token"], None, "duplicate"),  # a token that does not exist
            ([f"{waiting.run_id}:first:2"], None, "duplicate"),  # plausible, never issued
            ([first], None, "duplicate"),  # a duplicate of a finished attempt
            (None, {"token": first}, "duplicate"),  # the same, by keyword
            ([5], None, refused),  # args of the wrong type
            ([None], None, refused),
            ([["a", "list"]], None, refused),
            ([{"token": first}], None, refused),
            ([True], None, refused),
            ([1.5], None, refused),
            (["a\x00b"], None, refused),  # NUL: no PostgreSQL text holds it
            (["\ud800"], None, refused),  # a lone surrogate
            (["x" * 100_000], None, refused),  # far longer than the token column
            ([], None, "raised"),  # missing token
            ([first, "extra"], None, "raised"),  # one argument too many
            (None, {"token": "no-such-token", "bogus": 1}, "raised"),  # an unknown keyword
        ]:
            forger.task(STEPS, "e2e.echo", args, kwargs, expect=expect)
        # a duplicate of the running attempt, and tokens of other steps' attempts
        forger.task(STEPS, "e2e.slow", [slow], expect="duplicate")
        forger.task(STEPS, "e2e.echo", [slow], expect="wrong-step")
        forger.task(STEPS, "e2e.add", [first], expect="wrong-step")
        forger.task(STEPS, "e2e.mul", [join], expect="wrong-step")
        forger.task(STEPS, "e2e.collect", [start], expect="wrong-step")
        forger.task(STEPS, "ductor.tick", ["no-such-run"], expect="missing")  # on steps
        forger.task(STEPS, "e2e.no_such_step", ["no-such-token"], expect="unregistered")

        # -- tick messages: well-formed envelopes, bad arguments -------------------------------
        refused = "malformed"
        for args, kwargs, expect in [
            ([], None, "raised"),  # missing run id
            ([5], None, refused),  # run ids that are no string
            ([None], None, refused),
            ([["a", "list"]], None, refused),
            ([{"run_id": waiting.run_id}], None, refused),
            ([True], None, refused),
            (["no-such-run"], None, "missing"),  # an unknown run
            (["forged-signals"], None, "missing"),  # a workflow id, not a run id
            (["a\x00b"], None, refused),
            (["\ud800"], None, refused),
            (["r" * 100_000], None, refused),
            ([done.run_id], None, "noop"),  # a finished run
            ([waiting.run_id], None, "noop"),  # a parked run: a redundant wake-up
            ([waiting.run_id, "extra"], None, "raised"),
            (None, {"run_id": "no-such-run", "bogus": 1}, "raised"),
        ]:
            forger.task(COORD, "ductor.tick", args, kwargs, expect=expect)
        forger.task(COORD, "e2e.echo", [first], expect="duplicate")  # a step on the coordinator
        forger.task(COORD, "ductor.no_such_task", ["x"], expect="unregistered")

        # -- broken bodies, content types and headers, on both queues -------------------------
        for queue, task, args in [
            (STEPS, "e2e.echo", [first]),
            (COORD, "ductor.tick", [done.run_id]),
        ]:
            good = body(args)
            forger.raw(queue, "{not json", hdrs=headers(task))  # garbage JSON
            forger.raw(queue, good[: len(good) // 2], hdrs=headers(task))  # truncated JSON
            forger.raw(queue, good[:1], hdrs=headers(task))
            forger.raw(
                queue, b'["\xff\xfe"]', content_type="application/json", hdrs=headers(task)
            )  # not UTF-8
            forger.raw(queue, "[" * 5000 + "]" * 5000, hdrs=headers(task))  # nested 5000 deep
            forger.raw(
                queue,
                pickle.dumps([args, {}, EMBED]),
                content_type="application/x-python-serialize",
                hdrs=headers(task),
            )
            forger.raw(queue, good, content_type="application/x-yaml", hdrs=headers(task))
            forger.raw(queue, good, content_type="text/plain", hdrs=headers(task))
            forger.raw(queue, good, hdrs=None)  # no headers at all
            forger.raw(queue, good, hdrs={})
            forger.raw(queue, good, hdrs=headers("no.such.task"))
            forger.raw(queue, good, hdrs=headers(5))  # a task name that is no string
            forger.raw(queue, good, hdrs=headers(task, id=5))  # a task id that is no string
            forger.raw(queue, good, hdrs=headers(task, retries="many"))
            forger.raw(queue, good, hdrs=headers(task, eta="not a date"))
            forger.raw(queue, good, hdrs=headers(task, expires="not a date"))
            forger.raw(queue, good, hdrs=headers(task, expires="2000-01-01T00:00:00+00:00"))
            forger.raw(queue, json.dumps([5, 6, 7]), hdrs=headers(task))  # args/kwargs/embed
            forger.raw(queue, json.dumps([args, 5, 7]), hdrs=headers(task))
            forger.raw(queue, json.dumps([args, {}, 7]), hdrs=headers(task))
            # protocol 1 bodies (no task header): a good one for a token or run that changes
            # nothing, and broken ones
            forger.raw(
                queue,
                json.dumps({"task": task, "id": "v1-ok", "args": args, "kwargs": {}}),
                hdrs={},
            )
            forger.raw(
                queue, json.dumps({"task": task, "id": "v1-bad", "args": 5, "kwargs": 6}), hdrs={}
            )
            forger.raw(queue, json.dumps({"task": task, "args": args}), hdrs={})
            forger.raw(queue, json.dumps({"args": 5}), hdrs=headers(task))

        sentinel(forger, steps, STEPS)
        sentinel(forger, coord, COORD)
        wait_for(lambda: queues_empty(cluster.broker_url), 30, "empty queues")

        def logs() -> dict[str, str]:
            return {
                STEPS: steps.log_path.read_text(errors="replace"),
                COORD: coord.log_path.read_text(errors="replace"),
            }

        # The step worker has two processes: the last forged task may end after the sentinel.
        wait_for(
            lambda: all(outcome(logs()[q], t) != "unseen" for q, t, _, _ in forger.tasks),
            30,
            "every forged task's outcome in the logs",
        )
    finally:
        forger.close()

    # -- the workers logged and dropped each one, and are still the same processes -----------
    for worker in (steps, coord):
        assert worker.proc.poll() is None, f"{worker.name} died:\n{worker.log_tail()}"
        log = worker.log_path.read_text(errors="replace")
        assert "Unrecoverable error" not in log, worker.log_tail(200)
        assert "Connection to broker lost" not in log, worker.log_tail(200)
    steps_log = steps.log_path.read_text(errors="replace")
    coord_log = coord.log_path.read_text(errors="replace")
    for queue, task_id, what, allowed in forger.tasks:
        got = outcome(steps_log if queue == STEPS else coord_log, task_id)
        assert got in allowed, f"{what} on {queue}: {got}, expected one of {sorted(allowed)}"
    for needle in (
        "already claimed or closed; message ignored",  # unknown and duplicate tokens
        f"attempt {slow} belongs to step 'e2e.slow' but came in a message for task 'e2e.echo'",
        f"attempt {first} belongs to step 'e2e.echo' but came in a message for task 'e2e.add'",
        "Received unregistered task of type 'e2e.no_such_step'",
        "Refusing to deserialize untrusted content of type pickle",
        "Can't decode message body",
        "Received and deleted unknown message",
        "raised unexpected",  # a task that refused its arguments (a wrong signature)
        "step message with a token that is not a string (int) dropped",
        "step message with a token that holds a NUL or a lone surrogate dropped",
    ):
        assert needle in steps_log, f"{needle!r} not in the step worker's log"
    for needle in (
        "tick for unknown run no-such-run ignored",
        "tick for unknown run forged-signals ignored",
        "Received unregistered task of type 'ductor.no_such_task'",
        "Refusing to deserialize untrusted content of type pickle",
        "Can't decode message body",
        "raised unexpected",
        "tick message with a run id that has 100000 characters (1 to 64) dropped",
    ):
        assert needle in coord_log, f"{needle!r} not in the coordinator's log"

    # -- nothing in the database changed because of them --------------------------------------
    after = snapshot(cluster.engine, skip_runs={running.run_id})
    for table in TABLES:
        assert after[table] == before[table], f"{table} changed:\n{before[table]}\n{after[table]}"
    assert after["eec_workflow_outbox"] == []
    slow_attempts = cluster.attempts(running.run_id)
    assert [a.token for a in slow_attempts] == [slow]  # no second attempt of the running step

    # -- and the runs in flight finish, each step executed once -------------------------------
    ductor.signal("forged-signals", "payment", {"amount": 7})
    view = ductor.wait(waiting.run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED, cluster.logs()
    assert view.output == {"amount": 7}
    assert cluster.executions(waiting.run_id, "first") == 1
    assert cluster.executions(waiting.run_id, "after_paid") == 1
    slow_view = ductor.wait(running.run_id, timeout=60)
    assert slow_view.status == RunStatus.SUCCEEDED, cluster.logs()
    assert slow_view.output == "slept on attempt 1"
    assert cluster.executions(running.run_id, "slow") == 1
    assert cluster.executions(done.run_id) == 4  # start, left, right, join (extra skipped)
    for run_id in (waiting.run_id, running.run_id, done.run_id):
        attempts = cluster.attempts(run_id)
        assert all(a.finished_at is not None and a.folded for a in attempts), attempts
    wait_for(
        lambda: snapshot(cluster.engine, set())["eec_workflow_outbox"] == [],
        10,
        "the outbox to empty",
    )


def envelopes_that_kill_celery(task: str) -> list[tuple[str, str | bytes, str, Any]]:
    """(what, body, content type, headers): task messages for one of ductor's own tasks that a
    Celery 5.7 / kombu 5.7 worker does not survive (each found by hand)."""
    good = body(["no-such-token"])
    return [
        # Request.__init__ unpacks the body into (args, kwargs, embed): ValueError
        ("a JSON string body", json.dumps("x"), "application/json", headers(task)),
        ("a JSON object body", json.dumps({"a": 1}), "application/json", headers(task)),
        ("a one-element list body", json.dumps([["t"]]), "application/json", headers(task)),
        # the strategy's `'args' in message.payload`: TypeError
        ("a null body", json.dumps(None), "application/json", headers(task)),
        ("an empty body", "", "application/json", headers(task)),
        ("a raw binary body", b"\xff\xfe\x00", "application/data", headers(task)),
        # Request.execute_using_pool unpacks the time limits: ValueError
        ("a timelimit that is no pair", good, "application/json", headers(task, timelimit="x")),
        # the consumer's strategies[type_] lookup, outside any task: TypeError
        ("a task name that is a list", good, "application/json", headers([task])),
        # KeyError('id') is one of the Redis transport's connection errors: the consumer
        # "reconnects", the message comes back, and it never consumes anything else again
        ("headers without an id", good, "application/json", {"task": task}),
    ]


def consumes_still(forger: Forger, worker: Any, queue: str, after: str) -> None:
    """A sentinel behind the message just sent is taken, and the worker never left its loop."""
    task_id = f"sentinel-{uuid.uuid4().hex[:12]}"
    name, arg = ("e2e.echo", "no-such-token") if queue == STEPS else ("ductor.tick", "no-such-run")
    forger.app.send_task(name, args=[arg], queue=queue, task_id=task_id, producer=forger.producer)
    deadline = time.monotonic() + 30
    while f"[{task_id}] succeeded" not in worker.log_path.read_text(errors="replace"):
        log = worker.log_path.read_text(errors="replace")
        assert worker.proc.poll() is None, f"{after} on {queue} killed the worker"
        assert "Unrecoverable error" not in log, f"{after} on {queue} stopped the worker"
        assert "Connection to broker lost" not in log, f"{after} on {queue} wedged the worker"
        assert time.monotonic() < deadline, f"{after} on {queue}: the worker took nothing after it"
        time.sleep(0.1)


def test_a_malformed_task_envelope_neither_kills_nor_wedges_the_worker(
    cluster_factory: Any, client_for: Any
) -> None:
    """One message on a queue must not stop the queue. Each envelope below, sent as one of
    ductor's tasks, escapes Celery's per-message error handling (``on_task_received`` and the
    default strategy catch only decode and invalid-task errors) into the event loop: the worker
    logs ``Unrecoverable error`` and exits, and the message, never acknowledged, is restored to
    the queue, so a restarted worker (a supervisor's) takes it and dies again: one bad message
    stops every step worker, or the coordinator, for good. Headers without an ``id`` wedge it
    instead: KeyError is one of kombu's Redis connection errors, so the consumer reconnects,
    gets the message back, and loops.

    The guard is ``ductor_celery/runtime/poison.py``: a consumer bootstep, registered by the
    Runtime beside the sweeper's, that wraps the consumer's ``create_task_handler`` so each
    message of ductor's queues is checked before Celery's handler sees it (headers a mapping
    with a ``str`` task name and id, a ``timelimit`` pair, a protocol-2 body that decodes to an
    [args, kwargs, embed] triple) and any exception of that handler other than a genuine
    connection error, KeyError included, is caught; a malformed message is logged and rejected
    without requeue.
    """
    cluster = cluster_factory()
    steps = cluster.start_steps(concurrency=1)
    coord = cluster.start_coordinator()
    ductor = client_for(cluster)
    import e2e_app

    forger = Forger(e2e_app.app)
    try:
        before = snapshot(cluster.engine, set())
        for queue, task, worker in ((STEPS, "e2e.echo", steps), (COORD, "ductor.tick", coord)):
            for what, payload, content_type, hdrs in envelopes_that_kill_celery(task):
                forger.raw(queue, payload, content_type=content_type, hdrs=hdrs)
                consumes_still(forger, worker, queue, what)
        assert snapshot(cluster.engine, set()) == before
        view = ductor.wait(ductor.start("diamond", input={"x": 1}).run_id, timeout=60)
        assert view.status == RunStatus.SUCCEEDED, cluster.logs()
    finally:
        forger.close()
        # A worker that died (or stops now) restored the message to its queue, and later tests
        # of this session may get this Redis database again (a RabbitMQ vhost is never reused).
        for worker in cluster.workers:
            worker.stop()
        if not is_amqp(cluster.broker_url):
            r = redis.Redis.from_url(cluster.broker_url)
            r.flushdb()
            r.close()
