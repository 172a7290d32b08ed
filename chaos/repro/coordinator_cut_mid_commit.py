"""Reproduction, on a fleet (docs/fleet.md): a coordinator host cut from the database in the
middle of a tick's commit stalls the other coordinator, and with it the whole fleet, for as
long as the cut lasts; were the host never to come back, for PostgreSQL's TCP keepalive
(``tcp_keepalives_idle`` 7200 s by default) plus its probes: more than two hours.

What happens: coord0's pool child has sent ``UPDATE eec_workflow_run ... record_version`` (the
versioned commit) when its host drops off; its backend stays ``idle in transaction`` holding
the run's row lock (``idle_in_transaction_session_timeout`` is 0). The next tick of that run on
coord1 reads the run row ``FOR UPDATE`` and waits for the lock (``store/load.py``: the
coordinator waits, only eager ticks skip a locked run), no ``lock_timeout``; coord1 runs one
tick at a time (``-c 1``), so it ticks nothing else. Runs need the coordinator for their first
tick, timers, signals and children: within seconds every open run waits for it, no new run
starts, and finished attempts per 5 s go from ~90 to 0.

Here: the fleet harness without faults (``--no-faults``); 15 s in, coord0 is cut from the
database both ways for 45 s; every 5 s the driver prints the backends that are idle in
transaction or waiting for a lock (with ``pg_blocking_pids``) and the attempts finished in the
last 5 s. Needs root. Exits 1 when it reproduces (finished attempts drop to 0 while coord1's
backend waits for the lock of coord0's).

Run: ``PYTHONPATH=. .venv/bin/python chaos/repro/coordinator_cut_mid_commit.py`` (about 2.5 min)

Fixed: every tick now bounds its transaction's idle time and its lock wait
(``store/tick_store.py``, docs/architecture.md "A tick that stalls holding the lock"); the
repro then exits 0 (0 of 9 samples stalled, 240-340 attempts finished per 5 s during the cut).
"""

# ruff: noqa: T201

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

CHAOS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(CHAOS), str(CHAOS.parent / "tests"), str(CHAOS.parent)]

import psycopg  # noqa: E402
import run as chaos_run  # noqa: E402
from fleet_run import FleetHarness  # noqa: E402

CUT_AT_S, CUT_FOR_S = 15.0, 45.0
SEEN: list[dict[str, Any]] = []


def experiment(h: FleetHarness) -> None:
    time.sleep(CUT_AT_S)
    h.fleet.partition("coord0", "db")
    t_cut = time.monotonic()
    chaos_run.say(f"coord0 cut from the database (both ways) for {CUT_FOR_S:.0f} s")
    with psycopg.connect(h.pg.conninfo("chaos"), autocommit=True) as mon:
        while time.monotonic() - t_cut < CUT_FOR_S:
            time.sleep(5)
            rows = mon.execute(
                "SELECT pid, client_addr::text, state, wait_event, (now() - xact_start)::text,"
                " pg_blocking_pids(pid)::text, left(query, 70) FROM pg_stat_activity"
                " WHERE datname = 'chaos' AND (state = 'idle in transaction'"
                " OR wait_event_type = 'Lock')"
            ).fetchall()
            done = mon.execute(
                "SELECT count(*) FROM eec_workflow_step_attempt"
                " WHERE finished_at > now() - interval '5 seconds'"
            ).fetchone()
            SEEN.append(
                {
                    "t": round(time.monotonic() - t_cut, 1),
                    "attempts_finished_last_5s": done[0] if done else None,
                    "backends": [list(r) for r in rows],
                }
            )
            chaos_run.say(json.dumps(SEEN[-1], default=str))
    h.fleet.heal("coord0")
    chaos_run.say("coord0 healed")


def main() -> int:
    args = chaos_run.parse_args(["--fleet", "--minutes", "1.5", "--no-faults", "--seed", "5"])
    with contextlib.ExitStack() as stack:
        harness = FleetHarness(args, stack)
        harness.setup()
        threading.Thread(target=experiment, args=(harness,), daemon=True).start()
        harness.run()
    coord1 = harness.fleet.addr("coord1") if harness.fleet.hosts else "10.213.7.16"
    stalled = [
        s
        for s in SEEN
        if s["attempts_finished_last_5s"] == 0
        and any(str(b[1]).startswith(coord1) and b[5] not in ("{}", None) for b in s["backends"])
    ]
    print(f"{len(stalled)} of {len(SEEN)} samples: no attempt finished, coord1 waiting on a lock")
    return 1 if stalled else 0


if __name__ == "__main__":
    sys.exit(main())
