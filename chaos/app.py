"""The chaos harness's Celery app: ductor, its steps (each writes the ledger) and the workflows
of the mixed workload.

Started by ``chaos/run.py`` with the production commands, from this directory::

    celery -A app worker -Q ductor-steps -c 2      # three of these
    celery -A app worker -Q ductor-coord -c 1      # two of these

and imported by the driver itself (the client side: start, signal, approve, controls, reads).
Configured from the environment: ``DUCTOR_DATABASE_URL``, ``CHAOS_BROKER_URL``,
``CHAOS_LEDGER_DSN``, ``CHAOS_MAX_TRANSITIONS`` (automatic continue-as-new threshold, low on
purpose), ``CHAOS_EAGER`` (``ductor_eager_ticks`` of this process), ``CHAOS_READY_DIR`` and
``CHAOS_WORKER_NAME`` (the worker_ready signal writes a file there, which is how the driver
knows a worker consumes).

Every step returns ``{"n": nonce, "v": value}`` and patches the run context with
``{"x:<node>:<branch>:<nonce>": attempt}``; the nonce is the ledger row of that execution
(see ``ledger.py``). Step timeouts are short (a SIGKILLed or SIGSTOPped worker's attempt is
retried within seconds), so the nemesis can make zombies.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ledger
from celery import Celery, current_task
from celery.signals import worker_ready

from ductor_celery import (
    ConcurrencyLimit,
    Ductor,
    NonRetryableError,
    RetryPolicy,
    StepContext,
    Workflow,
)

STEP_TIMEOUT = float(os.environ.get("CHAOS_STEP_TIMEOUT", "6"))
LIMIT = 2  # the concurrency limit of chaos.limited, per customer

app = Celery("chaos")
app.conf.update(
    broker_url=os.environ.get("CHAOS_BROKER_URL", "memory://"),
    broker_connection_retry_on_startup=True,
    broker_connection_retry=True,
    # Keep reconnecting through a 20 s Redis outage instead of giving up.
    broker_connection_max_retries=None,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    worker_send_task_events=False,
    task_send_sent_event=False,
    ductor_sweep_interval=0.5,
    ductor_resend_unclaimed_after=float(os.environ.get("CHAOS_RESEND_AFTER", "3")),
    ductor_default_step_timeout=STEP_TIMEOUT,
    ductor_max_transitions=int(os.environ.get("CHAOS_MAX_TRANSITIONS", "30")),
    ductor_eager_ticks=os.environ.get("CHAOS_EAGER", "1"),
)
ductor = Ductor(app)


@worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    ready_dir, name = os.environ.get("CHAOS_READY_DIR"), os.environ.get("CHAOS_WORKER_NAME")
    if ready_dir and name:
        Path(ready_dir, name).write_text(str(os.getpid()))


# --------------------------------------------------------------------------------------------
# the ledger-writing wrapper every step goes through
# --------------------------------------------------------------------------------------------


def _token(ctx: StepContext) -> str | None:
    """The attempt token this execution runs under: Celery's current task id, which is the
    attempt's token whether a message delivered it or the worker ran it inline, right after
    the step of the message (``ductor_inline_steps``: runtime/inline.py pushes the attempt's
    own request). The checker's ``claimed_once`` says so loudly if that ever stops holding."""
    try:
        request = current_task.request
        return str(request.id) if request is not None and request.id else None
    except Exception:  # noqa: BLE001 - outside a task (a direct call in a test)
        return None


def execute(
    ctx: StepContext,
    step: str,
    compute: Callable[[], Any],
    *,
    ms: float = 0.0,
    fail: Callable[[], BaseException | None] | None = None,
    lease_key: str | None = None,
    beat: bool = False,
) -> dict[str, Any]:
    """One execution: ledger row first, then the work, then the ledger's end, then return."""
    nonce = uuid.uuid4().hex
    ledger.begin(
        nonce=nonce,
        token=_token(ctx),
        run_id=ctx.run_id,
        workflow_id=ctx.workflow_id,
        node=ctx.node,
        branch=ctx.branch,
        attempt=ctx.attempt,
        step=step,
        lease_key=lease_key,
    )
    try:
        if beat:
            deadline = time.monotonic() + ms / 1000.0
            while time.monotonic() < deadline:
                ctx.heartbeat({"left_ms": int((deadline - time.monotonic()) * 1000)})
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        elif ms:
            time.sleep(ms / 1000.0)
        problem = fail() if fail is not None else None
        if problem is not None:
            raise problem
        result = {"n": nonce, "v": compute()}
    except BaseException as exc:
        ledger.end(nonce, ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
        raise
    branch = "-" if ctx.branch is None else ctx.branch
    ctx.patch({f"x:{ctx.node}:{branch}:{nonce}": ctx.attempt})
    ledger.end(nonce, ok=True, result=result)
    return result


def value_of(part: Any) -> int:
    """A step output's value (0 for a skipped node, a failed branch, anything else)."""
    if isinstance(part, dict) and isinstance(part.get("v"), int):
        return int(part["v"])
    return 0


# --------------------------------------------------------------------------------------------
# steps
# --------------------------------------------------------------------------------------------

FAST_RETRY = RetryPolicy(max_attempts=4, initial_interval=0.2, backoff=1.5, max_interval=1.0)


@ductor.step(name="chaos.work", retry=FAST_RETRY)
def work(ctx: StepContext, x: Any = 0, ms: float = 15) -> dict[str, Any]:
    base = value_of(x) if isinstance(x, dict) else x if isinstance(x, int) else 0
    return execute(ctx, "chaos.work", lambda: base + 1, ms=ms)


@ductor.step(name="chaos.join", retry=FAST_RETRY)
def join(ctx: StepContext, **parts: Any) -> dict[str, Any]:
    return execute(ctx, "chaos.join", lambda: sum(value_of(p) for p in parts.values()), ms=5)


@ductor.step(name="chaos.total", retry=FAST_RETRY)
def total(ctx: StepContext, parts: list[Any]) -> dict[str, Any]:
    return execute(ctx, "chaos.total", lambda: sum(value_of(p) for p in parts or []), ms=5)


@ductor.step(name="chaos.flaky", retry=FAST_RETRY)
def flaky(ctx: StepContext, fails: int = 1, ms: float = 10) -> dict[str, Any]:
    """Fails its first ``fails`` attempts (retryable), then succeeds."""

    def fail() -> BaseException | None:
        return RuntimeError(f"flaky attempt {ctx.attempt}") if ctx.attempt <= fails else None

    return execute(ctx, "chaos.flaky", lambda: ctx.attempt, ms=ms, fail=fail)


@ductor.step(name="chaos.fatal")
def fatal(ctx: StepContext) -> dict[str, Any]:
    return execute(ctx, "chaos.fatal", lambda: 0, fail=lambda: NonRetryableError("fatal"))


@ductor.step(
    name="chaos.bad",
    retry=RetryPolicy(max_attempts=3, initial_interval=0.1, non_retryable=(ValueError,)),
)
def bad(ctx: StepContext) -> dict[str, Any]:
    return execute(ctx, "chaos.bad", lambda: 0, fail=lambda: ValueError("bad input"))


@ductor.step(name="chaos.exhaust", retry=RetryPolicy(max_attempts=2, initial_interval=0.1))
def exhaust(ctx: StepContext) -> dict[str, Any]:
    return execute(ctx, "chaos.exhaust", lambda: 0, fail=lambda: RuntimeError("always fails"))


@ductor.step(name="chaos.gate", retry=FAST_RETRY)
def gate(ctx: StepContext, key: str) -> dict[str, Any]:
    """Succeeds once the driver opened the gate of ``key`` (before redriving the run)."""

    def fail() -> BaseException | None:
        return None if ledger.gate_open(key) else NonRetryableError(f"gate {key} is closed")

    return execute(ctx, "chaos.gate", lambda: 1, fail=fail)


@ductor.step(
    name="chaos.limited",
    retry=FAST_RETRY,
    concurrency=ConcurrencyLimit(key="$.input.customer", limit=LIMIT),
)
def limited(ctx: StepContext, customer: str, ms: float = 150) -> dict[str, Any]:
    return execute(ctx, "chaos.limited", lambda: 1, ms=ms, lease_key=f"chaos.limited|{customer}")


@ductor.step(
    name="chaos.item",
    retry=RetryPolicy(max_attempts=3, initial_interval=0.1, backoff=1.0),
)
def item(ctx: StepContext, item: dict[str, Any]) -> dict[str, Any]:
    """One scatter item: ``mode`` ok, fail (non-retryable) or flaky (fails its first try)."""
    mode = item.get("mode", "ok")

    def fail() -> BaseException | None:
        if mode == "fail":
            return NonRetryableError(f"item {item.get('i')} refused")
        if mode == "flaky" and ctx.attempt == 1:
            return RuntimeError(f"item {item.get('i')} flaked")
        return None

    return execute(
        ctx, "chaos.item", lambda: int(item.get("i", 0)) * 2, ms=item.get("ms", 10), fail=fail
    )


@ductor.step(
    name="chaos.beat",
    heartbeat_timeout=3.0,
    timeout=30.0,
    retry=RetryPolicy(max_attempts=4, initial_interval=0.1),
)
def beat(ctx: StepContext, ms: float = 600) -> dict[str, Any]:
    """Heartbeats every 0.2 s: a stopped worker is declared lost after 3 s of silence."""
    return execute(ctx, "chaos.beat", lambda: 7, ms=ms, beat=True)


# --------------------------------------------------------------------------------------------
# workflows
# --------------------------------------------------------------------------------------------

# A DAG with `when` skips, a flaky step, a non-retryable step tolerated by continue_on_failure,
# a heartbeating step, a join.
dag = Workflow("chaos_dag")
dag.step("a", work, args={"x": "$.input.x"})
dag.step("b", work, after=["a"], args={"x": "$.nodes.a.output"})
dag.step("c", work, after=["a"], args={"x": "$.nodes.a.output"}, when="$.input.do_c")
dag.step("d", flaky, after=["a"], args={"fails": "$.input.fails"})
dag.step("e", fatal, after=["a"], continue_on_failure=True)
dag.step("g", beat, after=["a"], args={"ms": 500})
dag.step(
    "j",
    join,
    after=["b", "c", "d", "e", "g"],
    args={"b": "$.nodes.b.output", "c": "$.nodes.c.output", "d": "$.nodes.d.output"},
)
dag.step("f", work, after=["j"], args={"x": "$.nodes.j.output"}, when="!$.input.skip_f")
dag.output({"j": "$.nodes.j.output", "f": "$.nodes.f.output", "a": "$.nodes.a.output"})
ductor.register(dag)

# Fails at its gate (non-retryable) until the driver opens the gate and redrives; optionally
# fails for good (retries used up, or a non-retryable ValueError).
failing = Workflow("chaos_failing")
failing.step("a", work, args={"x": 1})
failing.step("b", gate, after=["a"], args={"key": "$.input.key"})
failing.step("c", work, after=["b"], args={"x": "$.nodes.b.output"})
failing.step("d", exhaust, after=["a"], when="$.input.exhaust")
failing.step("e", bad, after=["a"], when="$.input.bad")
failing.output({"c": "$.nodes.c.output"})
ductor.register(failing)

# An inline scatter with a tolerance (fails fast past it), then a total.
scatter = Workflow("chaos_scatter")
scatter.scatter("s", item, over="$.input.items", max_parallel=4, tolerated_failures=2)
scatter.step("t", total, after=["s"], args={"parts": "$.nodes.s.output"})
scatter.output({"t": "$.nodes.t.output", "s": "$.nodes.s.output"})
ductor.register(scatter)

# A batched scatter (batch_size > 1) with a ratio tolerance.
batched = Workflow("chaos_batched")
batched.scatter(
    "s", item, over="$.input.items", max_parallel=2, batch_size=4, tolerated_failure_ratio=0.25
)
batched.step("t", total, after=["s"], args={"parts": "$.nodes.s.output"})
batched.output({"t": "$.nodes.t.output", "s": "$.nodes.s.output"})
ductor.register(batched)

# Child workflows: one with a checkpoint, one with a scatter.
child = Workflow("chaos_child")
child.step("l", work, args={"x": "$.input.id"})
child.step("m", work, after=["l"], args={"x": "$.nodes.l.output"})
child.checkpoint("cp", after=["m"])
child.step("n", work, after=["cp"], args={"x": "$.nodes.m.output"})
child.output({"l": "$.nodes.l.output", "n": "$.nodes.n.output"})
ductor.register(child)

leaf = Workflow("chaos_leaf")
leaf.scatter("s", item, over="$.input.items", max_parallel=3)
leaf.output("$.nodes.s.output")
ductor.register(leaf)

parent = Workflow("chaos_parent")
parent.subworkflow(
    "sub", workflow="chaos_child", input={"id": "$.input.id"}, until="cp", parent_close="abandon"
)
parent.step("use", join, after=["sub"], args={"cp": "$.nodes.sub.output"})
parent.scatter(
    "kids",
    workflow="chaos_leaf",
    as_child_runs=True,
    over="$.input.groups",
    input={"items": "$.item"},
    max_parallel=2,
    tolerated_failures=1,
    parent_close="cancel",
)
parent.subworkflow("full", workflow="chaos_child", input={"id": "$.input.id"})
parent.step(
    "fin",
    join,
    after=["use", "kids", "full"],
    args={"use": "$.nodes.use.output", "full": "$.nodes.full.output.n"},
)
parent.output(
    {"fin": "$.nodes.fin.output", "kids": "$.nodes.kids.output", "full": "$.nodes.full.output"}
)
ductor.register(parent)

# Signals consumed in order by a chain of waits, an event set (2 of 3, times out into
# "continue"), an approval (a rejection continues), a durable sleep.
signals = Workflow("chaos_signals")
signals.step("prep", work, args={"x": 1})
signals.wait_signal("w0", signal="tick", after=["prep"], timeout=600)
signals.wait_signal("w1", signal="tick", after=["w0"], timeout=600)
signals.wait_signal("w2", signal="tick", after=["w1"], timeout=600)
signals.event_set(
    "ev", events=["a", "b", "c"], mode=2, after=["prep"], timeout=8, on_timeout="continue"
)
signals.approval("ok", after=["w2"], timeout=600, on_reject="continue")
signals.sleep("nap", seconds=1.5, after=["ok"])
signals.step("fin", work, after=["nap", "ev"], args={"x": "$.nodes.w2.output.seq"})
signals.output(
    {
        "fin": "$.nodes.fin.output",
        "ticks": ["$.nodes.w0.output", "$.nodes.w1.output", "$.nodes.w2.output"],
        "ok": "$.nodes.ok.output",
    }
)
ductor.register(signals)

# Concurrency-limited steps: three parallel nodes on one customer key (limit 2 across runs).
lim = Workflow("chaos_limited")
lim.step("p", limited, args={"customer": "$.input.customer"})
lim.step("q", limited, args={"customer": "$.input.customer"})
lim.step("r", limited, args={"customer": "$.input.customer"})
lim.step(
    "j",
    join,
    after=["p", "q", "r"],
    args={"p": "$.nodes.p.output", "q": "$.nodes.q.output", "r": "$.nodes.r.output"},
)
lim.output("$.nodes.j.output")
ductor.register(lim)

# A long chain: passes the low ductor_max_transitions and continues as new on its own.
LONG = 16
long_chain = Workflow("chaos_long")
long_chain.step("s0", work, args={"x": "$.input.x", "ms": 5})
for _i in range(1, LONG):
    long_chain.step(
        f"s{_i}", work, after=[f"s{_i - 1}"], args={"x": f"$.nodes.s{_i - 1}.output", "ms": 5}
    )
long_chain.output(f"$.nodes.s{LONG - 1}.output")
ductor.register(long_chain)

# Two ticks at once: the step's result and the signal arrive together, the wait has no
# timeout (nothing timed while it waits alone), and the sleep that follows is longer than the
# step's first check. A tick that waited for the run's lock must still write the sleep's timer.
race = Workflow("chaos_race")
race.step("a", work, args={"x": 1, "ms": "$.input.ms"})
race.wait_signal("w", signal="go")
race.sleep("nap", seconds=4, after=["a", "w"])
race.step("b", work, after=["nap"], args={"x": "$.nodes.a.output"})
race.output("$.nodes.b.output")
ductor.register(race)

WORKFLOWS = [
    "chaos_dag",
    "chaos_failing",
    "chaos_scatter",
    "chaos_batched",
    "chaos_parent",
    "chaos_signals",
    "chaos_limited",
    "chaos_long",
    "chaos_race",
]
