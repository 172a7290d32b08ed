"""The harness's ``celery worker`` processes: start, SIGKILL, SIGSTOP/SIGCONT, restart.

Each worker is the production command (``celery -A app worker -Q ductor-steps -c 2`` or
``... -Q ductor-coord -c 1``) run from ``chaos/``, in a session of its own (so signals reach
its pool children as a group and a Ctrl-C reaches only the driver), with a tiny ``sh``
watchdog that takes the whole group down if the driver dies without cleaning up (the pattern
of ``benchmarks/workers.py``).

Failpoints: a worker may be started with ``DUCTOR_FAILPOINT=<point>`` and a marker file
(``DUCTOR_FAILPOINT_MARKER``). ductor fires a failpoint only while its marker file is absent,
and creates the marker when it fires; the harness creates the marker up front (disarmed), so
deleting it arms the failpoint for exactly one firing, with no restart.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

CHAOS_DIR = Path(__file__).resolve().parent

_WATCHDOG_SH = r"""
owner=$1 pg=$2
while kill -0 "$owner" 2>/dev/null; do
    kill -0 "$pg" 2>/dev/null || exit 0
    sleep 1
done
kill -s CONT -- "-$pg" 2>/dev/null
kill -s TERM -- "-$pg" 2>/dev/null
n=0
while kill -0 "$pg" 2>/dev/null && [ "$n" -lt 100 ]; do sleep 0.1; n=$((n + 1)); done
kill -s KILL -- "-$pg" 2>/dev/null
"""


class Worker:
    """One worker process group. ``start()`` may be called again after ``kill()``."""

    def __init__(
        self,
        name: str,
        role: str,
        args: list[str],
        env: dict[str, str],
        logdir: Path,
        ready_dir: Path,
        failpoint: str | None = None,
    ) -> None:
        self.name = name
        self.role = role  # "steps" or "coord"
        self.args = args
        self.logdir = logdir
        self.ready_file = ready_dir / name
        self.failpoint = failpoint
        self.marker = logdir / f"failpoint-{name}" if failpoint else None
        self.env = {**env, "CHAOS_WORKER_NAME": name, "CHAOS_READY_DIR": str(ready_dir)}
        if failpoint and self.marker is not None:
            self.env.update(DUCTOR_FAILPOINT=failpoint, DUCTOR_FAILPOINT_MARKER=str(self.marker))
            self.marker.write_text("disarmed")
        self.proc: subprocess.Popen[bytes] | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._log = None
        self.stopped = False  # SIGSTOPped by the nemesis
        self.expected_down = False  # killed by the nemesis, which restarts it itself
        self.starts = 0
        self.crashes: list[dict[str, object]] = []  # exits nobody asked for
        self.lock = threading.RLock()

    @property
    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "celery", "-A", "app", "worker", *self.args,
            "-n", f"{self.name}@%h", "--without-mingle", "--without-gossip", "-l", "WARNING",
        ]  # fmt: skip

    @property
    def log_path(self) -> Path:
        return self.logdir / f"{self.name}.log"

    def start(self) -> None:
        self.ready_file.unlink(missing_ok=True)
        self._close_log()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in _close_log
        self._log.write(f"\n==== start #{self.starts + 1} at {time.time():.3f}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(
            self.command,
            cwd=CHAOS_DIR,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._watchdog = subprocess.Popen(
            ["sh", "-c", _WATCHDOG_SH, "chaos-watchdog", str(os.getpid()), str(self.proc.pid)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.stopped = False
        self.starts += 1

    def wait_ready(self, timeout: float = 90.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            if self.ready_file.exists():
                return True
            time.sleep(0.05)
        return False

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def ready(self) -> bool:
        return self.alive and self.ready_file.exists()

    def pids(self) -> list[int]:
        """The main process and its pool children."""
        if not self.alive:
            return []
        assert self.proc is not None
        out = subprocess.run(
            ["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True, check=False
        ).stdout
        return [self.proc.pid, *(int(p) for p in out.split())]

    def child_pids(self) -> list[int]:
        return sorted(self.pids()[1:])

    def _group(self, sig: signal.Signals) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole group (main process and pool children): a crash."""
        if self.proc is None:
            return
        self._group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._stop_watchdog()
        self.stopped = False

    def kill_child(self, index: int) -> int | None:
        """SIGKILL one pool child (mid-step or mid-tick); Celery's main process replaces it."""
        children = self.child_pids()
        if not children:
            return None
        pid = children[index % len(children)]
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return pid

    def pause(self) -> None:
        self._group(signal.SIGSTOP)
        self.stopped = True

    def resume(self) -> None:
        self._group(signal.SIGCONT)
        self.stopped = False

    def arm_failpoint(self) -> bool:
        """Let the failpoint fire once (it re-creates the marker as it fires)."""
        if self.marker is None:
            return False
        self.marker.unlink(missing_ok=True)
        return True

    def disarm_failpoint(self) -> None:
        if self.marker is not None and not self.marker.exists():
            self.marker.write_text("disarmed")

    def failpoint_fired(self) -> bool:
        return self.marker is not None and self.marker.exists()

    def stop(self, timeout: float = 15.0) -> None:
        """Warm shutdown (SIGTERM), SIGKILL of the group if it takes too long."""
        if self.proc is not None and self.proc.poll() is None:
            self._group(signal.SIGCONT)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self._group(signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
        self._stop_watchdog()
        self._close_log()

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            if self._watchdog.poll() is None:
                self._watchdog.kill()
            self._watchdog.wait()
            self._watchdog = None

    def _close_log(self) -> None:
        if self._log is not None:
            with contextlib.suppress(OSError):
                self._log.close()
            self._log = None

    def restart_if_crashed(self, t: float) -> bool:
        """A supervisor's job (systemd's Restart=always): start a worker that exited on its
        own again, noting why it exited. Returns True if it did."""
        with self.lock:
            if self.expected_down or self.proc is None or self.proc.poll() is None:
                return False
            why = next(
                (
                    line
                    for line in reversed(self.log_tail(400).splitlines())
                    if "Unrecoverable error" in line or "CRITICAL" in line
                ),
                "",
            )
            self.crashes.append({"t": round(t, 2), "exit": self.proc.returncode, "why": why[-300:]})
            self._stop_watchdog()
            self.start()
        self.wait_ready(90)
        return True

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])
