"""Micro-benchmark of the run state's codec on the hot path (engine/state.py).

Every tick reads the run row's state (``RunState.from_json``), copies it (``compute_tick``
never modifies its input) and writes it back (``to_json``). The state here is a run with 10
step nodes (4 succeeded, 4 running with an attempt in flight, 1 waiting for a retry, 1
pending) and one scatter with 64 branches in flight. It is built from its stored JSON, so
the same numbers can be taken for a tree from before or after a change of the classes.
Best of 7 runs of 2,000 each, in µs.

    python benchmarks/state_codec.py            # this checkout
    python benchmarks/state_codec.py /other/checkout   # the same numbers for another tree
"""

from __future__ import annotations

import sys
import timeit
from typing import Any

if len(sys.argv) > 1:
    sys.path.insert(0, sys.argv[1])

from ductor_celery.engine.state import RunState  # noqa: E402

RUN = "0123456789abcdef0123456789abcdef"
AT = "2026-01-01T00:00:{:02d}+00:00"
N = 2_000


def _step(i: int) -> dict[str, Any]:
    node = f"s{i}"
    if i < 4:  # succeeded
        return {
            "status": "succeeded",
            "generation": 1,
            "attempt": 1,
            "started_at": AT.format(i),
            "finished_at": AT.format(i + 1),
            "output_token": f"{RUN}:{node}:1",
        }
    if i < 8:  # an attempt in flight, claimed
        return {
            "status": "running",
            "generation": 2,
            "attempt": 2,
            "token": f"{RUN}:{node}:2",
            "check_at": AT.format(40),
            "claimed_at": AT.format(20),
            "started_at": AT.format(i),
        }
    if i == 8:  # a retry pending
        return {
            "status": "running",
            "generation": 1,
            "attempt": 1,
            "retry_at": AT.format(30),
            "error": {"type": "ValueError", "message": "boom"},
            "started_at": AT.format(i),
        }
    return {"status": "pending"}


def stored_state() -> dict[str, Any]:
    nodes = {f"s{i}": _step(i) for i in range(10)}
    branches = {
        str(b): {
            "token": f"{RUN}:each:{b + 1}",
            "generation": b + 1,
            "attempt": 1,
            "check_at": AT.format(50),
            "resend_at": AT.format(45),
        }
        for b in range(64)
    }
    nodes["each"] = {
        "status": "running",
        "generation": 64,
        "started_at": AT.format(10),
        "scatter": {"run": RUN, "base": 0, "total": 500, "next": 64, "branches": branches},
    }
    return {"status": "running", "nodes": nodes, "context": {"k": 1}, "transitions": 90}


def best(stmt: str, scope: dict[str, Any]) -> float:
    return min(timeit.repeat(stmt, number=N, repeat=7, globals=scope)) / N * 1e6


def report(label: str, stmt: str, scope: dict[str, Any]) -> None:
    sys.stdout.write(f"{label:<24}{best(stmt, scope):8.1f} us\n")


def main() -> None:
    data = stored_state()
    state = RunState.from_json(data)
    assert state.to_json() == data, "the state does not round-trip"
    scope: dict[str, Any] = {"RunState": RunState, "data": data, "state": state}
    report("RunState.from_json", "RunState.from_json(data)", scope)
    report("RunState.copy", "state.copy()", scope)
    report("RunState.to_json", "state.to_json()", scope)


if __name__ == "__main__":
    main()
