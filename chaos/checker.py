"""The checker: reads ductor's ``eec_`` tables and the chaos ledger after quiescence and
verifies, per run, the promises ductor makes. Every violation names the run, the invariant and
the rows that break it.

Invariants (``INVARIANTS``; docs/reliability.md explains each):

* ``terminal``: every run (top-level, child, successor) reached a terminal status.
* ``state``: the status column, the stored state's status and the transition count agree.
* ``log_contiguous``: the transition log has seq 0..n-1 with n = the run's transition count.
* ``log_replay``: replaying the log (each entry leaves from the status the previous one
  reached, along ductor's allowed node transitions or a redrive's reset) ends in the stored
  node and run statuses.
* ``no_lost_step``: every succeeded step node's output is the result that exactly one ledger
  execution of that node's final token produced; every attempt a worker recorded as
  succeeded holds exactly what its one execution returned (batches: item by item); every
  gathered scatter output is, branch by branch, the result of that branch's final attempt.
* ``applied_once``: a node succeeds at most once per life (between redrives); a gather's
  counters add up to its items, and as many items succeeded as the gathered list holds
  values; every context patch key comes from an execution whose outcome was recorded, at
  most once per node and branch (more only after a redrive or a continue-as-new that restarts
  a scatter), and every succeeded step node's patch is in its run's context.
* ``no_stale_accepted``: a succeeded node's accepted token is its newest attempt, never one
  the log says was ignored as stale; a patch or output never comes from an attempt the
  coordinator closed (timed out, cancelled).
* ``claimed_once``: no token (and batch item) executed twice; every execution belongs to an
  attempt of its run and node.
* ``signals``: each accepted signal is stored once (a repeated idempotency key returns the same
  id), consumed at most once, by the node that references it, and signals of one name are
  consumed in the order they were accepted (a chain of waits reads them in id order);
  approvals: one decision per waiting episode.
* ``one_child``: one child run per parent node, branch and generation, under the id ductor
  derives from them.
* ``concurrency``: ledger intervals of a concurrency-limited step (clipped at the moment the
  coordinator closed their attempt: the documented caveat of a zombie is reported apart)
  never overlap more than the limit.
* ``clean_end``: no open attempt, no finished attempt left unfolded, no outbox row, no lease,
  no timer of a finished run, no unhandled control.
* ``provenance``: every step value in a run's output (and in sub-workflow outputs) is exactly
  what one ledger execution returned.
* ``run_output``: every succeeded run's stored output is its workflow's output mapping
  resolved over its input, context and nodes' outputs as the run view shows them (a run that
  finished without computing it, as a redrive of a cancelled run whose nodes had all
  succeeded did, stores ``None``). Paths are resolved here, not by the engine's resolver.

Run standalone against a kept database: ``python chaos/checker.py --database-url URL``.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa

INVARIANTS = (
    "terminal",
    "state",
    "log_contiguous",
    "log_replay",
    "no_lost_step",
    "applied_once",
    "no_stale_accepted",
    "claimed_once",
    "signals",
    "one_child",
    "concurrency",
    "clean_end",
    "provenance",
    "run_output",
)

TERMINAL = {"succeeded", "failed", "cancelled", "terminated", "continued"}
NODE_MOVES: dict[str, set[str]] = {
    "pending": {"running", "skipped", "waiting", "failed"},
    "running": {"running", "succeeded", "failed", "cancelled"},
    "waiting": {"succeeded", "failed", "cancelled"},
    "succeeded": set(),
    "failed": set(),
    "skipped": set(),
    "cancelled": set(),
}
BATCH_ARG = "__ductor_batch__"
APPROVAL_PREFIX = "ductor.approval:"
NONCE = re.compile(r"^[0-9a-f]{32}$")
STALE = re.compile(r"stale result ignored \(token (?P<token>.+)\)$")
GATHERED = re.compile(r"gathered (?P<n>\d+) branches \((?P<s>\d+) succeeded, (?P<f>\d+) failed\)")
SUFFIX = re.compile(r"^/(?P<node>[^\[~/]+)(\[(?P<branch>\d+)\])?(~(?P<gen>\d+))?$")
MAX_ROWS_SHOWN = 8


def is_step_value(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"n", "v"}
        and isinstance(value["n"], str)
        and NONCE.match(value["n"]) is not None
    )


def canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _jsonable(row: Any) -> dict[str, Any]:
    out = {}
    for key, value in dict(row).items():
        if isinstance(value, datetime):
            value = value.isoformat()
        if key in ("state", "args") and isinstance(value, dict) and len(canon(value)) > 600:
            value = canon(value)[:600] + "..."
        out[key] = value
    return out


_PATH_KEY = re.compile(r"\.([A-Za-z_][A-Za-z0-9_\-]*)|\[(\d+)\]")


def resolve_template(template: Any, scope: dict[str, Any]) -> Any:
    """A definition's template (a literal, a ``$.`` path, or dicts and lists of them) over
    ``scope`` ({"input", "context", "nodes": {id: output}}), as the README says paths read:
    a missing key reads as ``None``; a key below a model or dataclass envelope reads its data."""
    if isinstance(template, dict):
        return {k: resolve_template(v, scope) for k, v in template.items()}
    if isinstance(template, list):
        return [resolve_template(v, scope) for v in template]
    if not (isinstance(template, str) and template.startswith("$.")):
        return template
    keys: list[str | int] = [
        m.group(1) if m.group(1) is not None else int(m.group(2))
        for m in _PATH_KEY.finditer(template[1:])
    ]
    if keys[:1] == ["nodes"]:
        value: Any = scope["nodes"].get(keys[1]) if len(keys) > 2 else None
        keys = keys[3:]
    else:
        value = scope.get(str(keys[0]))
        keys = keys[1:]
    for key in keys:
        if isinstance(value, dict) and set(value) == {"__type__", "__value__"}:
            inner = value["__value__"]
            if value["__type__"] in ("pydantic", "dataclass") and isinstance(inner, dict):
                value = inner.get("data" if value["__type__"] == "pydantic" else "fields")
        if isinstance(key, int):
            value = value[key] if isinstance(value, list) and key < len(value) else None
        else:
            value = value.get(key) if isinstance(value, dict) else None
    return value


@dataclass
class Violation:
    run_id: str | None
    invariant: str
    message: str
    rows: list[Any] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "invariant": self.invariant,
            "message": self.message,
            "rows": [
                _jsonable(r)
                if not isinstance(r, dict)
                else {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in r.items()}
                for r in self.rows[:MAX_ROWS_SHOWN]
            ],
        }


#: Margins of an asynchronous failover's loss window (``async_loss_windows``): before the
#: fault's start (an asynchronous standby is a moment behind), and after the kill (the client
#: notes an acknowledgement a moment after the server sent it).
LOSS_BEFORE_S, LOSS_AFTER_S = 1.0, 0.5


def async_loss_windows(faults: Iterable[dict[str, Any]]) -> list[tuple[float, float]]:
    """The windows (seconds after t0) in which a commit the primary acknowledged may have been
    lost by an asynchronous failover: from the fault's start (``LOSS_BEFORE_S`` earlier: an
    asynchronous standby is a moment behind) to the kill of the primary (``detail.killed_at``,
    ``LOSS_AFTER_S`` later). With ``--failover-lag`` the WAL senders are stopped first, and
    finding them takes a connection to the primary (1.3 s under load in one run), so the
    standby stops receiving somewhere between the fault's start and ``lag_s`` before the kill:
    the window starts at the fault's start. None with synchronous replication: a commit is
    acknowledged there only once the standby has it."""
    out = []
    for f in faults:
        detail = f.get("detail") or {}
        if f.get("kind") != "failover" or detail.get("sync", True) or f.get("started") is None:
            continue
        killed = detail.get("killed_at")
        if killed is None:  # a report written before killed_at was recorded
            killed = f["started"] + float(detail.get("lag_s") or 0.0)
        out.append((float(f["started"]) - LOSS_BEFORE_S, float(killed) + LOSS_AFTER_S))
    return out


def in_windows(t: float | None, windows: list[tuple[float, float]]) -> bool:
    return t is not None and any(a <= t <= b for a, b in windows)


class Checker:
    """Loads everything once, then runs every invariant; ``violations`` and ``figures``."""

    def __init__(
        self,
        engine: sa.Engine,
        *,
        view: Callable[[str], Any] | None = None,
        signals_sent: list[dict[str, Any]] | None = None,
        decisions: list[dict[str, Any]] | None = None,
        faults: list[dict[str, Any]] | None = None,
        t0_wall: float | None = None,
    ) -> None:
        self.engine = engine
        self.view = view
        self.signals_sent = signals_sent or []
        self.decisions = decisions or []
        self.faults = faults or []
        self.t0_wall = t0_wall
        self.violations: list[Violation] = []
        self.figures: dict[str, Any] = {}
        self._run_rank: dict[str, int] | None = None

    # -- loading ------------------------------------------------------------------------------

    def _all(self, query: str) -> list[Any]:
        with self.engine.connect() as conn:
            return list(conn.execute(sa.text(query)).mappings())

    def load(self) -> None:
        # The whole state: on PostgreSQL the row names the nodes its attempt rows keep and
        # those never started, and gives them back through eec_run_state (migration 0020).
        whole = "state" if self.engine.dialect.name == "sqlite" else "eec_run_state(state, run_id)"
        self.runs = {
            r["run_id"]: {**r, "state": r["whole_state"]}
            for r in self._all(f"SELECT *, {whole} AS whole_state FROM eec_workflow_run")
        }
        self._run_rank = None
        self.specs = {
            r["spec_hash"]: r["spec"]
            for r in self._all("SELECT spec_hash, spec FROM eec_workflow_definition")
        }
        self.attempts = {
            r["token"]: r
            for r in self._all(
                "SELECT token, run_id, node, branch, generation, attempt, step, args, created_at,"
                " claimed_at, finished_at, outcome, output, error, retryable, patch, folded,"
                " lease_key, lease_limit FROM eec_workflow_step_attempt"
            )
        }
        self.transitions: dict[str, list[Any]] = defaultdict(list)
        for r in self._all("SELECT * FROM eec_workflow_history ORDER BY run_id, seq"):
            self.transitions[r["run_id"]].append(r)
        self.signals = self._all("SELECT * FROM eec_workflow_signal ORDER BY id")
        self.controls = self._all("SELECT * FROM eec_workflow_control ORDER BY id")
        self.outbox = self._all(
            "SELECT id, run_id, kind, task, payload, created_at FROM eec_workflow_outbox"
        )
        self.timers = self._all("SELECT * FROM eec_workflow_timer")
        self.leases = self._all("SELECT * FROM eec_concurrency_lease")
        self.wakes = self._all("SELECT * FROM eec_workflow_wake")
        self.ledger = self._all("SELECT * FROM chaos_ledger ORDER BY id")
        self.by_nonce = {r["nonce"]: r for r in self.ledger}
        self.ledger_by_token: dict[str, list[Any]] = defaultdict(list)
        for r in self.ledger:
            self.ledger_by_token[r["token"]].append(r)
        self.attempts_by_node: dict[tuple[str, str], list[Any]] = defaultdict(list)
        for a in self.attempts.values():
            self.attempts_by_node[(a["run_id"], a["node"])].append(a)
        for rows in self.attempts_by_node.values():
            rows.sort(key=lambda a: a["generation"])
        self.children: dict[str, list[Any]] = defaultdict(list)
        for r in self.runs.values():
            if r["parent_run_id"]:
                self.children[r["parent_run_id"]].append(r)

    # -- helpers ------------------------------------------------------------------------------

    def fail(
        self, run_id: str | None, invariant: str, message: str, rows: Iterable[Any] = ()
    ) -> None:
        self.violations.append(Violation(run_id, invariant, message, list(rows)))

    def spec_nodes(self, run: Any) -> dict[str, dict[str, Any]]:
        spec = self.specs.get(run["spec_hash"]) or {}
        return {n["id"]: n for n in spec.get("nodes", [])}

    def lineage(self, run_id: str) -> list[str]:
        """The run and its predecessors (continue-as-new), newest first."""
        out = [run_id]
        seen = {run_id}
        run = self.runs.get(run_id)
        while run is not None and run["continued_from"] and run["continued_from"] not in seen:
            out.append(run["continued_from"])
            seen.add(run["continued_from"])
            run = self.runs.get(run["continued_from"])
        return out

    def newest(self, run_id: str) -> Any:
        run = self.runs.get(run_id)
        seen = set()
        while run is not None and run["continued_to"] and run["continued_to"] not in seen:
            seen.add(run["run_id"])
            nxt = self.runs.get(run["continued_to"])
            if nxt is None:
                break
            run = nxt
        return run

    def resets(self, run_ids: Iterable[str], node: str) -> int:
        """Redrives that put ``node`` back to pending, over runs ``run_ids``."""
        return sum(
            1
            for rid in run_ids
            for tr in self.transitions.get(rid, ())
            if tr["node"] == node
            and tr["to_status"] == "pending"
            and tr["from_status"] in ("failed", "cancelled")
        )

    def restarts_in(self, run_ids: Iterable[str]) -> int:
        """Continue-as-new events in a lineage (a scatter not finished starts over)."""
        return sum(1 for rid in run_ids if self.runs.get(rid, {}).get("status") == "continued")

    # -- running ------------------------------------------------------------------------------

    def run(self) -> None:
        self.load()
        self.check_runs()
        self.check_attempts()
        self.check_ledger()
        self.check_signals()
        self.check_children()
        self.check_concurrency()
        self.check_clean_end()
        self.compute_figures()

    # -- per run ------------------------------------------------------------------------------

    def check_runs(self) -> None:
        for run in self.runs.values():
            rid = run["run_id"]
            state = run["state"] or {}
            if run["status"] not in TERMINAL:
                timer = next((t for t in self.timers if t["run_id"] == rid), None)
                due = sorted(
                    v.get(k)
                    for v in state.get("nodes", {}).values()
                    for k in ("deadline", "check_at", "retry_at")
                    if v.get(k)
                )
                why = ""
                if due and timer is None:
                    why = f" (its next time is {due[0]} but it has no timer row: nothing wakes it)"
                self.fail(
                    rid,
                    "terminal",
                    f"run is {run['status']} at the end{why}",
                    [
                        {
                            "run_id": rid,
                            "workflow": run["workflow"],
                            "workflow_id": run["workflow_id"],
                            "status": run["status"],
                            "timer": timer["fire_at"] if timer else None,
                            "nodes": {
                                k: v.get("status") for k, v in state.get("nodes", {}).items()
                            },
                        }
                    ],
                )
            if state.get("status") != run["status"]:
                self.fail(
                    rid,
                    "state",
                    f"status column {run['status']} but state says {state.get('status')}",
                )
            if int(state.get("transitions", 0)) != run["transition_count"]:
                self.fail(
                    rid,
                    "state",
                    "transition_count differs from the state's count",
                    [{"column": run["transition_count"], "state": state.get("transitions")}],
                )
            self.check_log(run)
            self.check_nodes(run)
            self.check_context(run)
            if run["status"] == "succeeded":
                self.check_provenance(rid, "output", run["output"])
                self.check_output(run)

    def check_output(self, run: Any) -> None:
        """``run_output``: the stored output is the output mapping over the run's values."""
        rid = run["run_id"]
        spec = self.specs.get(run["spec_hash"]) or {}
        if self.view is None:
            return
        try:
            view = self.view(rid)
        except Exception as exc:  # noqa: BLE001
            self.fail(rid, "run_output", f"the run view cannot be read: {exc}")
            return
        from ductor_celery.values import encode

        scope = {
            "input": encode(view.input),
            "context": encode(view.context),
            "nodes": {n: encode(nv.output) for n, nv in view.nodes.items()},
        }
        expected = json.loads(json.dumps(resolve_template(spec.get("output"), scope)))
        if expected != run["output"]:
            self.fail(
                rid,
                "run_output",
                "the stored output is not the workflow's output mapping over its nodes",
                [{"stored": run["output"], "expected": expected, "spec": spec.get("output")}],
            )

    def check_log(self, run: Any) -> None:
        rid = run["run_id"]
        log = self.transitions.get(rid, [])
        seqs = [t["seq"] for t in log]
        if seqs != list(range(len(seqs))):
            missing = sorted(set(range(max(seqs, default=-1) + 1)) - set(seqs))
            self.fail(rid, "log_contiguous", f"seq not contiguous (missing {missing[:10]})")
        if len(seqs) != run["transition_count"]:
            self.fail(
                rid,
                "log_contiguous",
                f"{len(seqs)} transition rows but transition_count {run['transition_count']}",
            )
        nodes = self.spec_nodes(run)
        successor = bool(run["continued_from"])
        current: dict[str, str] = {}
        run_status = "pending"
        for tr in log:
            node, frm, to = tr["node"], tr["from_status"], tr["to_status"]
            if node is None:
                if frm != run_status:
                    self.fail(
                        rid,
                        "log_replay",
                        f"run transition seq {tr['seq']} leaves {frm}, run was {run_status}",
                        [tr],
                    )
                run_status = to
                continue
            if node not in nodes:
                self.fail(rid, "log_replay", f"transition of unknown node {node!r}", [tr])
                continue
            if node not in current:
                current[node] = frm if successor else "pending"
            if frm != current[node]:
                self.fail(
                    rid,
                    "log_replay",
                    f"{node}: seq {tr['seq']} leaves {frm} but the node was {current[node]}",
                    [tr],
                )
            if (
                frm != to
                and to not in NODE_MOVES.get(frm or "", set())
                and not (to == "pending" and frm in ("failed", "cancelled"))
            ):
                self.fail(rid, "log_replay", f"{node}: {frm} -> {to} is not an allowed move", [tr])
            current[node] = to
        state_nodes = (run["state"] or {}).get("nodes", {})
        for node_id in nodes:
            stored = state_nodes.get(node_id, {}).get("status", "pending")
            replayed = current.get(node_id)
            if replayed is None:
                if not successor and stored != "pending":
                    self.fail(
                        rid, "log_replay", f"{node_id} is {stored} but the log never moved it"
                    )
            elif replayed != stored:
                self.fail(
                    rid,
                    "log_replay",
                    f"{node_id}: the log ends at {replayed}, the state says {stored}",
                )
        if run_status != run["status"]:
            self.fail(
                rid,
                "log_replay",
                f"run: the log ends at {run_status}, the row says {run['status']}",
            )

    def _succeeded_count_ok(self, rid: str, node: str) -> None:
        life = 0
        for tr in self.transitions.get(rid, []):
            if tr["node"] != node:
                continue
            if tr["to_status"] == "pending" and tr["from_status"] in ("failed", "cancelled"):
                life = 0
            elif tr["to_status"] == "succeeded" and tr["from_status"] != "succeeded":
                life += 1
                if life > 1:
                    self.fail(rid, "applied_once", f"{node} succeeded twice in one life", [tr])

    def check_nodes(self, run: Any) -> None:
        rid = run["run_id"]
        nodes = self.spec_nodes(run)
        state_nodes = (run["state"] or {}).get("nodes", {})
        stale_tokens = {
            m.group("token")
            for tr in self.transitions.get(rid, [])
            if (m := STALE.search(tr["reason"] or ""))
        }
        view = None
        for node_id, spec in nodes.items():
            ns = state_nodes.get(node_id, {})
            self._succeeded_count_ok(rid, node_id)
            if ns.get("status") != "succeeded":
                continue
            kind = spec.get("kind")
            if kind == "step":
                self.check_step_node(rid, node_id, ns, stale_tokens)
            elif kind in ("scatter", "child_scatter", "subworkflow"):
                if view is None and self.view is not None:
                    try:
                        view = self.view(rid)
                    except Exception as exc:  # noqa: BLE001
                        self.fail(rid, "no_lost_step", f"the run view cannot be read: {exc}")
                        view = False
                if not view:
                    continue
                output = view.nodes[node_id].output
                if kind == "scatter":
                    self.check_gather(rid, node_id, spec, ns, output)
                elif kind == "child_scatter":
                    self.check_child_gather(rid, node_id, ns, output)
                else:
                    self.check_subworkflow(rid, node_id, spec, ns, output)

    def check_step_node(self, rid: str, node: str, ns: dict[str, Any], stale: set[str]) -> None:
        token = ns.get("output_token")
        attempt = self.attempts.get(token) if token else None
        if attempt is None:
            self.fail(
                rid, "no_lost_step", f"{node} succeeded without an attempt row ({token})", [ns]
            )
            return
        if attempt["outcome"] != "succeeded" or attempt["node"] != node:
            self.fail(
                rid,
                "no_stale_accepted",
                f"{node} accepted token {token} whose outcome is {attempt['outcome']}",
                [attempt],
            )
        execs = [e for e in self.ledger_by_token.get(token, []) if e["ok"]]
        if len(execs) != 1:
            self.fail(
                rid,
                "no_lost_step",
                f"{node}: {len(execs)} successful ledger executions of its final token {token}",
                [attempt, *execs],
            )
        elif canon(execs[0]["result"]) != canon(attempt["output"]):
            self.fail(
                rid,
                "no_lost_step",
                f"{node}: the accepted output is not what its execution returned",
                [attempt, execs[0]],
            )
        siblings = self.attempts_by_node.get((attempt["run_id"], node), [])
        newest = max((a["generation"] for a in siblings), default=attempt["generation"])
        if attempt["generation"] != newest:
            newer = [a for a in siblings if a["generation"] > attempt["generation"]]
            self.fail(
                rid,
                "no_stale_accepted",
                f"{node} accepted generation {attempt['generation']} while generation "
                f"{newest} exists",
                [attempt, *newer],
            )
        if token in stale:
            # Not a stale result accepted (the state is right) but one result folded twice: a
            # later tick was handed the already-folded result again and logged it as stale.
            self.fail(
                rid,
                "applied_once",
                f"{node}: the result of {token} was folded twice (applied, then ignored "
                "as stale by a later tick)",
                [attempt, *self._stale_rows(rid, token)],
            )

    def _stale_rows(self, rid: str, token: str) -> list[Any]:
        return [
            tr
            for tr in self.transitions.get(rid, [])
            if (m := STALE.search(tr["reason"] or "")) and m.group("token") == token
        ]

    def _branch_attempts(self, run_id: str, node: str, branch: int, base: int) -> list[Any]:
        return [
            a
            for a in self.attempts_by_node.get((run_id, node), [])
            if a["branch"] == branch and a["generation"] > base
        ]

    def check_gather(
        self, rid: str, node: str, spec: dict[str, Any], ns: dict[str, Any], output: Any
    ) -> None:
        sc = ns.get("scatter") or {}
        total, batch = int(sc.get("total", 0)), int(sc.get("batch", 1))
        base, owner = int(sc.get("base", 0)), sc.get("run", rid)
        if not isinstance(output, list) or len(output) != total:
            self.fail(
                rid,
                "no_lost_step",
                f"{node}: gathered {type(output).__name__} of "
                f"{len(output) if isinstance(output, list) else '?'} for {total} items",
            )
            return
        values = [v for v in output if not (isinstance(v, dict) and set(v) == {"error"})]
        succeeded, failed = int(sc.get("succeeded", 0)), int(sc.get("failed", 0))
        if succeeded + failed != total or len(values) != succeeded:
            self.fail(
                rid,
                "applied_once",
                f"{node}: counters say {succeeded} succeeded + {failed} failed of {total}, "
                f"the gathered list holds {len(values)} values",
                [sc],
            )
        for tr in self.transitions.get(rid, []):
            m = GATHERED.search(tr["reason"] or "") if tr["node"] == node else None
            if m and int(m.group("s")) + int(m.group("f")) != int(m.group("n")):
                self.fail(rid, "applied_once", f"{node}: {tr['reason']}", [tr])
        errors = {int(k) for k in (sc.get("errors") or {})}
        for i, value in enumerate(output):
            is_error = isinstance(value, dict) and set(value) == {"error"}
            if batch == 1:
                mine = self._branch_attempts(owner, node, i, base)
                last = mine[-1] if mine else None
                if is_error:
                    if last is not None and last["outcome"] == "succeeded" and i not in errors:
                        self.fail(
                            rid,
                            "no_lost_step",
                            f"{node}[{i}]: gathered as an error but its last attempt succeeded",
                            [last],
                        )
                    continue
                if last is None or not is_step_value(value):
                    self.fail(
                        rid,
                        "no_lost_step",
                        f"{node}[{i}]: value without an attempt",
                        [{"value": value}],
                    )
                    continue
                ex = self.by_nonce.get(value["n"])
                if ex is None or not ex["ok"] or canon(ex["result"]) != canon(value):
                    self.fail(
                        rid,
                        "no_lost_step",
                        f"{node}[{i}]: gathered value is not what an execution returned",
                        [{"value": value}, *([ex] if ex else [])],
                    )
                elif ex["token"] != last["token"] or last["outcome"] != "succeeded":
                    self.fail(
                        rid,
                        "no_stale_accepted",
                        f"{node}[{i}]: gathered the result of {ex['token']}, the branch's "
                        f"final attempt is {last['token']} ({last['outcome']})",
                        [ex, last],
                    )
                elif self._stale_rows(owner, last["token"]):
                    self.fail(
                        rid,
                        "applied_once",
                        f"{node}[{i}]: the result of {last['token']} was folded twice "
                        "(counted, then ignored as stale by a later tick)",
                        [last, *self._stale_rows(owner, last["token"])],
                    )
                elif ex["branch"] != i or ex["node"] != node:
                    self.fail(rid, "no_lost_step", f"{node}[{i}]: value of another branch", [ex])
            else:
                if is_error:
                    continue
                tokens = {a["token"] for a in self._branch_attempts(owner, node, i // batch, base)}
                ex = self.by_nonce.get(value["n"]) if is_step_value(value) else None
                if ex is None or not ex["ok"] or canon(ex["result"]) != canon(value):
                    self.fail(
                        rid,
                        "no_lost_step",
                        f"{node}[{i}]: batched value is not what an execution returned",
                        [{"value": value}, *([ex] if ex else [])],
                    )
                elif ex["token"] not in tokens or ex["branch"] != i:
                    self.fail(
                        rid,
                        "no_stale_accepted",
                        f"{node}[{i}]: value from {ex['token']} item {ex['branch']}, not an "
                        f"attempt of batch {i // batch}",
                        [ex],
                    )

    def _child_of(self, parent_ids: list[str], node: str, branch: int | None) -> list[Any]:
        found = []
        for pid in parent_ids:
            parent = self.runs.get(pid)
            if parent is None:
                continue
            for child in self.children.get(pid, []):
                if child["parent_node"] != node or child["continued_from"]:
                    continue
                m = SUFFIX.match(child["workflow_id"][len(parent["workflow_id"]) :])
                if m is None:
                    continue
                b = m.group("branch")
                if (b is None and branch is None) or (b is not None and int(b) == branch):
                    found.append(child)
        return found

    def check_child_gather(self, rid: str, node: str, ns: dict[str, Any], output: Any) -> None:
        sc = ns.get("scatter") or {}
        total = int(sc.get("total", 0))
        if not isinstance(output, list) or len(output) != total:
            self.fail(rid, "no_lost_step", f"{node}: child gather is not a list of {total}")
            return
        owners = self.lineage(rid)
        for i, value in enumerate(output):
            kids = [self.newest(c["run_id"]) for c in self._child_of(owners, node, i)]
            is_error = isinstance(value, dict) and set(value) == {"error"}
            done = [k for k in kids if k is not None and k["status"] == "succeeded"]
            if is_error:
                continue
            if not any(canon(k["output"]) == canon(value) for k in done):
                self.fail(
                    rid,
                    "no_lost_step",
                    f"{node}[{i}]: gathered value is no succeeded child's output",
                    [{"value": value}, *kids],
                )
            self.check_provenance(rid, f"{node}[{i}]", value)

    def check_subworkflow(
        self, rid: str, node: str, spec: dict[str, Any], ns: dict[str, Any], output: Any
    ) -> None:
        child = self.runs.get(ns.get("child_run") or "")
        if child is None:
            self.fail(rid, "no_lost_step", f"{node}: child run {ns.get('child_run')} is missing")
            return
        last = self.newest(child["run_id"])
        if spec.get("until"):
            keys = set(output) if isinstance(output, dict) else None
            final = set(((last or child)["state"] or {}).get("context", {}))
            if keys is None or not keys <= final:
                self.fail(
                    rid,
                    "no_lost_step",
                    f"{node}: checkpoint context is not part of the child's context",
                    [{"output": output}],
                )
            for key in keys or ():
                self._check_patch_key(child["run_id"], key, strict=False)
        else:
            same = last is not None and canon(last["output"]) == canon(output)
            if last is None or last["status"] != "succeeded" or not same:
                self.fail(
                    rid,
                    "no_lost_step",
                    f"{node}: output differs from the child's",
                    [{"output": output}, *([last] if last else [])],
                )
            self.check_provenance(rid, node, output)

    # -- context patches ----------------------------------------------------------------------

    def _parse_key(self, key: str) -> tuple[str, int | None, str] | None:
        parts = key.split(":")
        if len(parts) != 4 or parts[0] != "x" or not NONCE.match(parts[3]):
            return None
        branch = None if parts[2] == "-" else int(parts[2])
        return parts[1], branch, parts[3]

    def _check_patch_key(
        self, rid: str, key: str, *, strict: bool = True
    ) -> tuple[str, Any] | None:
        parsed = self._parse_key(key)
        if parsed is None:
            return None
        node, branch, nonce = parsed
        ex = self.by_nonce.get(nonce)
        if ex is None or not ex["ok"] or ex["node"] != node or ex["branch"] != branch:
            self.fail(
                rid,
                "applied_once",
                f"context key {key} matches no finished execution",
                [ex] if ex else [],
            )
            return None
        # A context holds patches of its run and of the runs it continued from (carried); a
        # child's checkpoint context is read through the child's newest run.
        newest = self.newest(rid) if not strict else None
        if ex["run_id"] not in self.lineage(newest["run_id"] if newest else rid):
            self.fail(
                rid, "applied_once", f"context key {key} comes from another run's execution", [ex]
            )
        attempt = self.attempts.get(ex["token"])
        if attempt is None:
            self.fail(rid, "claimed_once", f"context key {key}: its execution has no attempt", [ex])
            return None
        batched = isinstance(attempt["args"], dict) and BATCH_ARG in attempt["args"]
        if strict and not batched and attempt["outcome"] != "succeeded":
            self.fail(
                rid,
                "no_stale_accepted",
                f"context key {key}: patch applied from an attempt that is {attempt['outcome']}",
                [ex, attempt],
            )
        return node, ex

    def check_context(self, run: Any) -> None:
        rid = run["run_id"]
        state = run["state"] or {}
        context = state.get("context") or {}
        nodes = self.spec_nodes(run)
        per: Counter[tuple[str, Any]] = Counter()
        nonces = set()
        for key in context:
            found = self._check_patch_key(rid, key)
            if found is None:
                continue
            node, ex = found
            nonces.add(ex["nonce"])
            per[(node, ex["branch"])] += 1
        lineage = self.lineage(rid)
        for (node, branch), count in per.items():
            kind = nodes.get(node, {}).get("kind")
            allowed = (
                1
                if kind == "step"
                else 1 + self.resets(lineage, node) + self.restarts_in(lineage[1:])
            )
            if count > allowed:
                self.fail(
                    rid,
                    "applied_once",
                    f"{count} patches of {node} branch {branch} in the context (at most {allowed})",
                    [{"key": k} for k in context if k.startswith(f"x:{node}:")],
                )
        for node_id, ns in (state.get("nodes") or {}).items():
            if nodes.get(node_id, {}).get("kind") != "step" or ns.get("status") != "succeeded":
                continue
            attempt = self.attempts.get(ns.get("output_token") or "")
            output = attempt["output"] if attempt else None
            if is_step_value(output) and output["n"] not in nonces:
                self.fail(
                    rid,
                    "applied_once",
                    f"{node_id} succeeded but its context patch is not in the context",
                    [attempt],
                )

    # -- provenance ---------------------------------------------------------------------------

    def check_provenance(self, rid: str, where: str, value: Any) -> None:
        stack = [value]
        while stack:
            v = stack.pop()
            if is_step_value(v):
                ex = self.by_nonce.get(v["n"])
                if ex is None or not ex["ok"] or canon(ex["result"]) != canon(v):
                    self.fail(
                        rid,
                        "provenance",
                        f"{where}: step value {v['n']} is not what an execution returned",
                        [{"value": v}, *([ex] if ex else [])],
                    )
            elif isinstance(v, dict):
                stack.extend(v.values())
            elif isinstance(v, list):
                stack.extend(v)

    # -- attempts and the ledger --------------------------------------------------------------

    def check_attempts(self) -> None:
        for token, a in self.attempts.items():
            outcome = a["outcome"]
            execs = self.ledger_by_token.get(token, [])
            batched = isinstance(a["args"], dict) and BATCH_ARG in a["args"]
            if outcome == "succeeded" and not batched:
                ok = [e for e in execs if e["ok"]]
                if len(ok) != 1 or canon(ok[0]["result"]) != canon(a["output"]):
                    self.fail(
                        a["run_id"],
                        "no_lost_step",
                        f"attempt {token} succeeded but {len(ok)} executions returned its output",
                        [a, *execs],
                    )
            elif outcome == "succeeded" and batched:
                spec = a["args"][BATCH_ARG]
                first = int(spec.get("first", 0))
                if not isinstance(a["output"], list):
                    self.fail(a["run_id"], "no_lost_step", f"batch {token} output not a list", [a])
                    continue
                tokens = {
                    b["token"]
                    for b in self._branch_attempts(
                        a["run_id"], a["node"], a["branch"], int(spec.get("base", 0))
                    )
                }
                for k, value in enumerate(a["output"]):
                    if value is None:
                        continue
                    ex = self.by_nonce.get(value["n"]) if is_step_value(value) else None
                    if (
                        ex is None
                        or not ex["ok"]
                        or canon(ex["result"]) != canon(value)
                        or ex["token"] not in tokens
                        or ex["branch"] != first + k
                    ):
                        self.fail(
                            a["run_id"],
                            "no_lost_step",
                            f"batch {token} item {first + k}: value is not what an "
                            "execution of this batch returned",
                            [a, *([ex] if ex else [])],
                        )
            elif outcome == "failed" and not batched:
                error_type = (a["error"] or {}).get("type")
                if not execs and error_type not in ("LedgerUnavailable", "InvalidResult"):
                    self.fail(
                        a["run_id"],
                        "no_lost_step",
                        f"attempt {token} failed ({error_type}) without any execution",
                        [a],
                    )
                if any(e["ok"] for e in execs):
                    self.fail(
                        a["run_id"],
                        "no_lost_step",
                        f"attempt {token} recorded as failed but its execution succeeded",
                        [a, *execs],
                    )

    def lost_with_primary(self, e: Any) -> bool:
        """Whether execution ``e`` started in the window an asynchronous failover loses: from
        30 s before the primary was killed to 5 s after the standby was promoted. A commit the
        old primary acknowledged in that window may never have reached the standby (with
        synchronous replication nothing acknowledged is lost, and this is always False)."""
        if self.t0_wall is None or e.get("started_at") is None:
            return False
        at = e["started_at"].timestamp() - self.t0_wall
        for f in self.faults:
            detail = f.get("detail") or {}
            if f.get("kind") != "failover" or detail.get("sync", True) or f.get("started") is None:
                continue
            promoted = f["started"] + float(detail.get("promoted_after_s") or 0.0)
            if f["started"] - 30.0 <= at <= promoted + 5.0:
                return True
        return False

    def check_ledger(self) -> None:
        seen: dict[tuple[str, Any], Any] = {}
        for e in self.ledger:
            if e["token"] is None:
                self.fail(e["run_id"], "claimed_once", "an execution without a token", [e])
                continue
            key = (e["token"], e["branch"])
            a = self.attempts.get(e["token"])
            if a is None and self.lost_with_primary(e):
                # Its claim was among the commits an asynchronous failover lost: the database
                # forgot the attempt, the ledger (files on the workers' hosts) did not. The step
                # runs again under a new attempt: a counted duplicate (duplicates()), no harm.
                self.figures["executions_of_lost_attempts"] = (
                    self.figures.get("executions_of_lost_attempts", 0) + 1
                )
                seen[key] = e
                continue
            if a is None or a["run_id"] != e["run_id"] or a["node"] != e["node"]:
                self.fail(
                    e["run_id"],
                    "claimed_once",
                    f"execution of {e['token']} belongs to no attempt of its run and node",
                    [e, *([a] if a else [])],
                )
            elif a["branch"] != e["branch"] and not (
                isinstance(a["args"], dict) and BATCH_ARG in a["args"]
            ):
                self.fail(e["run_id"], "claimed_once", "execution of another branch", [e, a])
            if key in seen:
                self.fail(
                    e["run_id"],
                    "claimed_once",
                    f"token {e['token']} (item {e['branch']}) executed twice",
                    [seen[key], e],
                )
            seen[key] = e

    # -- signals ------------------------------------------------------------------------------

    def consumed_at(self, signal: dict[str, Any]) -> tuple[Any, int]:
        """Where an applied signal's consumption falls in its workflow id's history: the
        consuming run's start (one workflow id has one open run at a time, and a successor is
        created by its predecessor's last commit), then the version the consuming tick wrote."""
        if self._run_rank is None:
            by_workflow: dict[str, list[Any]] = defaultdict(list)
            for run in self.runs.values():
                by_workflow[run["workflow_id"]].append(run)
            self._run_rank = {
                run["run_id"]: rank
                for runs in by_workflow.values()
                for rank, run in enumerate(sorted(runs, key=lambda r: r["created_at"]))
            }
        return (self._run_rank.get(signal["run_id"], -1), signal["applied_version"] or 0)

    def check_signals(self) -> None:
        by_id = {s["id"]: s for s in self.signals}
        # (1) every reference from a node is a signal applied to that node of that run's chain.
        for run in self.runs.values():
            rid = run["run_id"]
            lineage = set(self.lineage(rid))
            used: dict[int, str] = {}
            nodes = self.spec_nodes(run)
            for node_id, ns in ((run["state"] or {}).get("nodes") or {}).items():
                refs = []
                if ns.get("output_signal") is not None:
                    refs.append(ns["output_signal"])
                refs.extend((ns.get("output_signals") or {}).values())
                for sid in refs:
                    s = by_id.get(sid)
                    if s is None or s["applied_at"] is None or s["applied_to"] != node_id:
                        self.fail(
                            rid,
                            "signals",
                            f"{node_id} references signal {sid} not applied to it",
                            [s] if s else [],
                        )
                        continue
                    if s["run_id"] not in lineage or s["workflow_id"] != run["workflow_id"]:
                        self.fail(
                            rid, "signals", f"{node_id} consumed signal {sid} of another run", [s]
                        )
                    if sid in used and used[sid] != node_id:
                        self.fail(
                            rid,
                            "signals",
                            f"signal {sid} consumed by {used[sid]} and {node_id}",
                            [s],
                        )
                    used[sid] = node_id
            # a chain of waits reads one name in id order
            chain = [n for n in ("w0", "w1", "w2") if n in nodes]
            ids = [
                ((run["state"] or {}).get("nodes", {}).get(n) or {}).get("output_signal")
                for n in chain
            ]
            got = [i for i in ids if i is not None]
            if got != sorted(got):
                self.fail(
                    rid,
                    "signals",
                    f"waits {chain} consumed signals {ids} out of order",
                    [by_id[i] for i in got if i in by_id],
                )
        # (2) an applied signal is referenced by its node, unless the node failed, was cancelled
        # or reset after consuming it, or timed out into continue.
        for s in self.signals:
            node = s["applied_to"]
            if s["applied_at"] is None or node is None:
                continue
            run = self.runs.get(s["run_id"])
            if run is None:
                self.fail(s["run_id"], "signals", f"signal {s['id']} applied to a missing run", [s])
                continue
            ns = ((run["state"] or {}).get("nodes") or {}).get(node) or {}
            refs = {ns.get("output_signal"), *(ns.get("output_signals") or {}).values()}
            if s["id"] in refs:
                continue
            moved = any(
                tr["node"] == node and tr["to_status"] in ("failed", "cancelled")
                for tr in self.transitions.get(run["run_id"], [])
            )
            timed_out = isinstance(ns.get("output_value"), dict) and ns["output_value"].get(
                "timed_out"
            )
            if not (moved or timed_out):
                self.fail(
                    run["run_id"],
                    "signals",
                    f"signal {s['id']} was applied to {node} but {node} does not hold it",
                    [s, ns],
                )
        # (3) one name, one workflow id: consumed in the order accepted. The order of
        # consumption is the order of the commits that consumed them: the consuming run's place
        # in its workflow id's sequence of runs, then the run version its tick wrote. Not
        # applied_at: that is the tick's time, taken when its transaction began, and a tick that
        # waited for the run's lock behind an earlier one carries the earlier time.
        groups: dict[tuple[str, str], list[Any]] = defaultdict(list)
        for s in self.signals:
            if not s["name"].startswith(APPROVAL_PREFIX):
                groups[(s["workflow_id"], s["name"])].append(s)
        for (wf, name), rows in groups.items():
            rows.sort(key=lambda s: s["id"])
            for i, later in enumerate(rows):
                if later["applied_at"] is None:
                    continue
                for earlier in rows[:i]:
                    if earlier["applied_at"] is None or self.consumed_at(
                        earlier
                    ) > self.consumed_at(later):
                        self.fail(
                            later["run_id"],
                            "signals",
                            f"{name!r} of {wf}: signal {later['id']} consumed before the "
                            f"earlier {earlier['id']}",
                            [earlier, later],
                        )
                        break
        # (4) what the driver was told: a repeated key returns the one stored id. A signal
        # acknowledged inside an asynchronous failover's loss window and not stored as sent
        # was lost with the primary: counted, and left out of these checks.
        stored = {(s["workflow_id"], s["idempotency_key"]): s for s in self.signals}
        by_key: dict[tuple[str, str], set[int]] = defaultdict(set)
        returned: Counter[int] = Counter()
        windows = async_loss_windows(self.faults)
        lost = self.figures.setdefault("signals_lost_with_primary", 0)
        for rec in self.signals_sent:
            if "id" not in rec:
                continue
            row = by_id.get(rec["id"])
            if (
                row is None
                or row["name"] != rec["name"]
                or canon(row["payload"]) != canon(rec["payload"])
                or row["workflow_id"] != rec["workflow_id"]
            ):
                if in_windows(rec.get("acked"), windows):
                    lost += 1
                    rec["lost_with_primary"] = True
                    continue
                self.fail(
                    row["run_id"] if row else None,
                    "signals",
                    f"accepted signal {rec['id']} is not stored as sent",
                    [rec, *([row] if row else [])],
                )
            returned[rec["id"]] += 1
            if rec["key"] is not None:
                by_key[(rec["workflow_id"], rec["key"])].add(rec["id"])
        for (wf, key), ids in by_key.items():
            row = stored.get((wf, key))
            if len(ids) != 1 or row is None or row["id"] not in ids:
                self.fail(
                    row["run_id"] if row else None,
                    "signals",
                    f"idempotency key {key} of {wf} returned ids {sorted(ids)}",
                    [row] if row else [],
                )
        self.figures["signals_lost_with_primary"] = lost
        for rec in self.signals_sent:
            if rec.get("lost_with_primary"):
                continue
            if rec.get("key") is None and "id" in rec and returned[rec["id"]] > 1:
                self.fail(None, "signals", f"two keyless sends got the same id {rec['id']}", [rec])
        # (5) approvals: at most one decision per waiting episode.
        episodes: Counter[str] = Counter()
        for rid, log in self.transitions.items():
            run = self.runs.get(rid)
            if run is None:
                continue
            for tr in log:
                if tr["to_status"] == "waiting" and tr["from_status"] != "waiting":
                    node = tr["node"]
                    if node and self.spec_nodes(run).get(node, {}).get("kind") == "approval":
                        episodes[f"{run['workflow_id']}|{node}"] += 1
        decided: Counter[str] = Counter()
        for s in self.signals:
            if s["name"].startswith(APPROVAL_PREFIX):
                decided[f"{s['workflow_id']}|{s['name'][len(APPROVAL_PREFIX) :]}"] += 1
        for key, count in decided.items():
            if count > episodes.get(key, 0):
                self.fail(
                    None,
                    "signals",
                    f"{count} decisions stored for {key}, {episodes.get(key, 0)} waiting episodes",
                )
        accepted: Counter[str] = Counter()
        for d in self.decisions:
            if not d.get("accepted"):
                continue
            if in_windows(d.get("acked"), windows):
                # It may have been lost with the primary: not counted against what is stored.
                self.figures["decisions_in_loss_window"] = (
                    self.figures.get("decisions_in_loss_window", 0) + 1
                )
                continue
            accepted[f"{d['workflow_id']}|ok"] += 1
        for key, count in accepted.items():
            if count > decided.get(key, 0):
                self.fail(
                    None,
                    "signals",
                    f"{count} decisions accepted for {key} but {decided.get(key, 0)} stored",
                )

    # -- children -----------------------------------------------------------------------------

    def check_children(self) -> None:
        groups: dict[tuple[str, str, str], list[Any]] = defaultdict(list)
        for run in self.runs.values():
            if not run["parent_run_id"] or run["continued_from"]:
                continue
            groups[(run["parent_run_id"], run["parent_node"], run["workflow_id"])].append(run)
            parent = self.runs.get(run["parent_run_id"])
            if parent is None:
                self.fail(run["run_id"], "one_child", "child of a missing parent", [run])
                continue
            m = SUFFIX.match(run["workflow_id"][len(parent["workflow_id"]) :])
            if not run["workflow_id"].startswith(parent["workflow_id"]) or m is None:
                self.fail(
                    run["run_id"],
                    "one_child",
                    f"child workflow id {run['workflow_id']} is not derived from its parent's",
                )
                continue
            branch = m.group("branch")
            gen = int(m.group("gen") or 1)
            owners = [*self.lineage(parent["run_id"])]
            ids = {
                hashlib.sha256(
                    f"{o}:{m.group('node')}:{'' if branch is None else branch}:{gen}".encode()
                ).hexdigest()[:32]
                for o in owners
            }
            if run["run_id"] not in ids:
                self.fail(
                    run["run_id"],
                    "one_child",
                    "child run id is not the one derived from (parent, node, branch, generation)",
                    [run],
                )
        for (parent, node, wf), rows in groups.items():
            if len(rows) > 1:
                self.fail(parent, "one_child", f"{len(rows)} children for {node} ({wf})", rows)
        # every waiting or finished sub-workflow node names an existing child
        for run in self.runs.values():
            for node_id, ns in ((run["state"] or {}).get("nodes") or {}).items():
                child = ns.get("child_run")
                # Documented: a child whose workflow id an open run holds (one an earlier run of
                # the same workflow id abandoned) is never inserted, and the node fails.
                refused = ns.get("status") == "failed" and "could not be started" in str(
                    (ns.get("error") or {}).get("message", "")
                )
                if child and child not in self.runs and not refused:
                    self.fail(
                        run["run_id"], "one_child", f"{node_id} names a missing child {child}"
                    )

    # -- concurrency --------------------------------------------------------------------------

    def check_concurrency(self) -> None:
        inf = float("inf")
        per_key: dict[str, list[tuple[float, float, Any]]] = defaultdict(list)
        zombies = 0
        limits: dict[str, int] = {}
        for e in self.ledger:
            if not e["lease_key"]:
                continue
            a = self.attempts.get(e["token"])
            closed = a["finished_at"] if a else None
            end = e["ended_at"]
            if (
                closed is not None
                and a["outcome"] in ("timed_out", "cancelled")
                and (end is None or end > closed)
            ):
                zombies += 1  # the documented caveat: ran on after it was declared lost
            # The slot is held from the claim until the attempt ends (the worker's finish or
            # the coordinator's close); an execution counts only while its attempt was open.
            stop = min([x.timestamp() for x in (end, closed) if x is not None] or [inf])
            start = e["started_at"].timestamp()
            if stop <= start:
                continue
            per_key[e["lease_key"]].append((start, stop, e))
            if a and a["lease_limit"]:
                limits[e["lease_key"]] = int(a["lease_limit"])
        self.figures["limited_executions_past_close"] = zombies
        worst: dict[str, int] = {}
        for key, spans in per_key.items():
            events = []
            for start, stop, e in spans:
                events.append((start, 1, e))
                events.append((stop, 0, e))
            events.sort(key=lambda x: (x[0], x[1]))  # an end before a start at the same time
            live: dict[int, Any] = {}
            peak = 0
            limit = limits.get(key, 1)
            reported = False
            for _, kind, e in events:
                if kind == 1:
                    live[e["id"]] = e
                    peak = max(peak, len(live))
                    if len(live) > limit and not reported:
                        self.fail(
                            e["run_id"],
                            "concurrency",
                            f"{len(live)} executions of {key} at once (limit {limit})",
                            list(live.values()),
                        )
                        reported = True
                else:
                    live.pop(e["id"], None)
            worst[key] = peak
        self.figures["concurrency_peak"] = worst

    # -- end state ----------------------------------------------------------------------------

    def check_clean_end(self) -> None:
        for a in self.attempts.values():
            if a["finished_at"] is None:
                self.fail(a["run_id"], "clean_end", f"attempt {a['token']} is still open", [a])
            elif not a["folded"]:
                self.fail(a["run_id"], "clean_end", f"attempt {a['token']} was never folded", [a])
        for row in self.outbox:
            self.fail(
                row["run_id"], "clean_end", f"outbox row {row['id']} ({row['kind']}) unsent", [row]
            )
        for row in self.leases:
            self.fail(
                row["run_id"], "clean_end", f"lease {row['key']} slot {row['slot']} held", [row]
            )
        for row in self.timers:
            run = self.runs.get(row["run_id"])
            if run is None or run["status"] in TERMINAL:
                self.fail(row["run_id"], "clean_end", "timer row of a finished run", [row])
        for row in self.controls:
            if row["handled_at"] is None:
                self.fail(row["run_id"], "clean_end", f"{row['kind']} control never handled", [row])

    # -- figures ------------------------------------------------------------------------------

    def compute_figures(self) -> None:
        f = self.figures
        f["runs"] = len(self.runs)
        f["top_level_runs"] = sum(1 for r in self.runs.values() if not r["parent_run_id"])
        f["runs_by_status"] = dict(Counter(r["status"] for r in self.runs.values()))
        f["runs_by_workflow"] = dict(Counter(r["workflow"] for r in self.runs.values()))
        f["step_attempts"] = len(self.attempts)
        f["attempts_by_outcome"] = dict(
            Counter(a["outcome"] or "open" for a in self.attempts.values())
        )
        f["executions"] = len(self.ledger)
        f["executions_ok"] = sum(1 for e in self.ledger if e["ok"])
        f["executions_failed"] = sum(1 for e in self.ledger if e["ok"] is False)
        f["executions_interrupted"] = sum(1 for e in self.ledger if e["ended_at"] is None)
        f["transitions"] = sum(len(v) for v in self.transitions.values())
        f["stale_results_ignored"] = sum(
            1 for log in self.transitions.values() for tr in log if STALE.search(tr["reason"] or "")
        )
        f["continued_runs"] = sum(1 for r in self.runs.values() if r["status"] == "continued")
        f["child_runs"] = sum(1 for r in self.runs.values() if r["parent_run_id"])
        f["redrives_applied"] = sum(
            1 for c in self.controls if c["kind"] == "redrive" and c["result"] == "applied"
        )
        f["controls"] = dict(
            Counter(
                f"{c['kind']}:{(c['result'] or 'unhandled').split(':')[0]}" for c in self.controls
            )
        )
        f["signals_stored"] = len(self.signals)
        f["signals_applied"] = sum(1 for s in self.signals if s["applied_at"] is not None)
        f["wake_rows_left"] = len(self.wakes)
        # zombies: executions that ended after their attempt was closed by the coordinator
        f["zombie_executions"] = sum(
            1
            for e in self.ledger
            if (a := self.attempts.get(e["token"])) is not None
            and a["outcome"] in ("timed_out", "cancelled")
            and a["finished_at"] is not None
            and e["ended_at"] is not None
            and e["ended_at"] > a["finished_at"]
        )
        self.duplicates()

    def duplicates(self) -> None:
        """Executions of one (run, node, branch) that completed more than once, with a cause."""
        groups: dict[tuple[str, str, Any], list[Any]] = defaultdict(list)
        for e in self.ledger:
            if e["ok"]:
                groups[(e["run_id"], e["node"], e["branch"])].append(e)
        fault_times = sorted(
            (f["started"], f["kind"]) for f in self.faults if f.get("started") is not None
        )
        starts = [t for t, _ in fault_times]
        causes: Counter[str] = Counter()
        near: Counter[str] = Counter()
        examples: list[dict[str, Any]] = []
        total = 0
        for rows in groups.values():
            if len(rows) < 2:
                continue
            rows.sort(key=lambda e: e["started_at"])
            for earlier, later in zip(rows, rows[1:], strict=False):
                total += 1
                a = self.attempts.get(earlier["token"]) or {}
                b = self.attempts.get(later["token"]) or {}
                outcome = a.get("outcome")
                resets = [
                    tr["at"]
                    for tr in self.transitions.get(later["run_id"], [])
                    if tr["node"] == later["node"]
                    and tr["to_status"] == "pending"
                    and tr["from_status"] in ("failed", "cancelled")
                ]
                if not a and self.lost_with_primary(earlier):
                    cause = "the attempt's claim was lost with the primary (asynchronous failover)"
                elif (
                    b.get("attempt") == 1
                    or outcome == "succeeded"
                    or any(earlier["started_at"] < at < later["started_at"] for at in resets)
                ):
                    cause = (
                        "node started over (a redrive re-runs a failed or cancelled scatter "
                        "from its first item)"
                    )
                elif outcome == "timed_out":
                    cause = "attempt timed out after its effect (worker killed or stopped)"
                elif outcome == "cancelled":
                    cause = "attempt closed (cancel, terminate, fail-fast) while it ran"
                elif outcome == "failed":
                    cause = "a batch retry ran an item that had an output again"

                else:
                    cause = f"other ({outcome} then attempt {b.get('attempt')})"
                causes[cause] += 1
                by_fault = cause.startswith(("attempt timed out", "attempt closed"))
                if (
                    by_fault
                    and self.t0_wall is not None
                    and a.get("finished_at") is not None
                    and starts
                ):
                    at = a["finished_at"].timestamp() - self.t0_wall
                    i = bisect.bisect_right(starts, at) - 1
                    kind = fault_times[i][1] if i >= 0 and at - starts[i] <= 30 else "none"
                    near[kind] += 1
                if len(examples) < 5:
                    examples.append(
                        {
                            "run_id": earlier["run_id"],
                            "node": earlier["node"],
                            "branch": earlier["branch"],
                            "first": earlier["token"],
                            "again": later["token"],
                            "cause": cause,
                        }
                    )
        self.figures["duplicate_executions"] = total
        self.figures["duplicates_by_cause"] = dict(causes)
        # For the duplicates a fault can explain (a timed-out or closed attempt): the kind of
        # the last fault that started within 30 s before the attempt was closed.
        self.figures["duplicates_by_nearest_fault"] = dict(near)
        self.figures["duplicate_examples"] = examples

    def report(self) -> dict[str, Any]:
        by = Counter(v.invariant for v in self.violations)
        return {
            "violations": len(self.violations),
            "violations_by_invariant": {k: by.get(k, 0) for k in INVARIANTS},
            "violation_details": [v.to_json() for v in self.violations[:200]],
            "figures": self.figures,
        }


def print_violations(violations: list[Violation], limit: int = 40) -> None:
    for v in violations[:limit]:
        print(f"VIOLATION run={v.run_id} invariant={v.invariant}: {v.message}")  # noqa: T201
        for row in v.rows[:4]:
            data = _jsonable(row) if not isinstance(row, dict) else row
            print(f"    {canon(data)[:400]}")  # noqa: T201
    if len(violations) > limit:
        print(f"... and {len(violations) - limit} more")  # noqa: T201


def main() -> int:
    parser = argparse.ArgumentParser(description="check a kept chaos database")
    parser.add_argument("--database-url", required=True)
    args = parser.parse_args()
    engine = sa.create_engine(args.database_url, poolclass=sa.pool.NullPool)
    # Gathered scatter and child outputs are read the way users read them: ductor.get().
    import os

    os.environ["DUCTOR_DATABASE_URL"] = args.database_url
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    import app as chaos_app

    checker = Checker(engine, view=chaos_app.ductor.get)
    checker.run()
    print_violations(checker.violations)
    print(json.dumps(checker.report()["violations_by_invariant"], indent=2))  # noqa: T201
    return 1 if checker.violations else 0


if __name__ == "__main__":
    sys.exit(main())
