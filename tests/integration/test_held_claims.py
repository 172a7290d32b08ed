"""The held branches' claim (store/held_claims.py): in one statement, the outcome of the branch
just run and the claim of the first held branch that can still be claimed, in the held order.
PostgreSQL only (SQLite takes the claims one by one)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from inline_support import attempt_rows, make_ductor, quick_scatter, start_scatter
from support import attempt_reads_so_far, grow_attempts

from ductor_celery import Ductor
from ductor_celery.engine.inputs import AttemptResult
from ductor_celery.engine.status import AttemptOutcome
from ductor_celery.store import attempts, held_claims
from ductor_celery.store.attempts import carried_params
from ductor_celery.store.db import ValuesRefused
from ductor_celery.store.held_claims import claim_first
from ductor_celery.store.schema import step_attempt

STEP = "held.bump"


def _branches(database_url: str, items: int = 6) -> tuple[Ductor, str, list[str]]:
    """A scatter's branches, started and not claimed: their tokens in branch order."""
    ductor, recorder = make_ductor(database_url)
    quick_scatter(ductor, max_parallel=items)
    run_id, first = start_scatter(ductor, recorder, items)
    return ductor, run_id, [r.payload["token"] for r in first]


def _row(ductor: Ductor, token: str) -> sa.Row:
    return next(a for a in attempt_rows(ductor, _run_of(ductor, token)) if a.token == token)


def _run_of(ductor: Ductor, token: str) -> str:
    with ductor.runtime.engine().connect() as conn:
        return str(
            conn.execute(
                sa.select(step_attempt.c.run_id).where(step_attempt.c.token == token)
            ).scalar_one()
        )


def test_it_writes_the_outcome_and_claims_the_first_claimable_in_order(database_url: str) -> None:
    ductor, run_id, tokens = _branches(database_url)
    engine = ductor.runtime.engine()
    ran, *held = tokens
    assert isinstance(attempts.claim(engine, ran, "w:1:ran"), attempts.ClaimedAttempt)
    # Of the held ones: the first claimed by another worker, the second finished meanwhile.
    assert attempts.claim(engine, held[0], "w:2:other") is not None
    assert attempts.claim(engine, held[1], "w:2:other2") is not None
    assert attempts.finish(engine, held[1], outcome=AttemptOutcome.SUCCEEDED, output=1)[0]

    done = AttemptResult(
        ran, "each", AttemptOutcome.SUCCEEDED, output={"v": 1}, patch={"k": [1, 2]}
    )
    taken = claim_first(
        engine, held, "w:1:next", run_id=run_id, step=STEP, carrier="c1", finished=done
    )

    assert taken.written is True
    assert taken.claimed is not None and taken.claimed.token == held[2]
    assert taken.claimed.run_id == run_id and taken.claimed.step == STEP
    assert taken.claimed.args == {"item": 3}  # its own arguments, as a claim reads them
    row = _row(ductor, ran)
    assert (row.outcome, row.output, row.patch, row.folded) == (
        "succeeded",
        {"v": 1},
        {"k": [1, 2]},
        False,
    )
    claimed = _row(ductor, held[2])
    assert (claimed.claimed_by, claimed.carrier) == ("w:1:next", "c1")
    assert all(_row(ductor, t).claimed_at is None for t in held[3:])  # the rest wait


def test_the_outcome_is_written_though_nothing_is_left_to_claim(database_url: str) -> None:
    ductor, run_id, tokens = _branches(database_url, items=3)
    engine = ductor.runtime.engine()
    ran, *held = tokens
    attempts.claim(engine, ran, "w:1:ran")
    for i, token in enumerate(held):
        attempts.claim(engine, token, f"w:2:{i}")

    taken = claim_first(
        engine,
        held,
        "w:1:next",
        run_id=run_id,
        step=STEP,
        carrier=None,
        finished=AttemptResult(
            ran, "each", AttemptOutcome.FAILED, error={"type": "E", "message": "m"}, retryable=False
        ),
    )

    assert taken.claimed is None and taken.written is True
    row = _row(ductor, ran)
    assert (row.outcome, row.error, row.retryable) == (
        "failed",
        {"type": "E", "message": "m"},
        False,
    )


def test_an_attempt_already_closed_is_not_written_again(database_url: str) -> None:
    ductor, run_id, tokens = _branches(database_url, items=3)
    engine = ductor.runtime.engine()
    ran, *held = tokens
    attempts.claim(engine, ran, "w:1:ran")
    assert attempts.finish(engine, ran, outcome=AttemptOutcome.CANCELLED)[0]

    done = AttemptResult(ran, "each", AttemptOutcome.SUCCEEDED, output=5)
    taken = claim_first(
        engine, held, "w:1:next", run_id=run_id, step=STEP, carrier=None, finished=done
    )

    assert taken.written is False  # the caller's ordinary finish then says "closed"
    assert _row(ductor, ran).outcome == "cancelled"
    assert taken.claimed is not None and taken.claimed.token == held[0]


def test_without_an_outcome_it_only_claims(database_url: str) -> None:
    ductor, run_id, tokens = _branches(database_url, items=3)
    engine = ductor.runtime.engine()
    attempts.claim(engine, tokens[0], "w:2:a")

    taken = claim_first(engine, tokens, "w:1:x", run_id=run_id, step=STEP, carrier=None)

    assert taken.written is None
    assert taken.claimed is not None and taken.claimed.token == tokens[1]


def test_a_rate_limited_or_leased_attempt_is_left_to_the_ordinary_claim(
    database_url: str,
) -> None:
    """Found first, it is named and not claimed (its claim takes a token from its bucket, or
    checks its lease's slot); one of another step is skipped."""
    ductor, run_id, tokens = _branches(database_url, items=3)
    engine = ductor.runtime.engine()
    with engine.begin() as conn:
        for token, column in ((tokens[1], "rate_key"), (tokens[2], "lease_key")):
            conn.execute(
                sa.update(step_attempt).where(step_attempt.c.token == token).values({column: "k"})
            )

    other = claim_first(engine, tokens, "w:1:a", run_id=run_id, step="other.step", carrier=None)
    assert (other.claimed, other.ordinary) == (None, None)
    for token in tokens[1:]:
        taken = claim_first(engine, [token], "w:1:b", run_id=run_id, step=STEP, carrier=None)
        assert (taken.claimed, taken.ordinary, taken.through) == (None, token, token)
        assert _row(ductor, token).claimed_at is None
    taken = claim_first(engine, tokens, "w:1:c", run_id=run_id, step=STEP, carrier=None)
    assert taken.claimed is not None and taken.claimed.token == tokens[0]


def test_a_retry_after_a_lost_answer_finds_its_own_claim(database_url: str) -> None:
    ductor, run_id, tokens = _branches(database_url, items=3)
    engine = ductor.runtime.engine()
    ran, *held = tokens
    attempts.claim(engine, ran, "w:1:ran")
    done = AttemptResult(ran, "each", AttemptOutcome.SUCCEEDED, output=1)
    first = claim_first(
        engine, held, "w:1:next", run_id=run_id, step=STEP, carrier=None, finished=done
    )

    again = claim_first(
        engine, held, "w:1:next", run_id=run_id, step=STEP, carrier=None, finished=done
    )

    assert first.claimed is not None and again.claimed is not None
    assert again.claimed.token == first.claimed.token
    assert again.written is False  # written by the first try


def test_values_the_database_refuses_write_and_claim_nothing(database_url: str) -> None:
    ductor, run_id, tokens = _branches(database_url, items=3)
    engine = ductor.runtime.engine()
    ran, *held = tokens
    attempts.claim(engine, ran, "w:1:ran")
    bad = AttemptResult(
        ran, "each", AttemptOutcome.SUCCEEDED, output="a\x00b"
    )  # no jsonb holds NUL

    with pytest.raises(ValuesRefused):
        claim_first(engine, held, "w:1:next", run_id=run_id, step=STEP, carrier=None, finished=bad)

    assert _row(ductor, ran).finished_at is None
    assert all(_row(ductor, t).claimed_at is None for t in held)


def test_a_token_of_another_run_is_never_claimed(database_url: str) -> None:
    ductor, run_id, tokens = _branches(database_url, items=2)
    engine = ductor.runtime.engine()
    taken = claim_first(engine, tokens, "w:1:a", run_id="another-run", step=STEP, carrier=None)
    assert taken.claimed is None
    assert all(_row(ductor, t).claimed_at is None for t in tokens)


def test_a_retry_finds_its_own_claim_before_a_token_it_skipped_while_locked(
    database_url: str,
) -> None:
    """The first try skipped a token another statement held locked and claimed the next; its
    answer was lost. The retry (same identity) must find that claim again, not claim the
    skipped token as well (which would leave the first one claimed and never run)."""
    ductor, run_id, tokens = _branches(database_url, items=3)
    engine = ductor.runtime.engine()
    with engine.connect() as locker:
        locker.execute(
            sa.text("SELECT 1 FROM eec_workflow_step_attempt WHERE token = :t FOR UPDATE"),
            {"t": tokens[0]},
        )
        first = claim_first(engine, tokens, "w:1:x", run_id=run_id, step=STEP, carrier=None)
        locker.rollback()
    assert first.claimed is not None and first.claimed.token == tokens[1]

    again = claim_first(engine, tokens, "w:1:x", run_id=run_id, step=STEP, carrier=None)

    assert again.claimed is not None and again.claimed.token == tokens[1]
    assert _row(ductor, tokens[0]).claimed_at is None


@pytest.mark.parametrize("finishing", [False, True])
def test_the_held_claim_finds_its_rows_by_key_on_a_grown_table(
    database_url: str, finishing: bool
) -> None:
    """On an analyzed table of 10,000 more attempts, half of them the run's own (as a large
    scatter leaves them), half a thousand runs' of five, in the generic plan PostgreSQL
    keeps for the prepared statement, the claim reads no attempt row by a scan and fetches
    only the held ones by the primary key. With the run's id among its conditions it was
    planned through the run's index, reading every attempt of the run: 1 ms per claim in a
    10,000-item scatter, and PostgreSQL's CPU per item more than doubled."""
    ductor, run_id, tokens = _branches(database_url, items=4)
    engine = ductor.runtime.engine()
    ran, *held = tokens
    attempts.claim(engine, ran, "w:1:ran")
    grow_attempts(engine, 5000, run=run_id)
    with engine.begin() as conn:  # and many small runs: the planner takes a run for a few rows
        conn.exec_driver_sql(
            "INSERT INTO eec_workflow_step_attempt (token, run_id, node, branch, generation, "
            "attempt, step, queue, args, timeout, created_at, folded, finished_at, outcome) "
            "SELECT 'small-' || g, 'small-' || (g / 5), 's', g, 1, 1, 'c', 'q', '{}'::jsonb, 60, "
            "now(), true, now(), 'succeeded' FROM generate_series(1, 5000) AS g"
        )
    params = {
        "n_tokens": held,
        "n_worker": "w:1:x",
        "n_step": STEP,
        "n_carrier": None,
    }
    if finishing:
        params.update(carried_params(AttemptResult(ran, "each", AttemptOutcome.SUCCEEDED, 1)))
    with engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE eec_workflow_step_attempt")
        conn.commit()
        conn.exec_driver_sql("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor = conn.connection.driver_connection.cursor()
        reads = []
        for _ in range(8):
            before = attempt_reads_so_far(conn)
            cursor.execute(held_claims._statement(finishing), params, prepare=True)
            row = cursor.fetchone()
            assert row is not None and row[1] == held[0]  # the first held one, found again
            after = attempt_reads_so_far(conn)
            reads.append((after[0] - before[0], after[1] - before[1]))
        conn.rollback()
    # Three held tokens (and the outcome's row): none scanned, a few fetched.
    assert all(scanned == 0 and 0 < fetched <= 8 for scanned, fetched in reads), reads
