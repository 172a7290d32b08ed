"""Issue 11, "bad input by the thousand": every control in every run state, against a real
PostgreSQL, in-process (no Celery workers: ticks and step executions are called directly, the
way tests/integration/test_bad_input_properties.py drives them).

Each example starts from a copy of one database holding a zoo of runs (``build_zoo``), one in
every status a run can be in: pending, running (an attempt dispatched, or claimed by a worker
that was lost), paused (with an attempt in flight, or waiting on an approval), waiting on an
approval, a signal, a timer or a child run, a scatter in flight, parents with each
parent-close policy and their children, succeeded, failed, cancelled, terminated, continued.

- ``test_each_control_on_a_run_in_each_status_does_what_the_contract_says``: one control on
  every zoo run (pause, resume, cancel, terminate, redrive, continue_as_new, approve, reject,
  signal): accepted exactly in the statuses API.md allows, else ``InvalidOperation`` and
  nothing written; once ticked, each run is where the control says (children where their
  parent's close policy says).
- ``test_every_control_in_every_run_state_succeeds_or_raises_a_ductor_error``: Hypothesis
  draws sequences of client calls (start, signal, approve, reject, pause, resume, cancel,
  terminate, redrive, continue_as_new, get, wait), ticks of any run, and step outcomes
  (succeeded, failed and retried, failed for good, claimed by a worker then lost, a message
  delivered again), with eager ticks on or off and an automatic continue-as-new threshold low
  or not. Every call returns or raises a ``DuctorError`` (``wait(timeout=0)`` may also run out
  of time); anything else is a bug.

After every operation of both, the stored runs are consistent (``consistent``): the status
column is the state's, the transition log's ``seq`` is 0..n-1 with n the run's transition
count, the last run-level transition ends in the run's status, no terminal run has an open
attempt. At the end every open run is terminated and the ticks drained: no outbox row,
unhandled control or open attempt is left, and the chaos harness's checker
(``chaos/checker.py``, over these tables and the ledger the steps here write the way the
harness's steps do) finds no violation of any of its invariants.

``DUCTOR_CONTROLS_EXAMPLES`` (default 45) sets the number of random examples, for a long hunt.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from ductor_celery import Ductor, DuctorError, NonRetryableError, RetryPolicy, Workflow
from ductor_celery.runtime.outbox_janitor import sent_outbox
from ductor_celery.runtime.steps import execute_attempt
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store import attempts as attempt_rows
from ductor_celery.store.db import dispose_all

ROOT = Path(__file__).resolve().parents[2]
#: Examples of the random property; raise it for a long hunt.
EXAMPLES = int(os.environ.get("DUCTOR_CONTROLS_EXAMPLES", "45"))


def _load(name: str, path: Path) -> Any:
    """A module of chaos/ by path: chaos/ is a directory of scripts, not a package, and its
    ``app.py`` and ``ledger.py`` must not shadow anything on sys.path."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


checker_module = _load("chaos_checker_for_controls", ROOT / "chaos" / "checker.py")
LEDGER_DDL: str = _load("chaos_ledger_for_controls", ROOT / "chaos" / "ledger.py").DDL


# -- the steps: they write the chaos ledger, as chaos/app.py's steps do ----------------------


@dataclass
class Execution:
    """What the next step execution is to do, set by the operation that runs it."""

    ledger: sa.Engine | None = None
    token: str | None = None
    behavior: str = "ok"


NEXT = Execution()
LEDGER_INSERT = sa.text(
    "INSERT INTO chaos_ledger (nonce, token, run_id, workflow_id, node, branch, attempt, step,"
    " pid) VALUES (:nonce, :token, :run_id, :workflow_id, :node, :branch, :attempt, :step, :pid)"
)
LEDGER_END = sa.text(
    "UPDATE chaos_ledger SET ended_at = clock_timestamp(), ok = :ok,"
    " result = CAST(:result AS jsonb), error = :error WHERE nonce = :nonce"
)


def work(ctx: Any, **_: Any) -> dict[str, Any]:
    """One execution: a ledger row first, then the behaviour asked for. A success returns
    ``{"n": nonce, "v": attempt}`` and patches ``x:<node>:<branch>:<nonce>`` (the checker's
    conventions: any value ductor accepted names the execution that produced it)."""
    assert NEXT.ledger is not None
    nonce = uuid.uuid4().hex
    with NEXT.ledger.begin() as conn:
        conn.execute(
            LEDGER_INSERT,
            {
                "nonce": nonce,
                "token": NEXT.token,
                "run_id": ctx.run_id,
                "workflow_id": ctx.workflow_id,
                "node": ctx.node,
                "branch": ctx.branch,
                "attempt": ctx.attempt,
                "step": "ctl.work",
                "pid": os.getpid(),
            },
        )
    ok = NEXT.behavior == "ok"
    result = {"n": nonce, "v": ctx.attempt}
    with NEXT.ledger.begin() as conn:
        conn.execute(
            LEDGER_END,
            {
                "ok": ok,
                "result": json.dumps(result) if ok else None,
                "error": None if ok else NEXT.behavior,
                "nonce": nonce,
            },
        )
    if NEXT.behavior == "fatal":
        raise NonRetryableError("fails for good, on purpose")
    if not ok:
        raise RuntimeError("fails on purpose (retried)")
    branch = "-" if ctx.branch is None else str(ctx.branch)
    ctx.patch({f"x:{ctx.node}:{branch}:{nonce}": ctx.attempt})
    return result


RETRY = RetryPolicy(max_attempts=2, initial_interval=0, backoff=1, max_interval=0)


def workflows(step: Any) -> list[Workflow]:
    flow = Workflow("ctl_flow")  # a step, an approval, a signal, a step
    flow.step("a", step, retry=RETRY)
    flow.approval("review", after=["a"])
    flow.wait_signal("go", signal="go", after=["review"])
    flow.step("b", step, after=["go"], retry=RETRY)
    flow.output({"a": "$.nodes.a.output", "b": "$.nodes.b.output"})

    fan = Workflow("ctl_fan")  # an inline scatter, then a join
    fan.scatter("fan", step, over="$.input.items", max_parallel=2, retry=RETRY)
    fan.step("join", step, after=["fan"], args={"parts": "$.nodes.fan.output"})
    fan.output("$.nodes.fan.output")

    nap = Workflow("ctl_nap")  # parked on a timer that never comes due here
    nap.step("first", step)
    nap.sleep("nap", seconds=3600, after=["first"])
    nap.step("woke", step, after=["nap"])

    child = Workflow("ctl_child")
    child.step("s", step, retry=RETRY)
    child.wait_signal("go", signal="go", after=["s"])
    child.output({"s": "$.nodes.s.output", "go": "$.nodes.go.output"})

    parents = []
    for policy in ("terminate", "cancel", "abandon"):
        parent = Workflow(f"ctl_parent_{policy}")
        parent.subworkflow("kid", workflow="ctl_child", input={"n": 1}, parent_close=policy)
        parent.step("after", step, after=["kid"])
        parent.output({"kid": "$.nodes.kid.output"})
        parents.append(parent)
    return [flow, fan, nap, child, *parents]


STARTABLE = [
    "ctl_flow",
    "ctl_fan",
    "ctl_nap",
    "ctl_child",
    *(f"ctl_parent_{p}" for p in ("terminate", "cancel", "abandon")),
]
INPUTS = {"ctl_fan": {"items": [1, 2, 3]}}


# -- one world: a database, a Ductor, and the runs made so far --------------------------------


@dataclass
class World:
    d: Ductor
    step: Any
    engine: sa.Engine
    woken: list[str] = field(default_factory=list)
    known: list[str] = field(default_factory=list)  # run ids, oldest first
    workflow_ids: list[str] = field(default_factory=list)

    def refresh(self) -> None:
        """Learn the runs the coordinator made (children, successors)."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    # Run ids are random: ties (one commit's children and successors) are
                    # broken by what an example decides, so a replay picks the same targets.
                    "SELECT run_id, workflow_id FROM eec_workflow_run"
                    " ORDER BY created_at, workflow_id, parent_node, run_id"
                )
            ).all()
        for run_id, workflow_id in rows:
            if run_id not in self.known:
                self.known.append(run_id)
            if workflow_id not in self.workflow_ids:
                self.workflow_ids.append(workflow_id)

    def status(self, run_id: str) -> str:
        with self.engine.connect() as conn:
            found = conn.execute(
                sa.text("SELECT status FROM eec_workflow_run WHERE run_id = :r"), {"r": run_id}
            ).scalar_one_or_none()
        return str(found) if found is not None else "missing"

    def open_runs(self) -> list[str]:
        with self.engine.connect() as conn:
            return list(
                conn.execute(
                    sa.text(
                        "SELECT run_id FROM eec_workflow_run WHERE status NOT IN"
                        " ('succeeded', 'failed', 'cancelled', 'terminated', 'continued')"
                        " ORDER BY created_at, run_id"
                    )
                ).scalars()
            )

    def attempts(self, where: str) -> list[str]:
        with self.engine.connect() as conn:
            return list(
                conn.execute(
                    sa.text(
                        # Tokens hold random run ids: order by what an example decides,
                        # so a replay executes the same attempts.
                        f"SELECT token FROM eec_workflow_step_attempt a WHERE ({where}) ORDER BY"
                        " (SELECT (r.created_at, r.workflow_id) FROM eec_workflow_run r"
                        " WHERE r.run_id = a.run_id), node, branch, generation, attempt, token"
                    )
                ).scalars()
            )

    # -- what workers and the coordinator do ---------------------------------------------------

    def tick(self, run_id: str) -> str:
        result = run_tick(self.d.runtime, run_id)
        self.refresh()
        return result

    def drain(self, passes: int = 60) -> None:
        """Deliver the wake-ups (tick each run woken) until none is left; then the sweeper's
        backstop, one tick of every open run; again, until a whole pass commits nothing."""
        for _ in range(passes):
            while self.woken:
                todo = list(dict.fromkeys(self.woken))
                self.woken.clear()
                for run_id in todo:
                    run_tick(self.d.runtime, run_id)
                self.refresh()
            results = [run_tick(self.d.runtime, run_id) for run_id in self.open_runs()]
            self.refresh()
            if "committed" not in results and not self.woken:
                sent_outbox(self.d.runtime.engine()).flush()
                return
        raise AssertionError(f"ticks did not settle in {passes} passes")

    def execute(self, token: str, behavior: str) -> str:
        NEXT.token, NEXT.behavior = token, behavior
        try:
            return execute_attempt(self.d.runtime, self.step, token, hostname="controls-test")
        finally:
            NEXT.token = None
            self.refresh()

    def lose(self, token: str) -> None:
        """A worker claims the attempt and dies: it stays open (its step timeout is a day)."""
        attempt_rows.claim(self.d.runtime.engine(), token, f"lost:{uuid.uuid4().hex[:8]}")


def make_world(url: str, *, eager: bool, max_transitions: int) -> World:
    app = Celery(f"controls{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    app.conf.ductor_eager_ticks = eager
    app.conf.ductor_inline_steps = 0  # every step here is run by the test, one at a time
    app.conf.ductor_max_transitions = max_transitions
    # Nothing here happens by the clock: an attempt nobody finishes stays open, unclaimed
    # ones are not sent again, and a sleep does not come due (examples repeat exactly).
    app.conf.ductor_default_step_timeout = 86_400
    app.conf.ductor_resend_unclaimed_after = 86_400
    # A cancel closes the zoo's attempts in flight at once (the cooperative cancel, with a
    # grace, has its own tests: test_cooperative_cancel.py).
    app.conf.ductor_cancel_grace = 0
    d = Ductor(app, database_url=url)
    step = d.step(name="ctl.work")(work)
    for wf in workflows(step):
        d.register(wf)
    engine = sa.create_engine(url, pool_size=2, max_overflow=2)
    world = World(d=d, step=step, engine=engine)
    # No broker: what would be sent is recorded, and the test delivers it (ticks, steps).
    runtime = d.runtime
    runtime.dispatcher.send = lambda rows: world.woken.extend(  # type: ignore[method-assign]
        r.run_id for r in rows if r.kind == "wakeup"
    )
    runtime.dispatcher.wake = world.woken.append  # type: ignore[method-assign]
    runtime.dispatcher.first_tick = world.woken.append  # type: ignore[method-assign]
    runtime.dispatcher.wake_many = world.woken.extend  # type: ignore[method-assign]
    NEXT.ledger = engine
    return world


def build_zoo(w: World) -> None:
    """Runs in every status a control can meet (flow: a -> review -> go -> b)."""
    d = w.d
    for wid in (
        "zoo-running",
        "zoo-claimed",
        "zoo-review",
        "zoo-signal",
        "zoo-paused",
        "zoo-succeeded",
        "zoo-failed",
        "zoo-cancelled",
        "zoo-terminated",
        "zoo-continued",
        "zoo-paused-review",
    ):
        w.tick(d.start("ctl_flow", workflow_id=wid).run_id)
    w.tick(d.start("ctl_fan", input=INPUTS["ctl_fan"], workflow_id="zoo-fan").run_id)
    w.tick(d.start("ctl_nap", workflow_id="zoo-nap").run_id)
    for policy in ("terminate", "cancel", "abandon"):
        w.tick(d.start(f"ctl_parent_{policy}", workflow_id=f"zoo-parent-{policy}").run_id)

    def attempt(wid: str) -> str:
        run_id = d.get(wid).run_id
        [token] = w.attempts(f"run_id = '{run_id}' AND finished_at IS NULL")
        return token

    w.lose(attempt("zoo-claimed"))
    for wid in (
        "zoo-review",
        "zoo-signal",
        "zoo-succeeded",
        "zoo-continued",
        "zoo-paused-review",
        "zoo-nap",
    ):
        w.execute(attempt(wid), "ok")
    w.execute(attempt("zoo-failed"), "fatal")
    w.drain()
    for wid in ("zoo-signal", "zoo-succeeded"):
        d.approve(wid, "review", by="zoo")
    d.signal("zoo-succeeded", "go", {"paid": True})
    d.pause("zoo-paused")
    d.pause("zoo-paused-review")
    d.cancel("zoo-cancelled", reason="zoo")
    d.terminate("zoo-terminated", reason="zoo")
    d.continue_as_new("zoo-continued")
    w.drain()
    w.execute(attempt("zoo-succeeded"), "ok")
    w.drain()
    d.start("ctl_flow", workflow_id="zoo-pending")  # pending: never ticked yet
    w.woken.clear()
    expected = {
        "zoo-pending": "pending",
        "zoo-running": "running",
        "zoo-claimed": "running",
        "zoo-review": "running",
        "zoo-signal": "running",
        "zoo-paused": "paused",
        "zoo-paused-review": "paused",
        "zoo-succeeded": "succeeded",
        "zoo-failed": "failed",
        "zoo-cancelled": "cancelled",
        "zoo-terminated": "terminated",
        "zoo-fan": "running",
        "zoo-nap": "running",
    }
    for wid, status in expected.items():
        assert d.get(wid).status == status, (wid, d.get(wid))
    continued = [r for r in w.known if w.status(r) == "continued"]
    assert continued, "the zoo has a continued run"
    assert d.get("zoo-review").nodes["review"].status == "waiting"
    assert d.get("zoo-signal").nodes["go"].status == "waiting"
    assert d.get("zoo-nap").nodes["nap"].status == "waiting"
    assert d.get("zoo-parent-terminate").nodes["kid"].status == "waiting"


# -- the operations ----------------------------------------------------------------------------

TARGETS = st.tuples(
    st.sampled_from(["run", "run", "run", "workflow_id", "workflow_id", "nope"]),
    st.integers(0, 200),
)
OPERATIONS = st.one_of(
    st.tuples(
        st.just("start"),
        st.sampled_from(STARTABLE),
        st.sampled_from([None, "w-1", "w-2", "zoo-running", "zoo-succeeded"]),
    ),
    st.tuples(st.just("tick"), TARGETS),
    st.tuples(st.just("drain")),
    st.tuples(st.just("step"), st.integers(0, 200), st.sampled_from(["ok", "ok", "fail", "fatal"])),
    st.tuples(st.just("lose"), st.integers(0, 200)),
    st.tuples(st.just("redeliver"), st.integers(0, 200)),
    st.tuples(
        st.just("signal"),
        TARGETS,
        st.sampled_from(["go", "other"]),
        st.sampled_from([None, "k-1", "k-2"]),
    ),
    st.tuples(
        st.sampled_from(["approve", "reject"]),
        TARGETS,
        st.sampled_from(["review", "review", "a", "nope"]),
    ),
    st.tuples(st.sampled_from(["pause", "resume", "cancel", "terminate", "redrive"]), TARGETS),
    st.tuples(
        st.just("continue_as_new"),
        TARGETS,
        st.sampled_from([None, None, {"items": [4, 5]}, {"n": 2}]),
    ),
    st.tuples(st.sampled_from(["get", "wait"]), TARGETS),
)
CONTROLS = ("pause", "resume", "cancel", "terminate", "redrive", "continue_as_new")


def target_of(w: World, target: tuple[str, int]) -> str:
    kind, index = target
    if kind == "nope" or not w.known:
        return "no-such-run"
    if kind == "workflow_id":
        return w.workflow_ids[index % len(w.workflow_ids)]
    return w.known[index % len(w.known)]


def perform(w: World, op: tuple[Any, ...]) -> str:
    """Run one operation; returns a label for the statistics."""
    d = w.d
    kind = op[0]
    if kind == "start":
        _, workflow, workflow_id = op
        d.start(workflow, input=INPUTS.get(workflow), workflow_id=workflow_id)
        w.refresh()
        return "start"
    if kind == "drain":
        w.drain()
        return "drain"
    if kind in ("step", "lose", "redeliver"):
        where = (
            "finished_at IS NULL AND claimed_at IS NULL"
            if kind != "redeliver"
            else "claimed_at IS NOT NULL OR finished_at IS NOT NULL"
        )
        tokens = w.attempts(where)
        if not tokens:
            return f"{kind}: none"
        token = tokens[op[1] % len(tokens)]
        if kind == "lose":
            w.lose(token)
            return "lose"
        result = w.execute(token, op[2] if kind == "step" else "ok")
        if kind == "redeliver":
            # A message for an attempt already claimed or closed runs nothing.
            assert result == "duplicate", result
        return f"{kind}: {result}"
    target = target_of(w, op[1])
    if target in w.known:
        status = w.status(target)
    elif target in w.workflow_ids:
        status = f"{d.get(target).status.value} (by workflow id)"
    else:
        status = "unknown"
    label = f"{kind} on {status}"
    try:
        if kind == "tick":
            return f"{label}: {w.tick(target)}"
        if kind == "signal":
            d.signal(target, op[2], {"at": kind}, idempotency_key=op[3])
        elif kind in ("approve", "reject"):
            getattr(d, kind)(target, op[2], by="prop", comment=None)
        elif kind == "continue_as_new":
            d.continue_as_new(target, input=op[2])
        elif kind in CONTROLS:
            getattr(d, kind)(target)
        elif kind == "get":
            d.get(target)
        else:
            try:
                d.wait(target, timeout=0)
            except TimeoutError:
                return f"{label}: still open"
    except DuctorError as exc:
        return f"{label}: {type(exc).__name__}"
    return f"{label}: accepted"


# -- the checks --------------------------------------------------------------------------------


def consistent(w: World) -> None:
    """What must hold between any two operations (tables as the last commit left them)."""
    with w.engine.connect() as conn:
        runs = (
            conn.execute(
                sa.text(
                    "SELECT run_id, status, state->>'status' AS state_status, transition_count,"
                    " (state->>'transitions')::int AS state_transitions FROM eec_workflow_run"
                )
            )
            .mappings()
            .all()
        )
        logs = {
            r.run_id: r
            for r in conn.execute(
                sa.text(
                    "SELECT run_id, count(*) AS n, min(seq) AS lo, max(seq) AS hi FROM"
                    " eec_workflow_history GROUP BY run_id"
                )
            )
        }
        last_run_move = dict(
            conn.execute(
                sa.text(
                    "SELECT DISTINCT ON (run_id) run_id, to_status FROM eec_workflow_history"
                    " WHERE node IS NULL ORDER BY run_id, seq DESC"
                )
            ).all()
        )
        open_on_terminal = conn.execute(
            sa.text(
                "SELECT a.token, a.node, r.run_id, r.status FROM eec_workflow_step_attempt a"
                " JOIN eec_workflow_run r USING (run_id) WHERE a.finished_at IS NULL AND"
                " r.status IN ('succeeded', 'failed', 'cancelled', 'terminated', 'continued')"
            )
        ).all()
    for run in runs:
        rid = run["run_id"]
        assert run["status"] == run["state_status"], run
        assert run["transition_count"] == run["state_transitions"], run
        log = logs.get(rid)
        if log is None:
            assert run["transition_count"] == 0, run
        else:
            assert (log.lo, log.hi, log.n) == (
                0,
                run["transition_count"] - 1,
                run["transition_count"],
            ), (run, log)
        # The run's status is where its log's last run-level entry left it.
        assert last_run_move.get(rid, "pending") == run["status"], (run, last_run_move.get(rid))
    assert not open_on_terminal, f"open attempts on terminal runs: {open_on_terminal}"


def outbox_empties(w: World, within: float = 5.0) -> bool:
    """Sent rows are deleted off the critical path (runtime/outbox_janitor.py), by a thread
    that may be mid-delete right now: every row must be gone soon, none may stay."""
    deadline = time.monotonic() + within
    while True:
        sent_outbox(w.d.runtime.engine()).flush()
        with w.engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT * FROM eec_workflow_outbox")).mappings().all()
        if not rows:
            return True
        assert time.monotonic() < deadline, f"outbox rows left: {rows}"
        time.sleep(0.05)


def leftovers(w: World) -> dict[str, int]:
    with w.engine.connect() as conn:
        return {
            "outbox rows": conn.execute(
                sa.text("SELECT count(*) FROM eec_workflow_outbox")
            ).scalar_one(),
            "unhandled controls": conn.execute(
                sa.text("SELECT count(*) FROM eec_workflow_control WHERE handled_at IS NULL")
            ).scalar_one(),
            "open attempts": conn.execute(
                sa.text("SELECT count(*) FROM eec_workflow_step_attempt WHERE finished_at IS NULL")
            ).scalar_one(),
            "open runs": len(w.open_runs()),
        }


def close_everything(w: World) -> None:
    """Terminate every open run (children first meet their parent-close policy) and drain."""
    for _ in range(20):
        w.drain()
        still = w.open_runs()
        if not still:
            return
        for run_id in still:
            try:
                w.d.terminate(run_id, reason="the end of the example")
            except DuctorError:
                pass  # closed meanwhile by its parent's close policy
    raise AssertionError(f"runs still open: {w.open_runs()}")


def check_all(w: World) -> None:
    checker = checker_module.Checker(w.engine, view=w.d.get)
    checker.run()
    problems = [
        f"{v.invariant} run={v.run_id}: {v.message} {v.rows[:3]}" for v in checker.violations
    ]
    assert not problems, "\n".join(problems[:20])


# -- the property ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def controls_template(pg_server: Any, template_db: str) -> str:
    """The migrated template plus the chaos ledger table."""
    name = "controls_template"
    pg_server.create_database(name, template=template_db)
    engine = sa.create_engine(pg_server.url(name), poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text(LEDGER_DDL))
    engine.dispose()
    return name


@pytest.fixture(scope="module")
def zoo_template(pg_server: Any, controls_template: str) -> str:
    """A database holding the zoo (``build_zoo``), built once: each example starts from a copy."""
    name = "controls_zoo"
    pg_server.create_database(name, template=controls_template)
    world = make_world(pg_server.url(name), eager=True, max_transitions=10_000)
    build_zoo(world)
    consistent(world)
    sent_outbox(world.d.runtime.engine()).flush()
    world.engine.dispose()
    dispose_all()
    return name


@pytest.fixture
def fresh_world(pg_server: Any, zoo_template: str) -> Iterator[Any]:
    made: list[tuple[str, World]] = []

    def make(**kwargs: Any) -> World:
        name = f"ctl_{uuid.uuid4().hex[:12]}"
        pg_server.create_database(name, template=zoo_template)
        world = make_world(pg_server.url(name), **kwargs)
        world.refresh()
        made.append((name, world))
        return world

    def drop() -> None:
        while made:
            name, world = made.pop()
            sent_outbox(world.d.runtime.engine()).flush()
            world.engine.dispose()
            dispose_all()
            pg_server.drop_database(name)

    make.drop = drop  # type: ignore[attr-defined]
    yield make
    drop()


# pytest-timeout times the whole property, every example together (and Hypothesis's shrinking
# of a failure), not one example: a long hunt (DUCTOR_CONTROLS_EXAMPLES) needs more than the
# suite's 180 s per test.
@pytest.mark.slow
@pytest.mark.timeout(max(600, 12 * EXAMPLES))
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,  # a factory: each example makes its own world
    ],
)
@given(
    ops=st.lists(OPERATIONS, min_size=10, max_size=50),
    eager=st.booleans(),
    max_transitions=st.sampled_from([10_000, 10_000, 14]),
)
def test_every_control_in_every_run_state_succeeds_or_raises_a_ductor_error(
    fresh_world: Any, ops: list[tuple[Any, ...]], eager: bool, max_transitions: int
) -> None:
    w = fresh_world(eager=eager, max_transitions=max_transitions)
    try:
        for op in ops:
            label = perform(w, op)
            note(f"{op!r:.120} -> {label}")
            event(label)
            consistent(w)
        w.drain()
        consistent(w)
        assert outbox_empties(w)
        close_everything(w)
        consistent(w)
        assert outbox_empties(w)
        assert leftovers(w) == {
            "outbox rows": 0,
            "unhandled controls": 0,
            "open attempts": 0,
            "open runs": 0,
        }, leftovers(w)
        check_all(w)
    finally:
        fresh_world.drop()


# -- every control on every zoo run, with the outcome the contract names ----------------------

OPEN = {"pending", "running", "paused"}
#: API.md, "Operator semantics": the run statuses each control is accepted in.
ACCEPTED_IN = {
    "pause": {"pending", "running"},
    "resume": {"paused"},
    "cancel": OPEN,
    "terminate": OPEN,
    "redrive": {"failed", "cancelled", "terminated"},
    "continue_as_new": OPEN,
}
#: ... and the status an accepted one leaves the run in once ticked.
LEAVES = {
    "pause": "paused",
    "resume": "running",
    "cancel": "cancelled",
    "terminate": "terminated",
    "redrive": "running",
}
CHILD_AFTER_PARENT = {"terminate": "terminated", "cancel": "cancelled", "abandon": "running"}


def newest(w: World, run_id: str) -> str:
    with w.engine.connect() as conn:
        while True:
            nxt = conn.execute(
                sa.text("SELECT continued_to FROM eec_workflow_run WHERE run_id = :r"),
                {"r": run_id},
            ).scalar_one()
            if nxt is None:
                return run_id
            run_id = nxt


def children(w: World, run_id: str) -> list[str]:
    with w.engine.connect() as conn:
        return list(
            conn.execute(
                sa.text("SELECT run_id FROM eec_workflow_run WHERE parent_run_id = :r"),
                {"r": run_id},
            ).scalars()
        )


@pytest.mark.parametrize("kind", [*ACCEPTED_IN, "approve", "reject", "signal"])
def test_each_control_on_a_run_in_each_status_does_what_the_contract_says(
    fresh_world: Any, kind: str
) -> None:
    """The zoo's runs, one control each (by run id): accepted exactly in the statuses API.md
    allows, refused with InvalidOperation otherwise (nothing written), and once ticked the run
    is where the control says; afterwards every invariant of the checker holds."""
    w = fresh_world(eager=True, max_transitions=10_000)
    d = w.d
    try:
        runs = list(w.known)
        if kind in ("cancel", "terminate"):
            # Child runs are left to their parent's close policy, checked below.
            runs = [r for r in runs if not d.get(r).parent_run_id]
        before = {r: w.status(r) for r in runs}
        in_flight = {r for r in runs if w.attempts(f"run_id = '{r}' AND finished_at IS NULL")}
        assert {
            "pending",
            "running",
            "paused",
            "succeeded",
            "failed",
            "cancelled",
            "terminated",
            "continued",
        } <= set(before.values()), before
        accepted: dict[str, bool] = {}
        decided: set[str] = set()  # runs a decision is on its way to
        for run_id in runs:
            status = before[run_id]
            live = newest(w, run_id)  # approvals and signals go to the newest run
            if kind in ACCEPTED_IN:
                expected = status in ACCEPTED_IN[kind]
            elif kind == "signal":
                expected = w.status(live) in OPEN
            else:
                review = d.get(live).nodes.get("review")
                expected = (
                    w.status(live) in OPEN
                    and review is not None
                    and review.status == "waiting"
                    and live not in decided  # "a decision is already on its way"
                )
            controls = leftovers(w)["unhandled controls"]
            try:
                if kind == "signal":
                    d.signal(run_id, "go", {"to": run_id})
                elif kind in ("approve", "reject"):
                    getattr(d, kind)(run_id, "review", by="matrix")
                else:
                    getattr(d, kind)(run_id)
            except DuctorError as exc:
                assert not expected, f"{kind} on a {status} run refused: {exc!r}"
                assert leftovers(w)["unhandled controls"] == controls  # nothing written
                accepted[run_id] = False
            else:
                assert expected, f"{kind} on a {status} run accepted"
                accepted[run_id] = True
                decided.add(live)
        assert any(accepted.values()) and not all(accepted.values()), accepted
        w.drain()
        consistent(w)
        for run_id, ok in accepted.items():
            now, was = w.status(run_id), before[run_id]
            if not ok:
                if run_id in decided:
                    continue  # refused as second: the first decision (by an older id) moved it
                # Refused: left as it was (a pending run is started by its first tick).
                assert now == ("running" if was == "pending" else was), (run_id, was, now)
                continue
            if kind in LEAVES:
                assert now == LEAVES[kind], (kind, run_id, was, now)
            elif kind == "continue_as_new":
                # Attempts in flight drain first (they never finish here).
                assert now == (was if run_id in in_flight else "continued"), (run_id, was, now)
                if now == "continued":
                    assert w.status(newest(w, run_id)) in OPEN
            elif kind in ("approve", "reject"):
                live = newest(w, run_id)
                if w.status(live) == "paused":
                    # A paused run takes its decision when it is resumed.
                    assert d.get(live).nodes["review"].status == "waiting"
                    d.resume(live)
                    w.drain()
                review = d.get(live).nodes["review"].status
                assert review == ("succeeded" if kind == "approve" else "failed"), review
                if kind == "reject":
                    assert w.status(live) == "failed"
        if kind in ("cancel", "terminate"):
            for policy, child_status in CHILD_AFTER_PARENT.items():
                parent = d.get(f"zoo-parent-{policy}").run_id
                assert w.status(parent) == LEAVES[kind]
                [child] = children(w, parent)
                assert w.status(child) == child_status, (policy, w.status(child))
        assert outbox_empties(w)
        close_everything(w)
        consistent(w)
        assert outbox_empties(w)
        assert leftovers(w) == {
            "outbox rows": 0,
            "unhandled controls": 0,
            "open attempts": 0,
            "open runs": 0,
        }, leftovers(w)
        check_all(w)
    finally:
        fresh_world.drop()
