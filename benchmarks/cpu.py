"""CPU time per process group, from /proc: who burns the cores during a phase.

On a small machine the throughput figures are CPU-bound, so "CPU milliseconds per step, by
process" explains them better than wall-clock timers: it shows what the coordinator, the step
worker, PostgreSQL and Redis each spend per unit of work.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, utime + stime in seconds) of a live process."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = data[data.rfind(")") + 2 :].split()
    # fields[0] is field 3 (state): ppid is field 4, utime 14, stime 15.
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK_TCK


def steal_seconds() -> float:
    """CPU time the hypervisor gave to someone else, all cores (/proc/stat "steal")."""
    with open("/proc/stat") as fh:
        fields = fh.readline().split()
    return int(fields[8]) / CLK_TCK if len(fields) > 8 else 0.0


def snapshot() -> dict[int, tuple[int, float]]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                out[int(entry)] = st
    return out


def _descends(pid: int, root: int, snap: dict[int, tuple[int, float]]) -> bool:
    seen = 0
    while pid > 1 and seen < 64:
        if pid == root:
            return True
        pid = snap.get(pid, (0, 0.0))[0]
        seen += 1
    return False


#: The servers' roots: their whole process trees carry the server's name.
SERVERS = ("postgres", "redis", "rabbitmq")


#: PostgreSQL's background processes by their titles (``postgres: checkpointer``, ...).
_POSTGRES_ROLES = (
    (b"autovacuum", "postgres autovacuum"),
    (b"checkpointer", "postgres checkpointer"),
    (b"background writer", "postgres bgwriter"),
    (b"walwriter", "postgres walwriter"),
)


def _postgres_role(pid: int) -> str:
    """A PostgreSQL child's label: its background processes apart from the backends that run
    the benchmark's statements ("postgres"), by the process title."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "postgres"
    for mark, role in _POSTGRES_ROLES:
        if mark in title:
            return role
    return "postgres"


def classify_by_roots(roots: dict[str, int]) -> Callable[[int, dict[int, tuple[int, float]]], str]:
    """Label a pid with the name of the root it descends from ("<name> main" for the root
    itself, "<name> pool" for its descendants), else "other". PostgreSQL's autovacuum
    processes are "postgres autovacuum" (those alive at the phase's end: one that ran and
    exited inside the phase is not counted by ``delta``)."""

    def label(pid: int, snap: dict[int, tuple[int, float]]) -> str:
        for name, root in roots.items():
            if pid == root:
                return name if name in (*SERVERS, "driver") else f"{name} main"
            if _descends(pid, root, snap):
                if name == "postgres":
                    return _postgres_role(pid)
                if name in SERVERS:
                    return name
                return "driver helpers" if name == "driver" else f"{name} pool"
        return "other"

    return label


def delta(
    before: dict[int, tuple[int, float]],
    after: dict[int, tuple[int, float]],
    label: Callable[[int, dict[int, tuple[int, float]]], str],
) -> dict[str, float]:
    """CPU seconds spent between two snapshots, summed per label (new processes count whole)."""
    out: dict[str, float] = {}
    for pid, (_ppid, cpu) in after.items():
        spent = cpu - before.get(pid, (0, 0.0))[1] if pid in before else cpu
        if spent <= 0:
            continue
        name = label(pid, after)
        out[name] = out.get(name, 0.0) + spent
    return out


def _stat_with_children(pid: int) -> tuple[int, float] | None:
    """(parent pid, utime + stime + cutime + cstime in seconds): a process's own CPU and that
    of the children it has reaped (a PostgreSQL backend that exited, a finished subprocess)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = data[data.rfind(")") + 2 :].split()
    # utime, stime, cutime, cstime are fields 14-17.
    return int(fields[1]), sum(int(f) for f in fields[11:15]) / CLK_TCK


def tree_seconds(roots: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each root's process tree, by root name, reaped children
    included: the difference of two readings is what the tree spent between them, even when
    processes in it started or exited meanwhile (as long as the root itself lives)."""
    snap: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat_with_children(int(entry))
            if st is not None:
                snap[int(entry)] = st
    out = dict.fromkeys(roots, 0.0)
    for pid, (_ppid, seconds) in snap.items():
        for name, root in roots.items():
            if _descends(pid, root, snap):
                out[name] += seconds
                break
    return out


def busy_seconds() -> tuple[float, float]:
    """(CPU seconds the whole machine spent busy, all cores; hypervisor steal), from the
    first line of /proc/stat: user + nice + system + irq + softirq (guest time is inside
    user), not idle, iowait or steal."""
    with open("/proc/stat") as fh:
        fields = [int(f) for f in fh.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    steal = fields[7] if len(fields) > 7 else 0
    return (user + nice + system + irq + softirq) / CLK_TCK, steal / CLK_TCK


class OtherLoad:
    """The machine's other load during a window: CPU the whole machine spent (/proc/stat)
    minus what the benchmark's process trees spent (``tree_seconds``), in cores. Unlike the
    per-process "other" of a CPU phase, it also counts processes that started and exited
    inside the window (a test run's short-lived workers)."""

    def __init__(self, roots: dict[str, int]) -> None:
        self.roots = roots
        self.busy0, self.steal0 = busy_seconds()
        self.ours0 = sum(tree_seconds(roots).values())
        self.t0 = time.monotonic()

    def result(self) -> dict[str, float]:
        busy, steal = busy_seconds()
        ours = sum(tree_seconds(self.roots).values()) - self.ours0
        wall = max(time.monotonic() - self.t0, 1e-9)
        total = busy - self.busy0
        return {
            "wall_s": round(wall, 1),
            "machine_cores": round(total / wall, 2),
            "benchmark_cores": round(ours / wall, 2),
            "other_cores": round(max(total - ours, 0.0) / wall, 2),
            "steal_cores": round((steal - self.steal0) / wall, 2),
        }
