"""An inline step's own cost on a real PostgreSQL, in this process: no broker, no workers.

    PYTHONPATH=. python benchmarks/chain_cost.py [--rounds 5] [--runs 40] [--profile N]

Starts a throwaway PostgreSQL (tests/servers.py) with ``pg_stat_statements``, then, each
round, runs ``--runs`` runs of a 10-step chain (``--steps N``: of N steps, up to the 50 a
chain runs inline by default) the way a step worker runs them with eager
ticks and inline steps on: the run's first tick, then the first step's message handled by
``execute_attempt``, which runs all the steps one after another (each step's outcome, the
eager tick that folds it, the next attempt claimed in that tick's commit). Step messages are
not sent (the dispatcher records them); the steps return a small dict.

Per step, over the ``execute_attempt`` calls only (medians over rounds):
- wall time; this process's CPU (the Python side); PostgreSQL's CPU (its backends, read from
  ``/proc``), and the two together;
- statements PostgreSQL executed (``pg_stat_statements``, ``BEGIN`` and ``COMMIT``
  included) and bytes of WAL written (``pg_current_wal_lsn()`` before and after).

``--statements N``: one more round, then the N statements PostgreSQL spent most time on
(executing and planning them). ``--extra-attempts N``: N more attempt rows in the table
before the measured rounds, as a scatter of N items leaves them.
``--waldump``: one more round, then where its WAL went (``pg_waldump``), per step, by record
kind, then by table or index and record kind.
``--state-what-if W``: the state text each commit stores leaves out what a design keeping
finished step nodes in their attempt rows would not store, to measure the WAL it would write:
``lean-finished``, a succeeded step node's times and output token; ``lean-finished-no-pending``,
those and the nodes that never started (the definition gives them); ``open-only``, every
succeeded step node and every node that never started. A what-if for the WAL only: the chain
runs on the nodes its commits return (store/next_read.py, kept however old), and the run is
checked afterwards (every run succeeded, each node ran once).
``--pg-perf N``: one more round with Linux ``perf`` sampling PostgreSQL's backends, then the
N functions with the most CPU (their callees' included): where the server's share goes.
``--profile N``: one more round under cProfile, printing the N functions with the most own
time. A/B two checkouts side by side with ``PYTHONPATH=<checkout>``.

``--output-items N``: each step returns N items of ~65 bytes of JSON beside its ``{"ok": 1}``
(40 make 2.6 kB); ``--pass-output``: each step takes the one before's output as its argument.

``--from-start``: each run from its start message instead, as a step worker runs one
(``steps.first_tick``: the run's first tick, its first step claimed in that tick's commit,
then the chain), per step of the whole run; ``--broker URL`` for the task events (an
in-memory broker by default: a real Redis makes them cost what they cost in a worker).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import os
import pstats
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from celery import Celery  # noqa: E402
from common import payload_items  # noqa: E402
from servers import PostgresServer  # noqa: E402

from ductor_celery import Ductor, Workflow  # noqa: E402
from ductor_celery.engine.kinds import DispatchKind  # noqa: E402
from ductor_celery.engine.state import AttemptOutput, NodeState, RunState  # noqa: E402
from ductor_celery.engine.status import NodeStatus  # noqa: E402
from ductor_celery.runtime.dispatch import first_tick_id  # noqa: E402
from ductor_celery.runtime.steps import execute_attempt, first_tick  # noqa: E402
from ductor_celery.runtime.tick_task import run_tick  # noqa: E402
from ductor_celery.settings import Settings  # noqa: E402
from ductor_celery.store import next_read, pg_commit  # noqa: E402
from ductor_celery.store.migrate import upgrade  # noqa: E402
from ductor_celery.store.schema import dumps_json  # noqa: E402

#: Steps per chain unless ``--steps`` says otherwise.
STEPS = 10
QUEUE = "ductor-steps"
FIGURES = ("wall ms", "process CPU ms", "PostgreSQL CPU ms", "CPU ms", "statements", "WAL bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    parser.add_argument("--profile-out", metavar="FILE", help="--profile's whole pstats file")
    parser.add_argument(
        "--statements",
        type=int,
        default=0,
        metavar="N",
        help="one more round, then the N statements PostgreSQL spent most time on, per step",
    )
    parser.add_argument(
        "--waldump",
        action="store_true",
        help="one more round, then its WAL per step by record kind (pg_waldump --stats=record)",
    )
    parser.add_argument(
        "--pg-perf",
        type=int,
        default=0,
        metavar="N",
        help="one more round with Linux perf sampling PostgreSQL's backends, then the N "
        "functions with the most CPU, their callees' included (needs perf: linux-perf)",
    )
    parser.add_argument(
        "--state-what-if",
        choices=sorted(STATE_WHAT_IFS),
        help="store a leaner run state (a WAL what-if; see the module's docstring)",
    )
    parser.add_argument(
        "--extra-attempts",
        type=int,
        default=0,
        metavar="N",
        help="after the warm-up round, N finished attempt rows of one run, as a scatter of N "
        "items leaves them (how the tick's statements fare on a grown table)",
    )
    parser.add_argument(
        "--from-start",
        action="store_true",
        help="run each run from its start message, as a step worker does (steps.first_tick)",
    )
    parser.add_argument("--broker", default="memory://", help="the app's broker (task events)")
    parser.add_argument(
        "--steps",
        type=int,
        default=STEPS,
        help="steps per chain: a run state of that many nodes (up to ductor_inline_steps, 50)",
    )
    parser.add_argument(
        "--output-items",
        type=int,
        default=0,
        metavar="N",
        help="each step returns N items of ~65 bytes of JSON each (a dict with an int, a "
        'string, a float and a list) beside its {"ok": 1}; 40 make 2.6 kB',
    )
    parser.add_argument(
        "--pass-output",
        action="store_true",
        help="each step after the first takes the one before's output as its argument",
    )
    args = parser.parse_args()
    inline_limit = Settings().inline_steps
    if not 1 <= args.steps <= inline_limit:
        parser.error(
            f"--steps must be 1..{inline_limit} (a chain runs at most ductor_inline_steps="
            f"{inline_limit} steps inline), got {args.steps}"
        )
    # Planning too: a prepared statement PostgreSQL plans anew at every call (its custom
    # plans looking cheaper than the generic one) costs its planning every time.
    settings = {
        "shared_preload_libraries": "pg_stat_statements",
        "pg_stat_statements.track_planning": "on",
    }
    if args.state_what_if:
        _store_leaner_states(args.state_what_if)
    with PostgresServer(settings=settings) as pg:
        pg.create_database("chain_cost")
        with pg.connect("chain_cost") as admin:
            admin.execute("CREATE EXTENSION pg_stat_statements")
        url = pg.url("chain_cost")
        upgrade(url)
        bench = _Bench(
            pg,
            url,
            args.steps,
            broker=args.broker,
            from_start=args.from_start,
            output_items=args.output_items,
            pass_output=args.pass_output,
        )
        bench.round(args.runs)  # warm: connections, prepared statements, caches
        if args.extra_attempts:
            bench.scatter_leftovers(args.extra_attempts)
        rounds = [bench.round(args.runs) for _ in range(args.rounds)]
        for name in FIGURES:
            values = [r[name] for r in rounds]
            sys.stdout.write(
                f"per step, {name}: median {statistics.median(values):.3f} "
                f"(min {min(values):.3f}, max {max(values):.3f})\n"
            )
        if args.statements:
            bench.statements(args.runs, args.statements)
        if args.waldump:
            bench.waldump(args.runs)
        if args.pg_perf:
            bench.pg_perf(args.runs, args.pg_perf)
        if args.state_what_if:
            check_what_if(pg, args.steps)
        if args.profile:
            profile = cProfile.Profile()
            bench.round(args.runs, profile)
            stats = pstats.Stats(profile, stream=sys.stdout)
            stats.sort_stats(os.environ.get("CHAIN_COST_SORT", "tottime")).print_stats(args.profile)
            if args.profile_out:
                profile.dump_stats(args.profile_out)


class _Bench:
    """One Ductor on the server, with a chain of ``steps`` steps registered."""

    def __init__(
        self,
        pg: PostgresServer,
        url: str,
        steps: int = STEPS,
        broker: str = "memory://",
        from_start: bool = False,
        output_items: int = 0,
        pass_output: bool = False,
    ) -> None:
        self.pg = pg
        self.steps = steps
        self.from_start = from_start
        app = Celery("chain_cost", set_as_current=False)
        app.conf.broker_url = broker
        ductor = Ductor(app, database_url=url)
        self.sent: list[Any] = []
        rt = ductor.runtime
        rt.dispatcher.send = self.sent.extend  # type: ignore[method-assign,assignment]
        rt.dispatcher.wake = lambda run_id, quick=None: None  # type: ignore[method-assign]
        rt.dispatcher.first_tick = lambda run_id: None  # type: ignore[method-assign]
        items = payload_items(output_items)
        output = {"items": items, "ok": 1} if items else {"ok": 1}
        ductor.step(name="c.step")(lambda ctx, prev=None: output)
        chain = Workflow("chain")
        for i in range(steps):
            args = {"prev": f"$.nodes.s{i - 1}.output"} if i and pass_output else None
            chain.step(f"s{i}", "c.step", after=[f"s{i - 1}"] if i else [], args=args)
        ductor.register(chain)
        self.ductor = ductor
        step = rt.step_named("c.step")
        assert step is not None
        self.step = step

    def round(self, runs: int, profile: cProfile.Profile | None = None) -> dict[str, float]:
        """Per-step figures of ``runs`` chain runs, each run inline from its first step's
        message, or with ``from_start`` from its start message (``steps.first_tick``)."""
        ductor, rt = self.ductor, self.ductor.runtime
        run_ids = [ductor.start("chain", input={}).run_id for _ in range(runs)]
        if self.from_start:
            calls = [
                functools.partial(first_tick, rt, run_id, "h", QUEUE, first_tick_id(run_id))
                for run_id in run_ids
            ]
        else:
            calls = []
            for run_id in run_ids:
                self.sent.clear()
                assert run_tick(rt, run_id) == "committed"
                (token,) = [r.payload["token"] for r in self.sent if r.kind == DispatchKind.STEP]
                calls.append(
                    functools.partial(
                        execute_attempt,
                        rt,
                        self.step,
                        token,
                        hostname="h",
                        queue=QUEUE,
                        carrier=token,
                    )
                )
        statements0, wal0 = self._server_counters()
        pg_cpu0 = _postgres_cpu(self.pg)
        w0, c0 = time.perf_counter(), time.process_time()
        if profile is not None:
            profile.enable()
        for call in calls:
            call()
        if profile is not None:
            profile.disable()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        pg_cpu = _postgres_cpu(self.pg) - pg_cpu0
        statements1, wal1 = self._server_counters()
        self.sent.clear()
        for run_id in run_ids:
            status = ductor.get(run_id).status
            assert status == "succeeded", (run_id, status)
        steps = runs * self.steps
        return {
            "wall ms": 1000 * wall / steps,
            "process CPU ms": 1000 * cpu / steps,
            "PostgreSQL CPU ms": 1000 * pg_cpu / steps,
            "CPU ms": 1000 * (cpu + pg_cpu) / steps,
            # Less the one statement that reads the counters.
            "statements": (statements1 - statements0 - 1) / steps,
            "WAL bytes": (wal1 - wal0) / steps,
        }

    def scatter_leftovers(self, items: int) -> None:
        """``items`` finished, folded attempt rows of one (made-up) run, as a scatter of that
        many items leaves them."""
        with self.pg.connect("chain_cost") as conn:
            conn.execute(
                "INSERT INTO eec_workflow_step_attempt (token, run_id, node, branch, "
                "generation, attempt, step, queue, args, timeout, created_at, folded, "
                "finished_at, outcome, output, priority) "
                "SELECT 'leftover:s:' || g, 'leftover', 's', g, 1, 1, 'c.step', %s, "
                "'{}'::jsonb, 60, now(), true, now(), 'succeeded', '{\"ok\": 1}'::jsonb, 0 "
                "FROM generate_series(1, %s) AS g",
                (QUEUE, items),
            )

    def statements(self, runs: int, top: int) -> None:
        """One more round with the statement statistics reset first: the ``top`` statements
        by PostgreSQL's execution time, per step (``pg_stat_statements``)."""
        with self.pg.connect("chain_cost") as conn:
            conn.execute("SELECT pg_stat_statements_reset()")
        self.round(runs)
        with self.pg.connect("chain_cost") as conn:
            rows = conn.execute(
                "SELECT calls, total_exec_time, plans, total_plan_time, wal_bytes, "
                "left(regexp_replace(query, '\\s+', ' ', 'g'), 80) FROM pg_stat_statements "
                "ORDER BY total_exec_time + total_plan_time DESC LIMIT %s",
                (top,),
            ).fetchall()
        steps = runs * self.steps
        for calls, ms, plans, plan_ms, wal, query in rows:
            sys.stdout.write(
                f"{calls / steps:5.2f} calls/step {1000 * ms / steps:7.1f} us/step "
                f"{plans / steps:5.2f} plans/step {1000 * plan_ms / steps:6.1f} us planning/step "
                f"{int(wal) / steps:7.0f} WAL B/step  {query}\n"
            )

    def waldump(self, runs: int) -> None:
        """One more round, then its WAL per step (``pg_waldump``): by record kind, then by
        table or index and record kind."""
        lsn = "SELECT pg_current_wal_lsn()::text"
        with self.pg.connect("chain_cost") as conn:
            start = conn.execute(lsn).fetchone()[0]  # type: ignore[index]
            names = dict(
                conn.execute(
                    "SELECT pg_relation_filenode(oid)::text, relname FROM pg_class "
                    "WHERE pg_relation_filenode(oid) IS NOT NULL"
                ).fetchall()
            )
        self.round(runs)
        with self.pg.connect("chain_cost") as conn:
            conn.execute("SELECT pg_switch_wal()")  # the round's last record complete on disk
            end = conn.execute(lsn).fetchone()[0]  # type: ignore[index]
        steps = runs * self.steps
        dump = [str(self.pg.bindir / "pg_waldump"), "-p", str(self.pg.data_dir / "pg_wal")]
        span = ["-s", start, "-e", end]
        out = subprocess.run(
            [*dump, "--stats=record", *span], check=True, capture_output=True, text=True
        ).stdout
        sys.stdout.write(f"WAL per step by record kind ({steps} steps, pg_waldump):\n")
        for line in out.splitlines():
            # "Heap/UPDATE   1234 ( 12.34)   56789 ( 12.34)   0 ( 0.00)   56789 ( 12.34)"
            fields = line.replace("(", " ").replace(")", " ").split()
            if len(fields) == 9 and fields[1].isdigit() and "/" in fields[0]:
                kind, count, combined = fields[0], int(fields[1]), int(fields[7])
                sys.stdout.write(
                    f"{kind:32} {count / steps:6.2f} records {combined / steps:8.0f} B"
                    f"  (of which full-page images {int(fields[5]) / steps:6.0f} B)\n"
                )
            elif line.startswith("Total"):
                sys.stdout.write(line + "\n")
        records = subprocess.run([*dump, *span], check=True, capture_output=True, text=True)
        by_relation = _wal_by_relation(records.stdout, names)
        sys.stdout.write("WAL per step by table or index and record kind (the 20 largest):\n")
        for (relation, kind), (count, size) in sorted(
            by_relation.items(), key=lambda item: -item[1][1]
        )[:20]:
            sys.stdout.write(
                f"{relation:44} {kind:22} {count / steps:6.2f} records {size / steps:6.0f} B\n"
            )

    def pg_perf(self, runs: int, top: int) -> None:
        """One more round with ``perf record`` on the server's backends (sampled by the CPU
        clock, with call graphs), then the ``top`` functions by CPU with their callees'."""
        backends = [
            pid
            for pid in _children_of(_postmaster_pid(self.pg))
            if "chain_cost" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
        ]
        with tempfile.TemporaryDirectory(prefix="chain-cost-perf-") as tmp:
            data = str(Path(tmp) / "perf.data")
            record = ["perf", "record", "-e", "cpu-clock", "-F", "4000", "-g", "-o", data]
            perf = subprocess.Popen(
                [*record, "-p", ",".join(map(str, backends))],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(0.5)  # perf attached before the round begins
            self.round(runs)
            perf.send_signal(signal.SIGINT)
            perf.wait()
            report = subprocess.run(
                ["perf", "report", "-i", data, "--stdio", "--children", "--sort", "symbol"]
                + ["-g", "none"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        sys.stdout.write(f"PostgreSQL's backends, CPU with callees (perf, {runs} runs):\n")
        # "    21.80%     0.19%  [.] standard_ExecutorStart   -   -": named functions only.
        rows = [
            line.split()
            for line in report.splitlines()
            if line.strip().endswith("-") and "%" in line and "] 0x" not in line
        ]
        for fields in rows[:top]:
            sys.stdout.write(f"{fields[0]:>8} (own {fields[1]:>7})  {fields[3]}\n")

    def _server_counters(self) -> tuple[int, int]:
        """Statements executed so far (all databases) and the WAL position, in bytes."""
        with self.pg.connect("chain_cost") as conn:
            row = conn.execute(
                "SELECT (SELECT sum(calls) FROM pg_stat_statements), "
                "pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')"
            ).fetchone()
        assert row is not None
        return int(row[0] or 0), int(row[1])


#: One record of ``pg_waldump``'s listing: its kind, total length, description and first
#: block reference's relation file ("rel 1663/16384/16465"), when it has one.
_WAL_RECORD = re.compile(
    r"rmgr: (?P<rmgr>\S+)\s+len \(rec/tot\):\s+\d+/\s*(?P<total>\d+),.*?desc: (?P<desc>\S+)"
    r"(?:.*?blkref #0: rel \d+/\d+/(?P<file>\d+))?"
)


def _wal_by_relation(listing: str, names: dict[str, str]) -> dict[tuple[str, str], list[int]]:
    """Records and bytes of ``pg_waldump``'s listing by relation name and record kind."""
    found: dict[tuple[str, str], list[int]] = {}
    for line in listing.splitlines():
        record = _WAL_RECORD.search(line)
        if record is None:
            continue
        file = record["file"]
        relation = "-" if file is None else names.get(file, f"file {file}")
        entry = found.setdefault((relation, f"{record['rmgr']}/{record['desc']}"), [0, 0])
        entry[0] += 1
        entry[1] += int(record["total"])
    return found


def _lean_finished(node: NodeState, data: dict[str, Any]) -> dict[str, Any] | None:
    """A succeeded step node as a design keeping its times and output token in its attempt
    row alone would store it."""
    if node.status == NodeStatus.SUCCEEDED and isinstance(node.output, AttemptOutput):
        return {key: data[key] for key in ("status", "attempt", "generation") if key in data}
    return data


def _lean_no_pending(node: NodeState, data: dict[str, Any]) -> dict[str, Any] | None:
    """As ``_lean_finished``, and no node that never started (the definition gives them)."""
    if node.status == NodeStatus.PENDING and node.generation == 0:
        return None
    return _lean_finished(node, data)


def _open_only(node: NodeState, data: dict[str, Any]) -> dict[str, Any] | None:
    """No succeeded step node (its attempt row would be its state) and no node that never
    started: the run row holds the open nodes only."""
    if node.status == NodeStatus.SUCCEEDED and isinstance(node.output, AttemptOutput):
        return None
    return _lean_no_pending(node, data)


STATE_WHAT_IFS = {
    "lean-finished": _lean_finished,
    "lean-finished-no-pending": _lean_no_pending,
    "open-only": _open_only,
}


def _store_leaner_states(what_if: str) -> None:
    """Make every commit store the state as ``what_if`` says (``--state-what-if``)."""
    lean = STATE_WHAT_IFS[what_if]

    def state_text(run_id: str, state: RunState, done: frozenset[str] = frozenset()) -> str:
        # The whole state, then leaner: what the stored format would be (``done`` ignored).
        nodes = {}
        for name, node in state.nodes.items():
            data = lean(node, node.to_json())
            if data is not None:
                nodes[name] = data
        return dumps_json({"nodes": nodes, **state.to_json_but_nodes()})

    pg_commit.state_text = state_text  # type: ignore[attr-defined]
    # A tick that read the run row back would find its succeeded nodes gone ("open-only") and
    # run them again: the chain ticks on the read its commit returned, however old
    # (``check_what_if`` counts the attempts afterwards).
    next_read.NEXT_READ_FRESH_FOR_S = 3600.0


def check_what_if(pg: PostgresServer, steps: int) -> None:
    """After a ``--state-what-if`` run: every run succeeded, each node ran once."""
    with pg.connect("chain_cost") as conn:
        runs, succeeded, attempts, nodes = conn.execute(
            "SELECT (SELECT count(*) FROM eec_workflow_run), "
            "(SELECT count(*) FROM eec_workflow_run WHERE status = 'succeeded'), "
            "count(*), count(DISTINCT (run_id, node)) FROM eec_workflow_step_attempt"
        ).fetchone()  # type: ignore[misc]
    if not (runs == succeeded and attempts == nodes == runs * steps):
        sys.exit(
            f"the what-if did not run as the real code would: {succeeded} of {runs} runs "
            f"succeeded, {attempts} attempts for {nodes} nodes (expected {runs * steps})"
        )
    sys.stdout.write(f"what-if check: {runs} runs succeeded, each of their nodes ran once\n")


def _postgres_cpu(pg: PostgresServer) -> float:
    """CPU seconds (user and system) of the server's processes so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in _children_of(_postmaster_pid(pg)):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def _postmaster_pid(pg: PostgresServer) -> int:
    return int((pg.data_dir / "postmaster.pid").read_text().split()[0])


def _children_of(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == parent:
                found.append(int(entry.name))
    return found


if __name__ == "__main__":
    main()
