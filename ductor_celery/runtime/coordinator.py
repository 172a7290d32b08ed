"""The coordinator's tick: load -> compute (pure) -> commit (versioned) -> dispatch.

Load and commit share one transaction (one connection, one BEGIN): the commit stays
conditional on ``record_version``, so a racing coordinator still makes this one recompute.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from sqlalchemy.exc import IntegrityError

from ..engine import compute_tick
from ..store import wakes
from ..store.db import with_retry
from ..store.load import load_on
from ..store.outbox import OutboxRow, delete_outbox
from ..store.ticks import VersionConflict, commit_on, reject_control

if TYPE_CHECKING:
    from ..engine import TickPayload
    from .runtime import Runtime

log = logging.getLogger("ductor_celery.coordinator")

MAX_CONFLICT_RETRIES = 50


def run_tick(rt: Runtime, run_id: str) -> str:
    """One tick of one run. Returns "missing", "noop", "committed" or "conflict"."""
    engine = rt.engine()
    # Before the load: a result committed after this point wakes the run again (store/wakes).
    with_retry(functools.partial(wakes.clear_wake, engine, run_id), what="clear wake-up")
    for _ in range(MAX_CONFLICT_RETRIES):
        try:
            outcome, payload, outbox = with_retry(
                functools.partial(_load_compute_commit, rt, run_id), what="tick"
            )
        except VersionConflict as conflict:
            log.debug("run %s: %s; recomputing", run_id, conflict)
            continue
        except _Rejected:
            continue
        if outcome != "committed":
            return outcome
        rt.failpoint("after_commit_before_dispatch")
        if outbox:
            rt.dispatcher.send(outbox)
            sent_ids = [r.id for r in outbox]
            with_retry(functools.partial(delete_outbox, engine, sent_ids), what="clear outbox")
        return "committed"
    log.error("run %s: gave up after %d conflicting ticks", run_id, MAX_CONFLICT_RETRIES)
    return "conflict"


class _Rejected(Exception):
    """A control was rejected by a database rule; the tick is computed again."""


def _load_compute_commit(
    rt: Runtime, run_id: str
) -> tuple[str, TickPayload | None, list[OutboxRow]]:
    engine = rt.engine()
    config = rt.settings.engine_config()
    payload: TickPayload | None = None
    try:
        with engine.begin() as conn:
            loaded_all = load_on(conn, run_id, rt.spec_for, config)
            if loaded_all is None:
                log.warning("tick for unknown run %s ignored", run_id)
                return "missing", None, []
            loaded, spec, inputs = loaded_all
            payload = compute_tick(spec, loaded.state, inputs, loaded.now)
            if not payload.changed:
                return "noop", payload, []
            rt.failpoint("before_commit")
            return "committed", payload, commit_on(conn, loaded, payload)
    except IntegrityError:
        # A redrive reopening the run while another run of its workflow id is open (the client
        # checked, but a start raced it): refuse the redrive, keep the run as it is.
        if payload is None or not payload.reopened or payload.handled_control is None:
            raise
        reject_control(
            engine, payload.handled_control.id, "rejected: another run of this workflow id is open"
        )
        raise _Rejected() from None
