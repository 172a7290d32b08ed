"""Real ``celery worker`` processes for end-to-end tests, pointed at a private database.

A Cluster is one database plus a Redis db index, and the workers the test starts: a step
worker (``-Q ductor-steps``) and a coordinator (``-Q ductor-coord -c 1``), exactly the commands
a user runs. Tests can SIGKILL them, start them again, and pass failpoint settings through the
environment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

TESTS_DIR = Path(__file__).resolve().parent
ROOT_DIR = TESTS_DIR.parent


class Worker:
    def __init__(
        self,
        name: str,
        args: list[str],
        env: dict[str, str],
        log_path: Path,
        app: str = "e2e_app",
        cwd: Path = TESTS_DIR,
    ) -> None:
        self.name = name
        self.log_path = log_path
        self.command = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            app,
            "worker",
            "-n",
            f"{name}@%h",
            "--without-mingle",
            "--without-gossip",
            "-l",
            "INFO",
            *args,
        ]
        self.env = env
        self.cwd = cwd
        self.crashes: list[str] = []
        self._spawn()

    def _spawn(self) -> None:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.command,
            cwd=self.cwd,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def restart_if_exited(self) -> bool:
        """A supervisor's job (systemd's Restart=always): start the worker again if it exited
        on its own, keeping the log's lines about why in ``crashes``."""
        if self.proc.poll() is None:
            return False
        self.crashes.append(
            "\n".join(
                line
                for line in self.log_tail(400).splitlines()
                if "Error" in line or "CRITICAL" in line
            )
        )
        self._log.close()
        self._spawn()
        return True

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited:\n{self.log_tail()}")
            if b" ready." in self.log_path.read_bytes():
                return
            time.sleep(0.1)
        raise RuntimeError(f"worker {self.name} not ready in {timeout}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def child_pids(self) -> list[int]:
        out = subprocess.run(
            ["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True, check=False
        ).stdout
        return [int(p) for p in out.split()]

    def kill(self) -> None:
        """SIGKILL the whole worker (main process and pool children)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()

    def stop(self, timeout: float = 15.0) -> None:
        self.ask_to_stop()
        self.wait_stopped(time.monotonic() + timeout)

    def ask_to_stop(self) -> None:
        """SIGTERM (Celery's warm shutdown), without waiting: ``wait_stopped`` waits."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)

    def wait_stopped(self, deadline: float) -> None:
        """Wait for the exit ``ask_to_stop`` asked for until ``deadline`` (monotonic), then
        SIGKILL."""
        if self.proc.poll() is None:
            try:
                self.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


class Cluster:
    def __init__(
        self,
        database_url: str,
        broker_url: str,
        workdir: Path,
        app: str = "e2e_app",
        cwd: Path = TESTS_DIR,
        **env: str,
    ) -> None:
        self.app = app
        self.cwd = cwd
        self.database_url = database_url
        self.broker_url = broker_url
        self.workdir = workdir
        self.env = {
            **os.environ,
            "DUCTOR_DATABASE_URL": database_url,
            "E2E_BROKER_URL": broker_url,
            "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
            **env,
        }
        self.workers: list[Worker] = []
        self.engine = sa.create_engine(database_url, poolclass=sa.pool.NullPool)
        self._supervising = threading.Event()
        self._supervisor: threading.Thread | None = None

    def supervise(self) -> None:
        """Restart workers that exit on their own, every 0.5 s, as a deployment's supervisor
        would (README: production set-up). Celery/kombu workers can exit on a broker
        reconnection; ``Worker.crashes`` keeps why."""

        def loop() -> None:
            while not self._supervising.wait(0.5):
                for worker in list(self.workers):
                    worker.restart_if_exited()

        self._supervisor = threading.Thread(target=loop, name="supervisor", daemon=True)
        self._supervisor.start()

    def start_steps(
        self,
        concurrency: int = 2,
        name: str = "steps",
        pool: str | None = None,
        queues: str = "ductor-steps",
        **env: str,
    ) -> Worker:
        """A step worker; ``pool``: Celery's ``-P`` (prefork when ``None``); ``queues``: its
        ``-Q``."""
        pool_args = ["-P", pool] if pool else []
        return self._start(name, ["-Q", queues, "-c", str(concurrency), *pool_args], env)

    def start_coordinator(self, name: str = "coord", **env: str) -> Worker:
        return self._start(name, ["-Q", "ductor-coord", "-c", "1"], env)

    def _start(self, name: str, args: list[str], env: dict[str, str]) -> Worker:
        worker = Worker(
            f"{name}{len(self.workers)}",
            args,
            {**self.env, **env},
            self.workdir / f"{name}{len(self.workers)}.log",
            app=self.app,
            cwd=self.cwd,
        )
        worker.wait_ready()
        self.workers.append(worker)
        return worker

    def stop(self) -> None:
        self._supervising.set()
        if self._supervisor is not None:
            self._supervisor.join()
        # Every worker's warm shutdown at once, each with the same 15 s as a stop() of its own:
        # one after the other, a cluster's teardown took the sum of its workers' shutdowns.
        for worker in self.workers:
            worker.ask_to_stop()
        deadline = time.monotonic() + 15.0
        for worker in self.workers:
            worker.wait_stopped(deadline)
        self.engine.dispose()

    def discard(self) -> None:
        """The end of a test's cluster (the fixtures' teardown): SIGKILL every worker at once.
        Nothing is asserted after a test, and its database is never used again, so a warm
        shutdown only waited for running steps and the next broker poll (some 5 s under
        ``-P gevent``). Tests that stop workers as part of what they check use ``stop()``."""
        self._supervising.set()
        if self._supervisor is not None:
            self._supervisor.join()
        for worker in self.workers:
            worker.kill()
        self.engine.dispose()

    def logs(self) -> str:
        """Each worker's state (running, or its exit code) and the tail of its log."""
        return "\n\n".join(
            f"== {w.name} ({'running' if w.proc.poll() is None else f'exited {w.proc.poll()}'})"
            f" ==\n{w.log_tail(60 if w.proc.poll() is None else 400)}"
            for w in self.workers
        )

    def diagnosis(self, run_id: str) -> str:
        """What a test prints when a run did not finish: its row, its attempts, the logs."""
        with self.engine.connect() as conn:
            run = conn.execute(
                sa.text(
                    "SELECT status, record_version, updated_at FROM eec_workflow_run"
                    " WHERE run_id = :r"
                ),
                {"r": run_id},
            ).first()
        attempts = "\n".join(map(str, self.attempts(run_id)))
        return f"run {run_id}: {run}\nattempts:\n{attempts}\n\n{self.logs()}"

    # -- ledger: what steps actually executed, written by the steps themselves ------------

    def executions(self, run_id: str, node: str | None = None) -> int:
        query = "SELECT count(*) FROM e2e_ledger WHERE run_id = :r"
        params: dict[str, Any] = {"r": run_id}
        if node is not None:
            query += " AND node = :n"
            params["n"] = node
        with self.engine.connect() as conn:
            return int(conn.execute(sa.text(query), params).scalar_one())

    def attempts(self, run_id: str) -> list[Any]:
        with self.engine.connect() as conn:
            return list(
                conn.execute(
                    sa.text(
                        "SELECT token, node, outcome, folded, claimed_at, finished_at "
                        "FROM eec_workflow_step_attempt WHERE run_id = :r ORDER BY token"
                    ),
                    {"r": run_id},
                )
            )

    def record_version(self, run_id: str) -> int:
        with self.engine.connect() as conn:
            return int(
                conn.execute(
                    sa.text("SELECT record_version FROM eec_workflow_run WHERE run_id = :r"),
                    {"r": run_id},
                ).scalar_one()
            )
