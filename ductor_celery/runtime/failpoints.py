"""Fault injection for tests: crash the process at a named point, once, when asked to.

Enabled only by environment variables, so production code paths carry a cheap no-op:

    DUCTOR_FAILPOINT=after_commit_before_dispatch   # which point
    DUCTOR_FAILPOINT_MARKER=/tmp/fired              # fire once: only while this file is absent
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("ductor_celery.failpoints")


#: Read once: a fault test sets these for a process before it starts (a worker's
#: environment), and a step passes several failpoints, each a lookup in ``os.environ`` if
#: read there (about 1% of an inline step's CPU).
_ARMED = os.environ.get("DUCTOR_FAILPOINT")


def failpoint(name: str) -> None:
    if _ARMED != name:
        return
    marker = os.environ.get("DUCTOR_FAILPOINT_MARKER")
    if marker:
        if os.path.exists(marker):
            return
        with open(marker, "w") as fh:
            fh.write(name)
    log.critical("failpoint %s: exiting the process now", name)
    os._exit(137)
