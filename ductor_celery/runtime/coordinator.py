"""The coordinator's tick: load -> compute (pure) -> commit (versioned) -> dispatch."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from sqlalchemy.exc import IntegrityError

from ..engine import compute_tick
from ..store.db import with_retry
from ..store.load import load_tick
from ..store.ticks import VersionConflict, commit_tick, delete_outbox, reject_control

if TYPE_CHECKING:
    from .runtime import Runtime

log = logging.getLogger("ductor_celery.coordinator")

MAX_CONFLICT_RETRIES = 50


def run_tick(rt: Runtime, run_id: str) -> str:
    """One tick of one run. Returns "missing", "noop" or "committed" (for logs and tests)."""
    engine = rt.engine()
    config = rt.settings.engine_config()
    for _ in range(MAX_CONFLICT_RETRIES):
        loaded_all = with_retry(
            lambda: load_tick(engine, run_id, rt.spec_for, config), what="load run"
        )
        if loaded_all is None:
            log.warning("tick for unknown run %s ignored", run_id)
            return "missing"
        loaded, spec, inputs = loaded_all
        payload = compute_tick(spec, loaded.state, inputs, loaded.now)
        if not payload.changed:
            return "noop"
        rt.failpoint("before_commit")
        try:
            outbox = with_retry(
                functools.partial(commit_tick, engine, loaded, payload), what="commit tick"
            )
        except VersionConflict as conflict:
            log.debug("run %s: %s; recomputing", run_id, conflict)
            continue
        except IntegrityError:
            # A redrive reopening the run while another run of its workflow id is open (the
            # client checked, but a start raced it): refuse the redrive, keep the run as it is.
            if not payload.reopened or payload.handled_control is None:
                raise
            reject_control(
                engine,
                payload.handled_control.id,
                "rejected: another run of this workflow id is open",
            )
            continue
        rt.failpoint("after_commit_before_dispatch")
        if outbox:
            rt.dispatcher.send(outbox)
            sent_ids = [r.id for r in outbox]
            with_retry(functools.partial(delete_outbox, engine, sent_ids), what="clear outbox")
        return "committed"
    log.error("run %s: gave up after %d conflicting ticks", run_id, MAX_CONFLICT_RETRIES)
    return "conflict"
