"""CPU time per process group, from /proc: who burns the cores during a phase.

On a small machine the throughput figures are CPU-bound, so "CPU milliseconds per step, by
process" explains them better than wall-clock timers: it shows what the coordinator, the step
worker, PostgreSQL and Redis each spend per unit of work.
"""

from __future__ import annotations

import os
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


def classify_by_roots(roots: dict[str, int]) -> Callable[[int, dict[int, tuple[int, float]]], str]:
    """Label a pid with the name of the root it descends from ("<name> main" for the root
    itself, "<name> pool" for its descendants), else "other"."""

    def label(pid: int, snap: dict[int, tuple[int, float]]) -> str:
        for name, root in roots.items():
            if pid == root:
                return f"{name}" if name in ("postgres", "redis", "driver") else f"{name} main"
            if _descends(pid, root, snap):
                if name in ("postgres", "redis"):
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
