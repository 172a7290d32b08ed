"""``celery worker`` processes for the benchmark, which never outlive the benchmark.

Each worker runs in its own session (a Ctrl-C in the terminal reaches only the driver, which
then stops the workers in order) and has a tiny ``sh`` watchdog: if the driver dies without
cleaning up (SIGKILL, OOM), the watchdog stops the worker's whole process group within a second.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent

# Arguments: owner pid, worker pid (= its process group). Polls while the owner lives; when the
# owner vanishes, TERM the group, then KILL it after ten seconds.
_WATCHDOG_SH = r"""
owner=$1 pg=$2
while kill -0 "$owner" 2>/dev/null; do
    kill -0 "$pg" 2>/dev/null || exit 0
    sleep 1
done
kill -s TERM -- "-$pg" 2>/dev/null
n=0
while kill -0 "$pg" 2>/dev/null && [ "$n" -lt 100 ]; do sleep 0.1; n=$((n + 1)); done
kill -s KILL -- "-$pg" 2>/dev/null
"""


class Worker:
    """One ``celery -A <app> worker ...`` process (its pool children live in its group)."""

    def __init__(
        self,
        name: str,
        app: str,
        args: list[str],
        env: dict[str, str],
        logdir: Path,
        prefix: list[str] | None = None,
    ):
        """``prefix``: a command the worker runs behind, e.g. ``ip netns exec <ns>`` to put it on
        a host of its own (benchmarks/scaling.py); it must exec the worker, so that the pid
        signalled is the worker's own."""
        self.name = name
        self.log_path = logdir / f"{name}.log"
        # bench_app's worker_ready handler writes this file (see BENCH_READY_DIR).
        self.ready_file = Path(env["BENCH_READY_DIR"]) / name
        self.ready_file.unlink(missing_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.cmd = [
            *(prefix or []),
            sys.executable, "-m", "celery", "-A", app, "worker", *args, "-n", f"{name}@%h",
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=BENCH_DIR,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._watchdog = subprocess.Popen(
            ["sh", "-c", _WATCHDOG_SH, "watchdog", str(os.getpid()), str(self.proc.pid)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    @property
    def command(self) -> str:
        return " ".join(self.cmd[self.cmd.index("celery") : -2])

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited:\n{self.log_tail()}")
            if self.ready_file.exists():
                return
            time.sleep(0.05)
        raise RuntimeError(f"worker {self.name} not ready in {timeout}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def child_pids(self) -> list[int]:
        out = subprocess.run(
            ["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True, check=False
        ).stdout
        return [int(p) for p in out.split()]

    def rss_kb(self) -> dict[str, int]:
        """Resident memory (VmRSS, kB) of the main process and of its pool children."""
        main = _vmrss_kb(self.proc.pid)
        children = [_vmrss_kb(pid) for pid in self.child_pids()]
        return {
            "main_kb": main,
            "children_kb": sum(children),
            "children": len(children),
            "total_kb": main + sum(children),
        }

    def terminate(self) -> None:
        """Ask for a warm shutdown (SIGTERM to the main process only: its pool children then
        exit cleanly, which lets them dump profiles)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)

    def stop(self, timeout: float = 15.0) -> None:
        """Warm shutdown, then SIGKILL the whole group if it takes too long."""
        self.terminate()
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # Whatever is left in the group (a stuck pool child) goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        if self._watchdog.poll() is None:
            self._watchdog.kill()
        self._watchdog.wait()
        self._log.close()


def _vmrss_kb(pid: int) -> int:
    """VmRSS of a live process in kB (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
