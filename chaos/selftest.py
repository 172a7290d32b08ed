"""Does the checker catch what it claims to? Mutation tests over a real chaos database.

Each mutation copies the database (``CREATE DATABASE ... TEMPLATE``), breaks one promise in
the copy the way a buggy engine would (a lost result, a double-applied patch, a gap in the
log, a signal consumed out of order, a second child, an overlap past a limit, a leftover
outbox row, ...), runs the checker on the copy and expects the named invariant to fire.

    .venv/bin/python chaos/selftest.py --conninfo "host=127.0.0.1 port=5432 user=postgres" \\
        --database chaos

(the database of a kept run: ``scripts/chaos --keep`` dumps it to the work dir when something
broke; restore a dump with ``psql -f chaos.sql``). Exits 1 if a mutation goes unnoticed.
"""

# ruff: noqa: T201

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import psycopg
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checker import Checker  # noqa: E402

Mutation = Callable[[psycopg.Connection], None]


def one(conn: psycopg.Connection, query: str, *params: object) -> tuple:
    row = conn.execute(query, params).fetchone()
    if row is None:
        raise LookupError(f"nothing to mutate: {query}")
    return tuple(row)


def lost_step(conn: psycopg.Connection) -> None:
    """A succeeded attempt's output is not what its execution returned."""
    (token,) = one(
        conn,
        "SELECT token FROM eec_workflow_step_attempt WHERE outcome = "
        "'succeeded' AND NOT (args ? '__ductor_batch__') LIMIT 1",
    )
    conn.execute(
        "UPDATE eec_workflow_step_attempt SET output = jsonb_set(output, '{v}', "
        "'-1') WHERE token = %s",
        (token,),
    )


def double_patch(conn: psycopg.Connection) -> None:
    """A second execution's patch of one step node lands in the context."""
    run_id, node, nonce = one(
        conn,
        """
        SELECT l.run_id, l.node, l.nonce FROM chaos_ledger l
        JOIN eec_workflow_run r ON r.run_id = l.run_id
        JOIN eec_workflow_step_attempt a ON a.token = l.token
        WHERE l.ok AND l.branch IS NULL AND a.outcome = 'succeeded' AND r.status = 'succeeded'
        LIMIT 1""",
    )
    twin = "f" * 32
    conn.execute(
        "INSERT INTO chaos_ledger (nonce, token, run_id, node, branch, attempt, step, pid, "
        "ended_at, ok, result) SELECT %s, token, run_id, node, branch, attempt + 1, step, pid, "
        "ended_at, true, result FROM chaos_ledger WHERE nonce = %s",
        (twin, nonce),
    )
    conn.execute(
        "UPDATE eec_workflow_run SET state = jsonb_set(state, '{context}', "
        "state->'context' || jsonb_build_object(%s::text, 1)) WHERE run_id = %s",
        (f"x:{node}:-:{twin}", run_id),
    )


def stale_accepted(conn: psycopg.Connection) -> None:
    """A node accepts an older generation while a newer attempt exists."""
    token, run_id, node, gen = one(
        conn,
        """
        SELECT a.token, a.run_id, a.node, a.generation FROM eec_workflow_step_attempt a
        JOIN eec_workflow_run r ON r.run_id = a.run_id
        WHERE a.outcome = 'succeeded' AND a.branch IS NULL AND r.status = 'succeeded'
          AND eec_run_state(r.state, r.run_id)->'nodes'->a.node->>'output_token' = a.token
        LIMIT 1""",
    )
    conn.execute(
        "INSERT INTO eec_workflow_step_attempt (token, run_id, node, generation, attempt, step,"
        " args, timeout, finished_at, outcome, folded) SELECT token || 'z', run_id, node, "
        "generation + 1, attempt + 1, step, args, timeout, finished_at, 'timed_out', true "
        "FROM eec_workflow_step_attempt WHERE token = %s",
        (token,),
    )


def log_gap(conn: psycopg.Connection) -> None:
    """Seq 3 of one run's history lost, wherever it was kept: a row, or an attempt row's
    ``dispatch_seq``/``success_seq`` (docs/history-in-attempt-rows.md)."""
    (run_id,) = one(conn, "SELECT run_id FROM eec_workflow_history WHERE seq = 3 LIMIT 1")
    conn.execute("DELETE FROM eec_workflow_transition WHERE run_id = %s AND seq = 3", (run_id,))
    for column in ("dispatch_seq", "success_seq"):
        conn.execute(
            f"UPDATE eec_workflow_step_attempt SET {column} = NULL "
            f"WHERE run_id = %s AND {column} = 3",
            (run_id,),
        )


def log_disagrees(conn: psycopg.Connection) -> None:
    """The stored state says a node is somewhere the log never took it."""
    (run_id,) = one(
        conn,
        "SELECT run_id FROM eec_workflow_run WHERE status = 'succeeded' AND "
        "workflow = 'chaos_dag' LIMIT 1",
    )
    conn.execute(
        # The whole state (a succeeded step may be only named in the stored one: migration
        # 0020), with b's status changed.
        "UPDATE eec_workflow_run SET state = jsonb_set(eec_run_state(state, run_id), "
        "'{nodes,b,status}', '\"skipped\"') WHERE run_id = %s",
        (run_id,),
    )


def claimed_twice(conn: psycopg.Connection) -> None:
    (nonce,) = one(conn, "SELECT nonce FROM chaos_ledger WHERE ok LIMIT 1")
    conn.execute(
        "INSERT INTO chaos_ledger (nonce, token, run_id, node, branch, attempt, step, pid, ok) "
        "SELECT md5(nonce), token, run_id, node, branch, attempt, step, pid, false "
        "FROM chaos_ledger WHERE nonce = %s",
        (nonce,),
    )


def signals_out_of_order(conn: psycopg.Connection) -> None:
    """w0 and w1 swap the signals they consumed."""
    run_id, s0, s1 = one(
        conn,
        """
        SELECT run_id, state->'nodes'->'w0'->>'output_signal', state->'nodes'->'w1'->>
        'output_signal' FROM eec_workflow_run WHERE workflow = 'chaos_signals' AND
        status = 'succeeded' AND state->'nodes'->'w1' ? 'output_signal' LIMIT 1""",
    )
    conn.execute(
        "UPDATE eec_workflow_run SET state = jsonb_set(jsonb_set(state, "
        "'{nodes,w0,output_signal}', %s::jsonb), '{nodes,w1,output_signal}', %s::jsonb)"
        " WHERE run_id = %s",
        (s1, s0, run_id),
    )
    conn.execute(
        "UPDATE eec_workflow_signal SET applied_to = CASE id WHEN %s THEN 'w1' "
        "ELSE 'w0' END WHERE id IN (%s, %s)",
        (int(s0), int(s0), int(s1)),
    )


def signal_twice(conn: psycopg.Connection) -> None:
    """One stored signal answers two different idempotency keys' sends: seen as the driver's
    record only, so here: two nodes of a run reference one signal."""
    (run_id,) = one(
        conn,
        """
        SELECT run_id FROM eec_workflow_run WHERE workflow = 'chaos_signals' AND
        status = 'succeeded' AND state->'nodes'->'w1' ? 'output_signal' LIMIT 1""",
    )
    conn.execute(
        "UPDATE eec_workflow_run SET state = jsonb_set(state, "
        "'{nodes,w1,output_signal}', state->'nodes'->'w0'->'output_signal') "
        "WHERE run_id = %s",
        (run_id,),
    )


def second_child(conn: psycopg.Connection) -> None:
    (run_id,) = one(
        conn,
        "SELECT run_id FROM eec_workflow_run WHERE parent_run_id IS NOT NULL"
        " AND continued_from IS NULL LIMIT 1",
    )
    conn.execute(
        "INSERT INTO eec_workflow_run (run_id, workflow_id, workflow, version, spec_hash, "
        "status, state, input, parent_run_id, parent_node, record_version, transition_count) "
        "SELECT md5(run_id), workflow_id, workflow, version, spec_hash, 'cancelled', "
        "jsonb_build_object('status', 'cancelled', 'nodes', '{}'::jsonb, 'transitions', 0), "
        "input, parent_run_id, parent_node, 0, 0 FROM eec_workflow_run WHERE run_id = %s",
        (run_id,),
    )


def over_limit(conn: psycopg.Connection) -> None:
    """Three executions of one key at once (limit 2)."""
    (key,) = one(conn, "SELECT lease_key FROM chaos_ledger WHERE lease_key IS NOT NULL LIMIT 1")
    rows = conn.execute(
        "SELECT nonce FROM chaos_ledger WHERE lease_key = %s AND ok ORDER BY started_at LIMIT 3",
        (key,),
    ).fetchall()
    for (nonce,) in rows:
        conn.execute(
            "UPDATE chaos_ledger SET started_at = '2000-01-01T00:00:00Z', ended_at = "
            "'2000-01-01T00:00:10Z' WHERE nonce = %s",
            (nonce,),
        )
    conn.execute(
        "UPDATE eec_workflow_step_attempt SET finished_at = '2000-01-01T00:00:11Z' WHERE token "
        "IN (SELECT token FROM chaos_ledger WHERE nonce = ANY(%s))",
        ([r[0] for r in rows],),
    )


def leftover_outbox(conn: psycopg.Connection) -> None:
    (run_id,) = one(conn, "SELECT run_id FROM eec_workflow_run LIMIT 1")
    conn.execute(
        "INSERT INTO eec_workflow_outbox (run_id, kind, task, payload) VALUES "
        "(%s, 'wakeup', 'ductor.tick', '{}'::jsonb)",
        (run_id,),
    )


def open_attempt(conn: psycopg.Connection) -> None:
    (token,) = one(
        conn,
        "SELECT token FROM eec_workflow_step_attempt WHERE outcome = "
        "'timed_out' OR outcome = 'cancelled' LIMIT 1",
    )
    conn.execute(
        "UPDATE eec_workflow_step_attempt SET finished_at = NULL, outcome = NULL WHERE token = %s",
        (token,),
    )


def stuck_run(conn: psycopg.Connection) -> None:
    (run_id,) = one(conn, "SELECT run_id FROM eec_workflow_run WHERE status = 'succeeded' LIMIT 1")
    conn.execute("UPDATE eec_workflow_run SET status = 'running' WHERE run_id = %s", (run_id,))


def forged_output(conn: psycopg.Connection) -> None:
    """A run output carries a step value no execution returned."""
    (run_id,) = one(
        conn,
        "SELECT run_id FROM eec_workflow_run WHERE status = 'succeeded' AND "
        "workflow = 'chaos_long' LIMIT 1",
    )
    conn.execute(
        "UPDATE eec_workflow_run SET output = jsonb_set(output, '{v}', '12345') WHERE run_id = %s",
        (run_id,),
    )


MUTATIONS: list[tuple[str, Mutation, str]] = [
    ("a succeeded output differs from its execution", lost_step, "no_lost_step"),
    ("two executions' patches of one step node", double_patch, "applied_once"),
    ("an older generation accepted", stale_accepted, "no_stale_accepted"),
    ("a gap in the transition log", log_gap, "log_contiguous"),
    ("state and log disagree", log_disagrees, "log_replay"),
    ("one token executed twice", claimed_twice, "claimed_once"),
    ("signals consumed out of order", signals_out_of_order, "signals"),
    ("one signal consumed by two nodes", signal_twice, "signals"),
    ("a second child for one node", second_child, "one_child"),
    ("three holders of a limit of two", over_limit, "concurrency"),
    ("an outbox row left", leftover_outbox, "clean_end"),
    ("an attempt left open", open_attempt, "clean_end"),
    ("a run not terminal", stuck_run, "terminal"),
    ("a run output no execution produced", forged_output, "provenance"),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conninfo", required=True, help="libpq conninfo without dbname")
    p.add_argument("--database", default="chaos")
    args = p.parse_args()
    admin = psycopg.connect(f"{args.conninfo} dbname=postgres", autocommit=True)
    base = Checker(sa.create_engine(_url(args.conninfo, args.database), poolclass=sa.pool.NullPool))
    base.run()
    before = base.report()["violations_by_invariant"]
    print("baseline:", {k: v for k, v in before.items() if v} or "no violations")
    missed = 0
    for i, (what, mutate, invariant) in enumerate(MUTATIONS):
        name = f"selftest_{i}"
        admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{args.database}"')
        try:
            with psycopg.connect(f"{args.conninfo} dbname={name}", autocommit=True) as conn:
                mutate(conn)
            engine = sa.create_engine(_url(args.conninfo, name), poolclass=sa.pool.NullPool)
            checker = Checker(engine)
            checker.run()
            engine.dispose()
            after = checker.report()["violations_by_invariant"]
            caught = after[invariant] > before[invariant]
            missed += not caught
            print(f"{'caught' if caught else 'MISSED'}  {invariant:18} {what}")
        except LookupError as exc:
            print(f"skip    {invariant:18} {what}: {exc}")
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return 1 if missed else 0


def _url(conninfo: str, dbname: str) -> str:
    parts = dict(p.split("=", 1) for p in conninfo.split())
    return (
        f"postgresql+psycopg://{parts.get('user', 'postgres')}@{parts.get('host', '127.0.0.1')}"
        f":{parts.get('port', '5432')}/{dbname}"
    )


if __name__ == "__main__":
    sys.exit(main())
