"""The claim of a held branch (runtime/inline.py, "Held branches" and "Bundled messages" in
docs/architecture.md): the first of the branches a worker holds that it can still claim, and
the outcome of the branch it ran before, in one statement.

A worker holding branches of a quick scatter runs them one after another. Each of them cost
two statements, the outcome of one written alone and then the next one's claim, and many of
those claims failed: another worker's chain had adopted the branch and claimed it first, or
a bundle's worker found what it carried taken. Here one autocommit statement writes the
outcome (the same SET and WHERE as ``attempts.finish_unleased_on``) and claims, among the
held tokens in their order, the first one still unclaimed and open, skipping the others; a
row another statement holds locked at that moment is skipped too (``SKIP LOCKED``: most
often another worker's claim taking it; a branch skipped otherwise, still unclaimed, is
re-sent after ``ductor_resend_unclaimed_after`` or claimed by a message it still has).

An attempt with a rate limit (its node's or its step's) or a concurrency lease is not
claimed here: found first, it is named (``HeldClaim.ordinary``), and the caller claims it
with the ordinary claim, which takes its bucket's token or checks its slot, or marks it
waiting in line (docs/flow-control.md).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from psycopg.rows import namedtuple_row
from sqlalchemy.engine import Engine

from ..engine.inputs import AttemptResult
from .attempts import CARRIED_WHERE, OUTCOME_SET, ClaimedAttempt, carried_params, claimed_attempt
from .db import ValuesRefused, autocommit, driver_cursor, one_line_cause, refusing_values


@dataclass(frozen=True, slots=True)
class HeldClaim:
    """What ``claim_first`` did: the next attempt claimed, if any, or the next one to claim
    with the ordinary claim (``ordinary``: it has a rate limit, whose claim takes a token
    from its bucket, or a concurrency lease, whose claim checks its slot); the tokens before
    either in the list were not claimable. And whether the outcome was written (None: none
    given; False: the attempt was finished or closed already, or holds a lease:
    ``attempts.finish`` then takes it)."""

    claimed: ClaimedAttempt | None
    written: bool | None
    ordinary: str | None = None

    @property
    def through(self) -> str | None:
        """The last token this claim has dealt with: those up to it are done with."""
        return self.claimed.token if self.claimed is not None else self.ordinary


_CLAIMED_COLUMNS = (
    "a.token, a.run_id, a.node, a.branch, a.generation, a.attempt, a.step, a.args, "
    "a.created_at, a.claimed_at, a.cancel_requested_at, r.workflow_id, r.spec_hash, "
    "r.state -> 'context' AS context, r.workflow, r.trace_context"
)


@functools.cache
def _statement(finishing: bool) -> str:
    finished = (
        f"finished AS (UPDATE eec_workflow_step_attempt SET {OUTCOME_SET} "
        f"WHERE {CARRIED_WHERE} RETURNING 1), "
        if finishing
        else ""
    )
    written = "(SELECT count(*) FROM finished)" if finishing else "NULL::bigint"
    # The outcome's row locked before the next one's, the order a tick's commit closing
    # both would take (no two statements wait on each other in a cycle).
    after_finished = " AND (SELECT count(*) FROM finished) >= 0" if finishing else ""
    return (
        f"WITH {finished}"
        "next AS (SELECT a.token, a.rate_key IS NULL AND a.lease_key IS NULL AS plain "
        "FROM unnest(%(n_tokens)s::varchar[]) WITH ORDINALITY AS c(token, i) "
        "JOIN eec_workflow_step_attempt a ON a.token = c.token "
        "WHERE (a.claimed_at IS NULL OR a.claimed_by = %(n_worker)s) AND a.finished_at IS NULL "
        f"AND a.step = %(n_step)s{after_finished} "
        # A retry whose first try's answer was lost finds its own claim first (an earlier
        # token it skipped then, row-locked at that moment, may be claimable now).
        "ORDER BY a.claimed_by IS NOT DISTINCT FROM %(n_worker)s DESC, c.i "
        "LIMIT 1 FOR UPDATE OF a SKIP LOCKED), "
        # Claimed here only with no rate limit and no lease: the ordinary claim takes a
        # rate-limited one's token, or checks a leased one's slot (``HeldClaim.ordinary``).
        "claimed AS (UPDATE eec_workflow_step_attempt a "
        "SET claimed_at = now(), claimed_by = %(n_worker)s, carrier = %(n_carrier)s "
        "FROM next, eec_workflow_run r "
        "WHERE a.token = next.token AND next.plain AND r.run_id = a.run_id "
        f"RETURNING {_CLAIMED_COLUMNS}) "
        f"SELECT {written} AS written, next.token AS next_token, next.plain, claimed.* "
        "FROM (SELECT 1) AS one LEFT JOIN next ON true LEFT JOIN claimed ON true"
    )


@refusing_values()
def claim_first(
    engine: Engine,
    tokens: Sequence[str],
    worker: str,
    *,
    run_id: str,
    step: str,
    carrier: str | None,
    finished: AttemptResult | None = None,
) -> HeldClaim:
    """Claim for ``worker`` the first of ``tokens`` (attempts of ``step`` in run ``run_id``:
    a token of another run is never claimed) that can still be claimed, writing ``finished``
    first if given (an outcome as a tick carries it: ``attempts.carried_params``), in one
    statement (PostgreSQL, autocommit).

    ``worker`` must be unique per claim, as for ``attempts.claim``: a retry after a lost
    answer finds its own claim again (and the outcome written: ``written`` is then False).
    Values the encoder or PostgreSQL refuse are ``ValuesRefused``, and nothing is written
    or claimed: the caller writes the outcome on its own (``attempts.finish``)."""
    params: dict[str, Any] = {
        # Only the run's own (an attempt's token begins with its run's id): checked here, not
        # in the statement, where the run's id led the planner to read every attempt of the
        # run through its index instead of the few held ones by their key.
        "n_tokens": [t for t in tokens if t.startswith(f"{run_id}:")],
        "n_worker": worker,
        "n_step": step,
        "n_carrier": carrier,
    }
    if finished is not None:
        try:
            params.update(carried_params(finished))  # the JSON columns as ``finish`` writes them
        except (TypeError, ValueError) as exc:
            raise ValuesRefused(one_line_cause(exc)) from exc
    with autocommit(engine) as conn, driver_cursor(conn, row_factory=namedtuple_row) as cursor:
        cursor.execute(_statement(finished is not None), params)
        row = cursor.fetchone()
    assert row is not None  # one row always: (SELECT 1) LEFT JOIN the claim
    written = None if row.written is None else row.written == 1
    claimed = None if row.token is None else claimed_attempt(row.token, row, row)
    ordinary = row.next_token if row.next_token is not None and not row.plain else None
    return HeldClaim(claimed, written, ordinary)
