"""The Celery app the end-to-end tests run in real ``celery worker`` processes.

Configured from the environment (DUCTOR_DATABASE_URL, E2E_BROKER_URL) so each test module can
point workers at its own database. Steps record each execution in a ledger table of their own
(outside ductor's tables) so tests can count effects independently of ductor's bookkeeping.
"""

from __future__ import annotations

import os
import time
from typing import Any

import sqlalchemy as sa
from celery import Celery

from ductor_celery import Ductor, NonRetryableError, RetryPolicy, StepContext, Workflow
from ductor_celery.runtime import inline

app = Celery("e2e")
app.conf.update(
    broker_url=os.environ.get("E2E_BROKER_URL", "memory://"),
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    ductor_sweep_interval=float(os.environ.get("E2E_SWEEP_INTERVAL", "0.5")),
    ductor_resend_unclaimed_after=float(os.environ.get("E2E_RESEND_AFTER", "30")),
    # Fault tests run with eager ticks on and off (E2E_EAGER=1/0); the default is ductor's.
    ductor_eager_ticks=os.environ.get("E2E_EAGER", "1"),
    ductor_inline_steps=os.environ.get("E2E_INLINE", "50"),
    # Metrics tests give each worker its own port; unset: no metrics (the default).
    ductor_metrics_port=os.environ.get("E2E_METRICS_PORT") or None,
    ductor_metrics_host="127.0.0.1",
)
ductor = Ductor(app)

LEDGER = sa.table(
    "e2e_ledger",
    sa.column("run_id", sa.String),
    sa.column("node", sa.String),
    sa.column("attempt", sa.Integer),
)


def _ledger(ctx: StepContext) -> int:
    """Record this execution; return how many executions of this node came before it."""
    engine = ductor.runtime.engine()
    with engine.begin() as conn:
        conn.execute(
            sa.insert(LEDGER).values(run_id=ctx.run_id, node=ctx.node, attempt=ctx.attempt)
        )
        return (
            int(
                conn.execute(
                    sa.select(sa.func.count())
                    .select_from(LEDGER)
                    .where(LEDGER.c.run_id == ctx.run_id, LEDGER.c.node == ctx.node)
                ).scalar_one()
            )
            - 1
        )


@ductor.step(name="e2e.add")
def add(ctx: StepContext, a: int, b: int) -> int:
    _ledger(ctx)
    return a + b


@ductor.step(name="e2e.mul")
def mul(ctx: StepContext, a: int, b: int) -> int:
    _ledger(ctx)
    return a * b


@ductor.step(name="e2e.collect")
def collect(ctx: StepContext, **values: Any) -> dict[str, Any]:
    _ledger(ctx)
    ctx.patch({"collected": sorted(values)})
    return values


@ductor.step(name="e2e.flaky", retry=RetryPolicy(max_attempts=5, initial_interval=0.2, backoff=1.0))
def flaky(ctx: StepContext, fail_times: int) -> dict[str, int]:
    before = _ledger(ctx)
    if before < fail_times:
        raise RuntimeError(f"flaky failure #{before + 1}")
    return {"succeeded_on": ctx.attempt}


@ductor.step(name="e2e.boom", retry=RetryPolicy(max_attempts=2, initial_interval=0.1))
def boom(ctx: StepContext) -> None:
    _ledger(ctx)
    raise ValueError("boom: this step always fails")


@ductor.step(name="e2e.fatal")
def fatal(ctx: StepContext) -> None:
    _ledger(ctx)
    raise NonRetryableError("fatal: do not retry")


@ductor.step(name="e2e.unserializable")
def unserializable(ctx: StepContext) -> Any:
    _ledger(ctx)
    return {"when": object()}


@ductor.step(name="e2e.slow", timeout=float(os.environ.get("E2E_SLOW_TIMEOUT", "4")))
def slow(ctx: StepContext, seconds: float) -> str:
    _ledger(ctx)
    marker = os.environ.get("E2E_SLOW_MARKER")
    if marker and ctx.attempt == 1:
        with open(marker, "w") as fh:
            fh.write(str(os.getpid()))
    time.sleep(seconds if ctx.attempt == 1 else 0.05)
    return f"slept on attempt {ctx.attempt}"


@ductor.step(name="e2e.big")
def big(ctx: StepContext, size: int) -> str:
    _ledger(ctx)
    return "x" * size


@ductor.step(name="e2e.measure")
def measure(ctx: StepContext, text: str) -> dict[str, Any]:
    _ledger(ctx)
    return {"length": len(text), "all_x": text == "x" * len(text)}


@ductor.step(name="e2e.echo", timeout=float(os.environ.get("E2E_ECHO_TIMEOUT", "300")))
def echo(ctx: StepContext, value: Any = None) -> Any:
    _ledger(ctx)
    return value


diamond = Workflow("diamond", version=1)
diamond.step("start", add, args={"a": "$.input.x", "b": 1})
diamond.step("left", mul, after=["start"], args={"a": "$.nodes.start.output", "b": 2})
diamond.step("right", mul, after=["start"], args={"a": "$.nodes.start.output", "b": 3})
diamond.step("extra", add, after=["start"], args={"a": 100, "b": 1}, when="$.input.extra")
diamond.step(
    "join",
    collect,
    after=["left", "right", "extra"],
    args={"left": "$.nodes.left.output", "right": "$.nodes.right.output"},
)
diamond.output({"join": "$.nodes.join.output", "start": "$.nodes.start.output"})
ductor.register(diamond)

flaky_wf = Workflow("flaky")
flaky_wf.step("flaky", flaky, args={"fail_times": "$.input.fail_times"})
flaky_wf.output("$.nodes.flaky.output")
ductor.register(flaky_wf)

failing = Workflow("failing")
failing.step("first", echo, args={"value": 1})
failing.step("boom", boom, after=["first"])
failing.step("never", echo, after=["boom"])
ductor.register(failing)

fatal_wf = Workflow("fatal")
fatal_wf.step("fatal", fatal)
ductor.register(fatal_wf)

bad_result = Workflow("bad_result")
bad_result.step("bad", unserializable)
ductor.register(bad_result)

big_wf = Workflow("big")
big_wf.step("big", big, args={"size": "$.input.size"})
big_wf.output("$.nodes.big.output")
ductor.register(big_wf)

# Large values by reference (docs/large-values.md): a multi-MiB result, read by the next step.
big_two = Workflow("big_two")
big_two.step("big", big, args={"size": "$.input.size"})
big_two.step("measure", measure, after=["big"], args={"text": "$.nodes.big.output"})
big_two.output("$.nodes.measure.output")
ductor.register(big_two)

# A batched scatter whose items' results are large: the batch's list holds references.
big_batch = Workflow("big_batch")
big_batch.scatter("each", big, over="$.input.sizes", item_arg="size", batch_size=2, max_parallel=2)
big_batch.output("$.nodes.each.output")
ductor.register(big_batch)

slow_wf = Workflow("slow")
slow_wf.step("slow", slow, args={"seconds": "$.input.seconds"})
slow_wf.output("$.nodes.slow.output")
ductor.register(slow_wf)

chain10 = Workflow("chain10")
chain10.step("s0", echo, args={"value": "$.input.value"})
for i in range(1, 10):
    chain10.step(f"s{i}", echo, after=[f"s{i - 1}"], args={"value": f"$.nodes.s{i - 1}.output"})
chain10.output("$.nodes.s9.output")
ductor.register(chain10)

# -- external input and controls ------------------------------------------------------------

ledger_signals = Workflow("signals")
ledger_signals.step("first", echo, args={"value": 1})
ledger_signals.wait_signal("paid", signal="payment", after=["first"])
ledger_signals.step("after_paid", echo, after=["paid"], args={"value": "$.nodes.paid.output"})
ledger_signals.output("$.nodes.after_paid.output")
ductor.register(ledger_signals)

napper = Workflow("napper")
napper.sleep("nap", seconds=float(os.environ.get("E2E_NAP_SECONDS", "2")))
napper.step("woke", echo, after=["nap"], args={"value": "woke"})
napper.output("$.nodes.woke.output")
ductor.register(napper)

approvals = Workflow("approvals")
approvals.approval("review", timeout=60)
approvals.event_set("kyc", events=["id_ok", "address_ok"], mode="all", after=["review"])
approvals.output({"review": "$.nodes.review.output", "kyc": "$.nodes.kyc.output"})
ductor.register(approvals)


@ductor.step(name="e2e.collect_signals")
def collect_signals(ctx: StepContext, count: int) -> int:
    _ledger(ctx)
    return count


counter = Workflow("counter")
for i in range(80):
    counter.wait_signal(f"s{i}", signal="tick", after=[f"s{i - 1}"] if i else [])
counter.output([f"$.nodes.s{i}.output" for i in range(80)])
ductor.register(counter)

long_steps = Workflow("long_steps")
long_steps.step("slow_a", slow, args={"seconds": "$.input.seconds"})
long_steps.step("slow_b", slow, args={"seconds": "$.input.seconds"})
long_steps.step("after", echo, after=["slow_a", "slow_b"], args={"value": 1})
ductor.register(long_steps)


@ductor.step(
    name="e2e.beating",
    heartbeat_timeout=1.5,
    timeout=60.0,
    retry=RetryPolicy(max_attempts=3, initial_interval=0.1),
)
def beating(ctx: StepContext, hang: float) -> str:
    _ledger(ctx)
    ctx.heartbeat({"progress": 0.1, "attempt": ctx.attempt})
    if ctx.attempt == 1:
        time.sleep(hang)  # hangs without heartbeats: declared lost long before its timeout
    return f"done on attempt {ctx.attempt}"


heartbeats = Workflow("heartbeats")
heartbeats.step("beat", beating, args={"hang": "$.input.hang"})
heartbeats.output("$.nodes.beat.output")
ductor.register(heartbeats)


# --- cancel vs terminate, run deadlines (tests/e2e/test_cancel_terminate.py) ---------------


@ductor.step(name="e2e.patient", timeout=120.0)
def patient(ctx: StepContext, seconds: float) -> str:
    """A long step that heartbeats: a cancel reaches it through ctx.heartbeat()."""
    _ledger(ctx)
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        ctx.heartbeat({"left": until - time.monotonic()})  # raises StepCancelled on a cancel
        time.sleep(0.1)
    return "ran to the end"


@ductor.step(name="e2e.stubborn", timeout=120.0)
def stubborn(ctx: StepContext, seconds: float, marker: str) -> str:
    """A long step that never looks: only a kill (terminate, a run deadline) stops it early.
    It writes its pid to ``marker`` first, and ``marker.done`` if it ever ends."""
    _ledger(ctx)
    with open(marker, "w") as fh:
        fh.write(str(os.getpid()))
    time.sleep(seconds)
    with open(f"{marker}.done", "w") as fh:
        fh.write("ran to the end")
    return "ran to the end"


cancellable = Workflow("cancellable")
cancellable.step("work", patient, args={"seconds": "$.input.seconds"})
cancellable.step("after", echo, after=["work"], args={"value": 1})
ductor.register(cancellable)

killable = Workflow("killable")
killable.step("work", stubborn, args={"seconds": "$.input.seconds", "marker": "$.input.marker"})
killable.step("after", echo, after=["work"], args={"value": 1})
ductor.register(killable)


# Terminate reaches every running step (issue 23): a step that appends a line to a file every
# 100 ms, run on each path a step can take: inline in the first tick's message, inline after
# another step's message, a held scatter branch (tests/e2e/test_cancel_terminate.py).


def _scribble(ctx: StepContext, path: str, seconds: float, beat: bool) -> str:
    """A line to ``path`` every 100 ms for ``seconds`` (heartbeating each time with ``beat``),
    then ``<path>.done``. Its pid and the attempt's token open the file (``<path>.who``)."""
    with open(f"{path}.who", "w") as fh:
        fh.write(f"{os.getpid()} {ctx.node} {ctx.branch}")
    until = time.monotonic() + seconds
    lines = 0
    while time.monotonic() < until:
        with open(path, "a") as fh:
            fh.write(f"{os.getpid()} {ctx.node} {ctx.branch} {lines} {time.time():.3f}\n")
        lines += 1
        if beat:
            ctx.heartbeat({"lines": lines})  # raises StepCancelled once the run is closed
        time.sleep(0.1)
    with open(f"{path}.done", "w") as fh:
        fh.write("ran to the end")
    return "ran to the end"


@ductor.step(name="e2e.scribble", timeout=120.0)
def scribble(ctx: StepContext, path: str, seconds: float = 60.0, beat: bool = False) -> str:
    return _scribble(ctx, path, seconds, beat)


@ductor.step(name="e2e.scribble_item", timeout=120.0)
def scribble_item(
    ctx: StepContext, item: int, path: str, slow: int, seconds: float = 60.0, beat: bool = False
) -> Any:
    """A quick branch, except item ``slow``, which scribbles."""
    if item != slow:
        return item
    return _scribble(ctx, path, seconds, beat)


_scribbling = {"path": "$.input.path", "seconds": "$.input.seconds", "beat": "$.input.beat"}

scribble_one = Workflow("scribble_one")  # the first tick's step: inline in the start message
scribble_one.step("work", scribble, args=_scribbling)
ductor.register(scribble_one)

scribble_after = Workflow("scribble_after")  # started delayed: "first" goes as a message
scribble_after.step("first", echo, args={"value": 1})
scribble_after.step("work", scribble, after=["first"], args=_scribbling)
ductor.register(scribble_after)

scribble_scatter = Workflow("scribble_scatter")  # "first"'s tick claims item 0, holds 1-3
scribble_scatter.step("first", echo, args={"value": 1})
scribble_scatter.scatter(
    "each",
    scribble_item,
    over="$.input.items",
    args={**_scribbling, "slow": "$.input.slow"},
    max_parallel=4,
    after=["first"],
)
ductor.register(scribble_scatter)


# --- scatter/gather --------------------------------------------------------------------------


@ductor.step(name="e2e.square")
def square(ctx: StepContext, item: int, refuse: list[int] | None = None) -> int:
    _ledger(ctx)
    if refuse and item in refuse:
        raise NonRetryableError(f"item {item} refused")
    time.sleep(0.01)
    return item * item


@ductor.step(name="e2e.total")
def total(ctx: StepContext, parts: list[Any]) -> int:
    _ledger(ctx)
    return sum(p for p in parts if isinstance(p, int))


def _scatter_wf(name: str, **policy: Any) -> Workflow:
    wf = Workflow(name)
    wf.scatter(
        "squares",
        square,
        over="$.input.items",
        args={"refuse": "$.input.refuse"},
        max_parallel=10,
        **policy,
    )
    wf.step("total", total, args={"parts": "$.nodes.squares.output"}, after=["squares"])
    wf.output({"squares": "$.nodes.squares.output", "total": "$.nodes.total.output"})
    return wf


ductor.register(_scatter_wf("scatter"))
ductor.register(_scatter_wf("scatter_tolerant", tolerated_failures=2))
ductor.register(_scatter_wf("scatter_ratio", tolerated_failure_ratio=0.1))


# Held branches (runtime/inline.py): E2E_HOLD_QUICKER sets which step counts as quick, so
# that a test holds branches however busy the machine is.
if os.environ.get("E2E_HOLD_QUICKER"):
    inline.HOLD_IF_QUICKER_S = float(os.environ["E2E_HOLD_QUICKER"])


def _bump_timeout() -> float | None:
    value = os.environ.get("E2E_BUMP_TIMEOUT")
    return None if value is None else float(value)


# E2E_BUMP_TIMEOUT: a short timeout, for a test that leaves a bump claimed and never run.
@ductor.step(name="e2e.bump", timeout=_bump_timeout())
def bump(ctx: StepContext, item: int) -> int:
    _ledger(ctx)
    return item + 1


quick_scatter = Workflow("quick_scatter")
quick_scatter.scatter("each", bump, over="$.input.items", max_parallel=8)
quick_scatter.output("$.nodes.each.output")
ductor.register(quick_scatter)


# --- child runs: sub-workflows, checkpoints, child-run scatter ------------------------------

child_wf = Workflow("e2e_child")
child_wf.step("label", echo, args={"value": "$.input.id"})
child_wf.step("mark", collect, args={"label": "$.nodes.label.output"}, after=["label"])
child_wf.checkpoint("printed", after=["mark"])
child_wf.wait_signal("go", signal="go", after=["printed"])
child_wf.output({"label": "$.nodes.label.output", "go": "$.nodes.go.output"})
ductor.register(child_wf)

until_checkpoint = Workflow("e2e_until_checkpoint")
until_checkpoint.subworkflow(
    "child", workflow="e2e_child", input={"id": "$.input.id"}, until="printed"
)
until_checkpoint.step("after", echo, args={"value": "$.nodes.child.output"}, after=["child"])
until_checkpoint.output("$.nodes.after.output")
ductor.register(until_checkpoint)

for _policy in ("terminate", "cancel", "abandon"):
    _parent = Workflow(f"e2e_parent_{_policy}")
    _parent.subworkflow(
        "child", workflow="e2e_child", input={"id": "$.input.id"}, parent_close=_policy
    )
    _parent.output("$.nodes.child.output")
    ductor.register(_parent)

# A parent that goes on past its child's checkpoint and stays open (waits for "hold"): its
# child keeps running after the checkpoint, and gets the policy if the parent is cancelled,
# terminated or timed out (issue 23).
for _policy in ("terminate", "cancel", "abandon"):
    _parent = Workflow(f"e2e_cp_parent_{_policy}")
    _parent.subworkflow(
        "child",
        workflow="e2e_child",
        input={"id": "$.input.id"},
        until="printed",
        parent_close=_policy,
    )
    _parent.wait_signal("hold", signal="hold", after=["child"])
    _parent.output("$.nodes.child.output")
    ductor.register(_parent)

leaf = Workflow("e2e_leaf")
leaf.scatter("squares", square, over="$.input.items", args={"refuse": "$.input.refuse"})
leaf.output("$.nodes.squares.output")
ductor.register(leaf)

child_scatter = Workflow("e2e_child_scatter")
child_scatter.scatter(
    "kids",
    workflow="e2e_leaf",
    as_child_runs=True,
    over="$.input.groups",
    input={"items": "$.item", "refuse": "$.input.refuse"},
    max_parallel=2,
    tolerated_failures=1,
)
child_scatter.output("$.nodes.kids.output")
ductor.register(child_scatter)


# --- issue 9: a step that raises SystemExit fails its node at once --------------------------


@ductor.step(name="e2e.exits", retry=RetryPolicy(max_attempts=1))
def exits(ctx: StepContext) -> None:
    _ledger(ctx)
    raise SystemExit("the step called sys.exit")


exits_wf = Workflow("e2e_exits")
exits_wf.step("exits", exits)
ductor.register(exits_wf)


# --- issue 10: batched scatter under a SIGKILL ----------------------------------------------


@ductor.step(
    name="e2e.item_pause",
    heartbeat_timeout=2.5,
    timeout=60.0,
    retry=RetryPolicy(max_attempts=3, initial_interval=0.1),
)
def item_pause(ctx: StepContext, item: int, pause: float) -> int:
    """One item of a batch; the ledger's node is ``<node>[<item index>]``."""
    engine = ductor.runtime.engine()
    with engine.begin() as conn:
        conn.execute(
            sa.insert(LEDGER).values(
                run_id=ctx.run_id, node=f"{ctx.node}[{ctx.branch}]", attempt=ctx.attempt
            )
        )
    time.sleep(pause)  # no heartbeat of its own: the batch's checkpoints are its heartbeats
    return item * 2


batched = Workflow("e2e_batched")
batched.scatter(
    "each",
    item_pause,
    over="$.input.items",
    item_arg="item",
    args={"pause": "$.input.pause"},
    batch_size=10,
    max_parallel=2,
)
batched.output("$.nodes.each.output")
ductor.register(batched)

# -- traces (tests/e2e/test_tracing.py) --------------------------------------------------------

if os.environ.get("E2E_TRACE_FILE"):
    # Set up in the worker's main process, before the pool forks: each child exports its own
    # spans synchronously to the same file (one JSON line per span, appended).
    from tracing_export import install_file_exporter

    install_file_exporter(os.environ["E2E_TRACE_FILE"])


@ductor.step(name="e2e.traced")
def traced(ctx: StepContext, value: Any = None) -> Any:
    """Opens a span of its own: it must nest under the attempt's span."""
    from opentelemetry import trace

    with trace.get_tracer("e2e").start_as_current_span("user.work") as span:
        span.set_attribute("user.value", str(value))
    return value


traced_wf = Workflow("traced")
traced_wf.step("a", traced, args={"value": "$.input.value"})
traced_wf.step("b", echo, after=["a"], args={"value": "$.nodes.a.output"})
traced_wf.output("$.nodes.b.output")
ductor.register(traced_wf)

# -- pause on exhaustion, fix, deploy, resume (tests/e2e/test_lifecycle_versions_e2e.py) -------


@ductor.step(
    name="e2e.buggy",
    retry=RetryPolicy(max_attempts=2, initial_interval=0.1, on_exhausted="pause"),
)
def buggy(ctx: StepContext, value: int) -> int:
    """Has a bug while E2E_BUG=1 (the deploy before the fix)."""
    _ledger(ctx)
    if os.environ.get("E2E_BUG") == "1":
        raise RuntimeError("bug: off by one")
    return value + 1


deployable = Workflow("deployable")
deployable.step("a", echo, args={"value": "$.input.value"})
deployable.step("fix", buggy, after=["a"], args={"value": "$.nodes.a.output"})
deployable.step("c", echo, after=["fix"], args={"value": "$.nodes.fix.output"})
deployable.output("$.nodes.c.output")
ductor.register(deployable)

# -- versions with runs in flight (tests/e2e/test_lifecycle_versions_e2e.py) -----------------
# E2E_VERSIONED picks the deploy: "1" (the default) registers version 1 only, "2" version 2
# only, as a rolling deploy of new code would.

_deployed_version = int(os.environ.get("E2E_VERSIONED", "1"))
versioned = Workflow("versioned", version=_deployed_version)
versioned.step("a", echo, args={"value": "a"})
versioned.wait_signal("hold", signal="go", after=["a"])
versioned.step("b", echo, after=["hold"], args={"value": "b"})
if _deployed_version >= 2:
    versioned.step("c", echo, after=["b"], args={"value": "c"})
versioned.output({"version": _deployed_version})
ductor.register(versioned)

# -- database failover (tests/e2e/test_failover_e2e.py) ----------------------------------------
# These steps count their executions in a file (E2E_LEDGER_FILE), outside the database that
# fails over: with asynchronous replication a commit lost with the old primary would take a
# ledger row with it, and the count of duplicates would come out too low.


def _tally_ledger(ctx: StepContext) -> None:
    path = os.environ.get("E2E_LEDGER_FILE")
    if not path:
        return
    line = f"{ctx.run_id} {ctx.node} {ctx.branch} {ctx.attempt} {os.getpid()}\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())  # one write with O_APPEND: lines never interleave
    finally:
        os.close(fd)


@ductor.step(name="e2e.tally")
def tally(ctx: StepContext, value: int, pause: float = 0.0) -> int:
    _tally_ledger(ctx)
    time.sleep(pause)
    return value + 1


@ductor.step(name="e2e.tally_sum")
def tally_sum(ctx: StepContext, parts: list[int]) -> int:
    _tally_ledger(ctx)
    return sum(parts)


#: Steps of a failover chain: its output is its input plus this.
FAILOVER_CHAIN_STEPS = 6
failover_chain = Workflow("failover_chain")
for i in range(FAILOVER_CHAIN_STEPS):
    failover_chain.step(
        f"t{i}",
        tally,
        after=[f"t{i - 1}"] if i else [],
        args={
            "value": f"$.nodes.t{i - 1}.output" if i else "$.input.value",
            "pause": "$.input.pause",
        },
    )
failover_chain.output(f"$.nodes.t{FAILOVER_CHAIN_STEPS - 1}.output")
ductor.register(failover_chain)

failover_fan = Workflow("failover_fan")  # output: sum(item + 1 for item in items)
failover_fan.scatter(
    "each",
    tally,
    over="$.input.items",
    item_arg="value",
    args={"pause": "$.input.pause"},
    max_parallel=4,
)
failover_fan.step("sum", tally_sum, after=["each"], args={"parts": "$.nodes.each.output"})
failover_fan.output("$.nodes.sum.output")
ductor.register(failover_fan)

# -- a step on a queue of its own (tests/e2e/test_rabbitmq_e2e.py: declared like ductor's) ----


@ductor.step(name="e2e.side", queue="e2e-side")
def side(ctx: StepContext, value: Any = None) -> Any:
    _ledger(ctx)
    return value


side_queue = Workflow("side_queue")
side_queue.step("first", echo, args={"value": "$.input.value"})
side_queue.step("aside", side, after=["first"], args={"value": "$.nodes.first.output"})
side_queue.output("$.nodes.aside.output")
ductor.register(side_queue)
