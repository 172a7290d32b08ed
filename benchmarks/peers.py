"""Peers beside raw Celery (``run.py --peers dbos``): DBOS, in a venv of its own.

DBOS pins its own versions of SQLAlchemy, psycopg and more; installed into the project venv it
would move the versions everyone else tests against. So ``benchmarks/.venv-dbos`` (gitignored)
is created on demand (``python -m venv`` + ``pip install dbos``) and the DBOS side,
``dbos_peer.py``, runs as a subprocess of that venv's Python, pointed at a database of its own
on the benchmark's private PostgreSQL. A peer that cannot be installed or run is reported
with a one-line reason; the benchmark goes on without it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from common import BENCH_DIR, log
from harness import Bench

DBOS_VENV = BENCH_DIR / ".venv-dbos"
DBOS_DATABASE = "dbos_bench"
#: pip's own time limit for the one-off install.
INSTALL_TIMEOUT_S = 600.0


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "no output"


def dbos_python() -> tuple[Path | None, str | None]:
    """DBOS's venv's Python, created and filled if missing: (path, None), or (None, why not)."""
    python = DBOS_VENV / "bin" / "python"
    check = [str(python), "-c", "import dbos"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python, None
    log(f"DBOS peer: creating {DBOS_VENV} (python -m venv, pip install dbos)")
    try:
        # The base interpreter, not this venv's: a venv of a venv would see its packages.
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run(
            [base, "-m", "venv", str(DBOS_VENV)], capture_output=True, text=True, check=True
        )
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", "dbos"],
            capture_output=True,
            text=True,
            check=True,
            timeout=INSTALL_TIMEOUT_S,
        )
    except subprocess.CalledProcessError as exc:
        return None, f"installing dbos failed: {_one_line(exc.stderr or exc.stdout or '')}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"installing dbos failed: {exc}"
    if subprocess.run(check, capture_output=True).returncode != 0:
        return None, "dbos installed but does not import"
    return python, None


class DbosPeer:
    """The DBOS side of each round: ``measure`` runs ``dbos_peer.py`` once."""

    def __init__(self, bench: Bench, python: Path) -> None:
        self.bench = bench
        self.python = python
        bench.pg.create_database(DBOS_DATABASE)
        # DBOS builds its own engine (psycopg 3) from a plain libpq URL.
        self.url = bench.pg.url(DBOS_DATABASE).replace("postgresql+psycopg://", "postgresql://")

    @classmethod
    def start(cls, bench: Bench) -> DbosPeer | dict[str, Any]:
        """The peer, or ``{"available": False, "why": ...}``."""
        python, why = dbos_python()
        if python is None:
            log(f"DBOS peer: not available ({why})")
            return {"available": False, "why": why}
        try:
            return cls(bench, python)
        except Exception as exc:  # noqa: BLE001 - a peer must never stop the benchmark
            log(f"DBOS peer: not available ({exc!r})")
            return {"available": False, "why": repr(exc)}

    def measure(self) -> dict[str, Any]:
        """One DBOS round: the 10-step workflow's latency, then the queue's throughput, with
        the same sizes as ductor's phases. Never raises: a failure is the round's result."""
        args = self.bench.args
        cmd = [
            str(self.python),
            str(BENCH_DIR / "dbos_peer.py"),
            "--url", self.url,
            "--pg-pid", str(self.bench.pg._proc.pid),  # type: ignore[union-attr]
            "--runs", str(args.runs),
            "--warmup", str(args.warmup),
            "--concurrent", str(args.concurrent_runs),
            "--timeout", str(args.phase_timeout),
        ]  # fmt: skip
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=2 * args.phase_timeout
            )
        except subprocess.TimeoutExpired:
            return {"available": False, "why": f"dbos_peer.py took over {2 * args.phase_timeout}s"}
        if done.returncode != 0:
            return {"available": False, "why": f"dbos_peer.py failed: {_one_line(done.stderr)}"}
        try:
            res: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return {"available": False, "why": f"no JSON from dbos_peer.py: {done.stdout[-200:]}"}
        res["available"] = True
        log(
            f"DBOS: 10-step workflow p50 {res['latency']['p50_ms']} ms; queue "
            f"{res['queue']['steps_per_s']} steps/s, {res['queue']['cpu_ms_per_step']} ms CPU/step"
        )
        return res
