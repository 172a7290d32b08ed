"""The ``ductor`` command; also ``celery -A app ductor ...`` (the celery.commands entry point).

Every error prints one line on stderr and exits non-zero; read commands take ``--json``.

The group and the helpers its commands share are in ``base.py``; each command registers itself
on the group when its module is imported, as this package does:

- ``runs.py``: start, runs, show, signal, approve, reject;
- ``controls.py``: pause, resume, cancel, terminate, redrive, continue-as-new (one run or many);
- ``schedules.py``: schedules, schedule add/remove/pause/resume/trigger;
- ``web.py``: web, the console;
- ``admin.py``: migrate, doctor, graph, prune, audit;
- ``export.py``: export, a run as JSON (docs/replay.md).
"""

from __future__ import annotations

# Imported for the commands they register on ``ductor``.
from . import admin, controls, export, runs, schedules, web  # noqa: F401
from .base import ductor

__all__ = ["ductor", "main"]


def main() -> None:
    ductor(obj=None)
