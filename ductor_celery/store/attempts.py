"""The step worker's side of the store: claim an attempt by token, write its outcome once.

Workers never touch ``eec_workflow_run`` rows; they read the run's input and context to build
the StepContext, and write only the attempt row whose token they were handed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from psycopg.rows import namedtuple_row
from sqlalchemy.engine import Connection, Engine

from ..definition.spec import compensated_node, compensation_id
from ..engine.inputs import AttemptResult
from ..engine.status import AttemptOutcome
from . import leases, rates
from .db import (
    ValuesRefused,
    autocommit,
    aware,
    driver_compiled,
    driver_cursor,
    one_line_cause,
    refusing_values,
)
from .dialect import dialect_of
from .inputs import current_input
from .leases import holds_lease
from .outbox import OutboxRow
from .schema import dumps_json, step_attempt, stored_json_text, workflow_run


@dataclass(frozen=True, slots=True)
class ClaimedAttempt:
    token: str
    run_id: str
    workflow_id: str
    node: str
    branch: int | None
    generation: int
    attempt: int
    step: str
    args: dict[str, Any]
    context: dict[str, Any]
    #: The run's pinned definition: the worker reads the node's retry policy from it.
    spec_hash: str | None = None
    #: Seconds from the attempt's insert to its claim, on the database's clock (metrics).
    queued_s: float | None = None
    #: The run's workflow name and W3C traceparent (ductor_celery/tracing.py).
    workflow: str = ""
    trace_context: str | None = None
    #: Its run's cancel was requested before the claim: the worker writes it as cancelled
    #: without running the step (docs/operations.md, "Cancel and terminate").
    cancel_requested: bool = False
    #: The JSON text ``args`` were read from, when known (an inline claim's: the tick's
    #: ``NewAttempt.args_text``): whether they may hold a reference or a typed value is read
    #: from it instead of walking them. None once ``args`` change (large values read back).
    args_text: str | None = None


def _now(engine: Engine) -> Any:
    return dialect_of(engine).write_now(engine)


@dataclass(frozen=True, slots=True)
class WrongStep:
    """The token names an attempt of another step: the message's task is not the attempt's.

    Such a message (put on a queue by hand, or by a tool that mixed up names) must not run
    the wrong function with the attempt's arguments; nothing is claimed, and the attempt's
    own message can still claim it.
    """

    token: str
    #: The step the attempt row belongs to.
    step: str


def claim(
    engine: Engine,
    token: str,
    worker: str,
    *,
    step: str | None = None,
    carrier: str | None = None,
) -> ClaimedAttempt | WrongStep | rates.RateHeld | None:
    """Take the attempt for this worker. None if it was claimed or closed already;
    ``RateHeld`` if it is rate-limited and must wait for a token (docs/flow-control.md).

    ``worker`` must be unique per claim attempt (at most 200 characters): retrying the same
    claim after an ambiguous commit then finds its own claim instead of a stranger's.

    ``step`` is the name of the task the message was delivered to: the attempt is claimed only
    if it belongs to that step, checked in the claim statement itself. A mismatch claims
    nothing and returns ``WrongStep``. (``None`` skips the check: for tests and tools that
    play the worker by hand; the step worker always passes its step.)

    ``carrier``: the task id of the Celery message this worker process runs the attempt
    under (the attempt's own token, or the message that began its inline chain), written
    with the claim: a terminate revokes it with ``terminate=True`` (store/ticks.py).

    A claim is exclusive: a duplicate or redelivered message for a claimed token does nothing.
    If the claiming worker died, the coordinator's start-to-close timeout retries the node
    under a new token.
    """
    if dialect_of(engine).one_statement:
        return _claim_postgres(engine, token, worker, step, carrier)
    claim_stmt = (
        sa.update(step_attempt)
        .where(*_claimable_now(token, worker))
        .values(claimed_at=_now(engine), claimed_by=worker, carrier=carrier)
    )
    if step is not None:
        claim_stmt = claim_stmt.where(step_attempt.c.step == step)
    with engine.begin() as conn:
        row = conn.execute(claim_stmt.returning(*_CLAIM_COLUMNS)).one_or_none()
        run = None if row is None else _run_of(conn, row.run_id)
        # Why nothing was claimed, read only on a miss (SQLite is in-process: no trip).
        missed = (
            conn.execute(
                sa.select(step_attempt.c.step, step_attempt.c.rate_key).where(
                    step_attempt.c.token == token
                )
            ).one_or_none()
            if row is None
            else None
        )
    if missed is not None and missed.rate_key is not None and (step is None or missed.step == step):
        return _claim_rate_limited(engine, token, worker, step, carrier)
    return _claimed(token, step, row, run, missed.step if missed is not None else None)


def _run_of(conn: Connection, run_id: str) -> Any:
    return conn.execute(
        sa.select(
            workflow_run.c.workflow_id,
            workflow_run.c.state["context"].label("context"),
            workflow_run.c.spec_hash,
            workflow_run.c.workflow,
            workflow_run.c.trace_context,
        ).where(workflow_run.c.run_id == run_id)
    ).one()


def _claim_rate_limited(
    engine: Engine, token: str, worker: str, step: str | None, carrier: str | None
) -> ClaimedAttempt | rates.RateHeld | None:
    """The claim of an attempt under a rate limit (docs/flow-control.md): under its bucket's
    lock, take a token and claim, in one transaction; or, when the bucket is empty or an older
    attempt of the key waits, mark the attempt waiting and claim nothing (``RateHeld``)."""
    with engine.begin() as conn:
        row = conn.execute(
            sa.select(
                step_attempt.c.rate_key,
                step_attempt.c.rate_limit,
                step_attempt.c.rate_period,
                step_attempt.c.rate_wait_since,
                step_attempt.c.rate_released_at,
                step_attempt.c.created_at,
                step_attempt.c.claimed_by,
                step_attempt.c.priority,
            )
            .where(*_claimable(token, worker))
            # The attempt's row before the bucket's, the order of a tick's commit (which closes
            # attempts, then takes an inline step's token): the two never wait in a cycle.
            .with_for_update(of=step_attempt)
        ).one_or_none()
        if row is None or row.rate_key is None:
            return None
        claim_stmt = (
            sa.update(step_attempt)
            .where(*_claimable(token, worker))
            .values(claimed_by=worker, carrier=carrier, rate_wait_since=None, rate_released_at=None)
            .returning(*_CLAIM_COLUMNS)
        )
        if row.claimed_by == worker:
            # Our own claim again (its commit's answer was lost): it took its token then.
            again = conn.execute(claim_stmt).one()
            return claimed_attempt(token, again, _run_of(conn, again.run_id))
        bucket = rates.lock_bucket(conn, row.rate_key, row.rate_limit or 1, row.rate_period or 1)
        released = row.rate_released_at is not None  # the sweeper sent it: its turn has come
        if (
            (row.rate_wait_since is not None and not released)  # in line: a duplicate message
            or bucket.tokens() == 0
            or (
                not released
                and rates.older_waiter(conn, row.rate_key, row.created_at, token, row.priority)
            )
        ):
            rates.hold(conn, token, bucket.now)
            return rates.RateHeld(token, row.rate_key, bucket.ready_at)
        got = conn.execute(claim_stmt.values(claimed_at=bucket.now)).one_or_none()
        if got is None:
            return None  # closed meanwhile: nothing taken (the transaction ends unchanged)
        rates.take(conn, bucket)
        return claimed_attempt(token, got, _run_of(conn, got.run_id))


def _claimable(token: Any, worker: Any) -> tuple[Any, ...]:
    """The claim's conditions, the same on both databases (values or bind parameters)."""
    return (
        step_attempt.c.token == token,
        # Our own claim again: the first try committed but its answer was lost.
        sa.or_(step_attempt.c.claimed_at.is_(None), step_attempt.c.claimed_by == worker),
        step_attempt.c.finished_at.is_(None),
        # An attempt under a concurrency limit runs only while it holds a lease slot; a
        # message for one still waiting is dropped (the release that grants it re-sends).
        sa.or_(step_attempt.c.lease_key.is_(None), holds_lease()),
    )


def _claimable_now(token: Any, worker: Any) -> tuple[Any, ...]:
    """The ordinary claim's conditions: a rate-limited attempt is claimed only by
    ``_claim_rate_limited``, which takes a token from its bucket in the same transaction."""
    return (*_claimable(token, worker), step_attempt.c.rate_key.is_(None))


def _claimed(
    token: str, step: str | None, row: Any, run: Any, attempt_step: str | None
) -> ClaimedAttempt | WrongStep | None:
    if row is None or run is None:
        if step is not None and attempt_step is not None and attempt_step != step:
            return WrongStep(token=token, step=attempt_step)
        return None
    return claimed_attempt(token, row, run)


def claimed_attempt(token: str, row: Any, run: Any) -> ClaimedAttempt:
    return ClaimedAttempt(
        token=token,
        run_id=row.run_id,
        workflow_id=run.workflow_id,
        node=row.node,
        branch=row.branch,
        generation=row.generation,
        attempt=row.attempt,
        step=row.step,
        args=dict(row.args or {}),
        context=dict(run.context or {}),
        spec_hash=run.spec_hash,
        queued_s=_seconds_between(row.created_at, row.claimed_at),
        workflow=run.workflow,
        trace_context=run.trace_context,
        cancel_requested=row.cancel_requested_at is not None,
    )


def _seconds_between(start: Any, end: Any) -> float | None:
    began, ended = aware(start), aware(end)
    if began is None or ended is None:
        return None
    return (ended - began).total_seconds()


@functools.cache
def _pg_claim_statement(check_step: bool) -> Any:
    """The PostgreSQL claim, built once per process (bind parameters ``b_token``,
    ``b_worker``, ``b_carrier``, ``b_step``): building a statement with a CTE costs more than
    running it.

    The UPDATE ... FROM the run (returning its workflow id and context too) runs as a CTE, left
    joined to the attempt row itself, so a miss still says which step the token belongs to
    (a wrong-step message is told apart from a duplicate without a second query). The outer
    SELECT sees the row as it was before the UPDATE; ``step`` never changes.
    """
    # Not named after columns: an UPDATE would read such parameters as SET values.
    token = sa.bindparam("b_token", type_=sa.String)
    worker = sa.bindparam("b_worker", type_=sa.String)
    carrier = sa.bindparam("b_carrier", type_=sa.String)
    update = (
        sa.update(step_attempt)
        .where(*_claimable_now(token, worker), workflow_run.c.run_id == step_attempt.c.run_id)
        .values(claimed_at=sa.func.now(), claimed_by=worker, carrier=carrier)
    )
    if check_step:
        update = update.where(step_attempt.c.step == sa.bindparam("b_step", type_=sa.String))
    claimed = update.returning(
        *_CLAIM_COLUMNS,
        workflow_run.c.workflow_id,
        workflow_run.c.spec_hash,
        workflow_run.c.state["context"].label("context"),
        workflow_run.c.workflow,
        workflow_run.c.trace_context,
    ).cte("claimed")
    return (
        sa.select(
            step_attempt.c.step.label("attempt_step"),
            step_attempt.c.rate_key.label("attempt_rate_key"),
            *claimed.c,
        )
        .select_from(step_attempt.outerjoin(claimed, sa.true()))
        .where(step_attempt.c.token == token)
    )


#: The claim's parameters given per call; its compiled text binds a few literals besides.
_CLAIM_PARAMS = frozenset({"b_token", "b_worker", "b_carrier", "b_step"})


@functools.cache
def _pg_claim_text(check_step: bool) -> tuple[str, dict[str, Any]]:
    """``_pg_claim_statement`` as psycopg's text (``%(b_token)s``...), compiled once per
    process, with the values of the literals it binds (the JSON key ``context``, an EXISTS
    probe's ``1``). Its rows are named tuples with the statement's labels, JSON and
    timestamps decoded by psycopg as SQLAlchemy's psycopg dialect leaves them."""
    compiled = driver_compiled(_pg_claim_statement(check_step))
    fixed = {k: v for k, v in compiled.params.items() if k not in _CLAIM_PARAMS}
    return str(compiled), fixed


def _claim_postgres(
    engine: Engine, token: str, worker: str, step: str | None, carrier: str | None
) -> ClaimedAttempt | WrongStep | rates.RateHeld | None:
    """The claim in one round trip and one statement, in autocommit (no BEGIN, no COMMIT: a
    single UPDATE is atomic by itself)."""
    params: dict[str, str | None] = {"b_token": token, "b_worker": worker, "b_carrier": carrier}
    if step is not None:
        params["b_step"] = step
    # Straight to psycopg's cursor, as the tick's hot statements (store/load.py): the text
    # never changes, and SQLAlchemy's execution context and result wrapping cost more than
    # the statement. Every step message and every held branch makes one claim.
    text, fixed = _pg_claim_text(step is not None)
    with autocommit(engine) as conn, driver_cursor(conn, row_factory=namedtuple_row) as cursor:
        cursor.execute(text, {**fixed, **params})
        found = cursor.fetchone()
    if found is None:
        return None
    if found.run_id is None and found.attempt_rate_key is not None:
        if step is None or found.attempt_step == step:
            return _claim_rate_limited(engine, token, worker, step, carrier)
    row = found if found.run_id is not None else None
    return _claimed(token, step, row, row, found.attempt_step)


_CLAIM_COLUMNS = (
    step_attempt.c.run_id,
    step_attempt.c.node,
    step_attempt.c.branch,
    step_attempt.c.generation,
    step_attempt.c.attempt,
    step_attempt.c.step,
    step_attempt.c.args,
    step_attempt.c.created_at,
    step_attempt.c.claimed_at,
    step_attempt.c.cancel_requested_at,
)


def run_input(engine: Engine, run_id: str) -> Any:
    """The run's input, read only when a step asks for ``ctx.input`` (it can be large: a
    scatter's whole item list); a redrive's ``input=`` if one replaced it."""
    return current_input(engine, run_id)


@refusing_values()
def finish(
    engine: Engine,
    token: str,
    *,
    outcome: AttemptOutcome,
    output: Any = None,
    error: dict[str, Any] | None = None,
    retryable: bool = True,
    patch: dict[str, Any] | None = None,
    leased: bool = False,
    tags: list[list[str]] | None = None,
) -> tuple[bool, list[OutboxRow]]:
    """Write the outcome once. False if the attempt was already finished or closed.

    In the same transaction, the attempt's lease (if any) is released and handed to the
    oldest attempt waiting for its key: the returned outbox rows are that attempt's step
    message, for the caller to send after the commit. ``leased`` (the step declares a
    concurrency limit) takes the key's lock before the attempt row, the order the
    coordinator's commit uses, so a finish racing a timeout close cannot deadlock.
    """
    outcome_values = {
        "outcome": outcome,
        "output": output,
        "error": error,
        "retryable": retryable,
        "patch": patch,
        "tags": tags,
    }
    if not leased and dialect_of(engine).one_statement:
        # The common case in one round trip: an attempt without a lease needs nothing but
        # its own row (autocommit). An attempt that has a lease after all (its step's limit
        # was added since), or is finished already, takes the full path below.
        with autocommit(engine) as conn:
            if finish_unleased_on(conn, token, **outcome_values):
                return True, []
    # What the JSON encoder refuses is ValuesRefused here too (SQLAlchemy would pass the
    # encoder's own error through from inside the driver's binding).
    _outcome_json(output, error, patch, tags)
    with engine.begin() as conn:
        if leased:
            leases.lock_keys(conn, leases.keys_held_by(conn, [token]))
        res = conn.execute(
            sa.update(step_attempt)
            .where(step_attempt.c.token == token, step_attempt.c.finished_at.is_(None))
            .values(finished_at=_now(engine), **outcome_values)
        )
        if res.rowcount != 1:
            return False, []
        if not leases.keys_held_by(conn, [token]):
            return True, []
        return True, leases.release(conn, [token], dialect_of(engine).now_on(conn))


def finishes_in_tick(engine: Engine) -> bool:
    """Whether a worker's eager tick can carry its unleased outcome, written by the tick's
    commit (``CARRIED_SET``): on PostgreSQL. SQLite serializes every writer anyway."""
    return dialect_of(engine).one_statement


def _outcome_json(*values: Any) -> tuple[str, ...]:
    """An outcome's JSON columns as ``dumps_json`` writes them; what the encoder refuses is
    ``ValuesRefused`` (the driver's own binding of them would raise it bare)."""
    try:
        return tuple(dumps_json(v) for v in values)
    except (TypeError, ValueError) as exc:
        raise ValuesRefused(one_line_cause(exc)) from exc


@refusing_values()
def finish_unleased_on(
    conn: Connection,
    token: str,
    *,
    outcome: AttemptOutcome,
    output: Any = None,
    error: dict[str, Any] | None = None,
    retryable: bool = True,
    patch: dict[str, Any] | None = None,
    tags: list[list[str]] | None = None,
) -> bool:
    """Write the outcome of an attempt that holds no lease, on ``conn`` (PostgreSQL): False if
    it is finished or closed already, or has a lease (then ``finish`` must release it).

    Straight to psycopg's cursor, as a carried outcome is (``finish_carried``): the same SET
    but ``folded``, the same WHERE, the JSON columns as ``dumps_json`` makes them. Values it
    cannot encode, or that PostgreSQL refuses, are ``ValuesRefused`` as on SQLAlchemy's
    path (``db.refusing_values``)."""
    output_text, error_text, patch_text, tags_text = _outcome_json(output, error, patch, tags)
    params = {
        "c_token": token,
        "c_outcome": str(outcome),
        "c_output": output_text,
        "c_error": error_text,
        "c_retryable": retryable,
        "c_patch": patch_text,
        "c_tags": tags_text,
    }
    with driver_cursor(conn) as cursor:
        cursor.execute(_PG_FINISH_UNLEASED, params)
        return bool(cursor.rowcount == 1)


#: An outcome a tick carries (``Coordinator.tick``'s ``carried``: the step worker running the
#: tick holds it), written finished and folded at once, in psycopg's placeholders: the SET
#: and WHERE of ``finish_carried`` and of the one-statement commit's ``carried`` CTE
#: (store/pg_commit.py). The WHERE is ``finish_unleased_on``'s: an attempt finished or closed
#: already, or holding a lease, is left alone. The JSON columns get the text ``finish``
#: writes (``dumps_json``; None is JSON ``null``, as SQLAlchemy's JSON type stores it):
#: tests/integration/test_carried_outcome.py compares the rows the two paths write.
OUTCOME_VALUES = (
    "outcome = %(c_outcome)s, output = %(c_output)s::jsonb, error = %(c_error)s::jsonb, "
    "retryable = %(c_retryable)s, patch = %(c_patch)s::jsonb, tags = %(c_tags)s::jsonb"
)
OUTCOME_SET = "finished_at = now(), " + OUTCOME_VALUES
CARRIED_SET = OUTCOME_SET + ", folded = true"
CARRIED_WHERE = "token = %(c_token)s AND finished_at IS NULL AND lease_key IS NULL"


def carried_params(carried: AttemptResult) -> dict[str, Any]:
    """The parameters of ``CARRIED_SET`` and ``CARRIED_WHERE`` for one carried outcome."""
    return {
        "c_token": carried.token,
        "c_outcome": str(carried.outcome),
        "c_output": dumps_json(carried.output)
        if carried.output_text is None
        else stored_json_text(carried.output_text),
        "c_error": dumps_json(carried.error),
        "c_retryable": carried.retryable,
        "c_patch": dumps_json(carried.patch),
        "c_tags": dumps_json(carried.tags),
    }


def finish_carried(conn: Connection, carried: AttemptResult) -> bool:
    """Write a carried outcome finished and folded, in the caller's tick transaction
    (PostgreSQL, a commit not in one statement: ``ticks._commit_on``); False: the attempt is
    finished or closed already, or holds a lease. Straight to the driver's cursor, as the
    one-statement commit: the text is fixed and the values plain."""
    with driver_cursor(conn) as cursor:
        cursor.execute(_PG_FINISH_CARRIED, carried_params(carried))
        return bool(cursor.rowcount == 1)


_PG_FINISH_CARRIED = f"UPDATE eec_workflow_step_attempt SET {CARRIED_SET} WHERE {CARRIED_WHERE}"
#: ``finish_unleased_on``: the carried outcome's write but ``folded`` (a tick folds it).
_PG_FINISH_UNLEASED = f"UPDATE eec_workflow_step_attempt SET {OUTCOME_SET} WHERE {CARRIED_WHERE}"


def may_lose_commits(engine: Engine) -> bool:
    """Whether a commit this database acknowledged can still be lost: PostgreSQL, whose
    failover to an asynchronous standby drops the last commits (runtime/lost_outcomes.py);
    not SQLite, a file on this machine."""
    return dialect_of(engine).may_lose_commits


def open_claims(engine: Engine, tokens: list[str]) -> dict[str, str | None]:
    """Of ``tokens``, the attempts still open (not finished), each with who claimed it
    (``None``: nobody, or a claim the database no longer has). An attempt the database does
    not have at all is left out. ``runtime/lost_outcomes.py``: outcomes a failover lost."""
    found: dict[str, str | None] = {}
    with engine.connect() as conn:
        for start in range(0, len(tokens), 500):
            rows = conn.execute(
                sa.select(step_attempt.c.token, step_attempt.c.claimed_by).where(
                    step_attempt.c.token.in_(tokens[start : start + 500]),
                    step_attempt.c.finished_at.is_(None),
                )
            )
            found.update({row.token: row.claimed_by for row in rows})
    return found


def finished_as(engine: Engine, token: str) -> tuple[str | None, str | None] | None:
    """A finished attempt's claim identity and outcome; ``None`` when it is open or absent.
    ``runtime/steps.py``: an outcome a commit wrote while its answer was lost."""
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(step_attempt.c.claimed_by, step_attempt.c.outcome).where(
                step_attempt.c.token == token, step_attempt.c.finished_at.is_not(None)
            )
        ).first()
    return None if row is None else (row.claimed_by, row.outcome)


@refusing_values()
def heartbeat(engine: Engine, token: str, details: Any = None) -> bool:
    """Record that the attempt is alive (and how far it got); a closed attempt is left alone.

    Returns whether the attempt should stop, in the same round trip: its run's cancel was
    requested (``cancel_requested_at``), or it is no longer open (closed by a terminate, a
    cancel's grace, a timeout: whatever it produces now is discarded).
    """
    with engine.begin() as conn:
        row = conn.execute(
            sa.update(step_attempt)
            .where(step_attempt.c.token == token, step_attempt.c.finished_at.is_(None))
            .values(heartbeat_at=_now(engine), heartbeat_details=details)
            .returning(step_attempt.c.cancel_requested_at)
        ).one_or_none()
    return row is None or row.cancel_requested_at is not None


def should_stop(engine: Engine, token: str) -> bool:
    """``heartbeat``'s answer without recording a heartbeat (``ctx.cancelled``)."""
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(step_attempt.c.cancel_requested_at, step_attempt.c.finished_at).where(
                step_attempt.c.token == token
            )
        ).one_or_none()
    return row is None or row.cancel_requested_at is not None or row.finished_at is not None


def times_undone(engine: Engine, run_id: str, node: str) -> int:
    """How many times a saga of the run undid ``node`` (its compensation ``"<node>~compensate"``
    succeeded), ``node`` being a step node or its compensation id. ``ctx.idempotency_key``
    of a node rerun after a redrive counts on with it (docs/compensation.md)."""
    base = compensated_node(node) or node
    with engine.connect() as conn:
        found = conn.execute(
            sa.select(sa.func.count()).where(
                step_attempt.c.run_id == run_id,
                step_attempt.c.node == compensation_id(base),
                step_attempt.c.outcome == AttemptOutcome.SUCCEEDED.value,
            )
        ).scalar_one()
    return int(found)


# -- batch attempts (a scatter with batch_size > 1) ----------------------------------------------


def batch_checkpoint(engine: Engine, token: str, worker: str, progress: dict[str, Any]) -> None:
    """Record a running batch attempt's progress (its items' outputs so far) in its own
    ``output`` column, which is otherwise empty until the outcome is written; also a heartbeat.

    Only the claiming worker writes it, only while the attempt is open. If the attempt is then
    lost (the worker killed, the attempt timed out), its retry reads these outputs and runs
    only the items without one.
    """
    with engine.begin() as conn:
        conn.execute(
            sa.update(step_attempt)
            .where(
                step_attempt.c.token == token,
                step_attempt.c.claimed_by == worker,
                step_attempt.c.finished_at.is_(None),
            )
            .values(output=progress, heartbeat_at=_now(engine))
        )


def batch_progress(
    engine: Engine, run_id: str, node: str, branch: int, base: int, token: str
) -> list[Any]:
    """What earlier attempts of one batch recorded (outcomes or checkpoints), oldest first."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.select(step_attempt.c.output)
                .where(
                    step_attempt.c.run_id == run_id,
                    step_attempt.c.node == node,
                    step_attempt.c.branch == branch,
                    step_attempt.c.generation > base,
                    step_attempt.c.token != token,
                    step_attempt.c.output.is_not(None),
                )
                .order_by(step_attempt.c.generation)
            ).scalars()
        )
