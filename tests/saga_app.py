"""The Celery app of the compensation end-to-end tests (tests/e2e/test_compensation_e2e.py).

Configured from the environment like ``rate_app`` (DUCTOR_DATABASE_URL, E2E_BROKER_URL). Every
step and compensation records each execution in ``saga_log`` (a table of the tests, not of
ductor) with a sequence number, so a test reads what really ran, and in which order, from the
steps' side.
"""

from __future__ import annotations

import os
import time
from typing import Any

import sqlalchemy as sa
from celery import Celery

from ductor_celery import Ductor, RetryPolicy, StepContext, Workflow

app = Celery("saga_e2e")
app.conf.update(
    broker_url=os.environ.get("E2E_BROKER_URL", "memory://"),
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    ductor_sweep_interval=float(os.environ.get("SAGA_SWEEP_INTERVAL", "0.2")),
)
ductor = Ductor(app)

#: Created by the tests before workers start (one DDL, no race between worker processes).
LOG_DDL = """
CREATE TABLE IF NOT EXISTS saga_log (
    id bigserial PRIMARY KEY,
    run_id text NOT NULL,
    action text NOT NULL,
    subject text NOT NULL,
    attempt int NOT NULL
)
"""

FLAKY = RetryPolicy(max_attempts=4, initial_interval=0.1, backoff=1.0)


def _log(ctx: StepContext, action: str, subject: str) -> int:
    """Record this execution; return how many executions of this node came before it."""
    with ductor.runtime.engine().begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO saga_log (run_id, action, subject, attempt) VALUES (:r, :a, :s, :n)"
            ),
            {"r": ctx.run_id, "a": action, "s": subject, "n": ctx.attempt},
        )
    return ctx.attempt - 1


@ductor.step(name="saga.book")
def book(ctx: StepContext, what: str) -> dict[str, str]:
    _log(ctx, "book", what)
    return {"booking": f"{what}-{ctx.run_id[:8]}"}


@ductor.step(name="saga.fail", retry=RetryPolicy(max_attempts=2, initial_interval=0.1))
def fail(ctx: StepContext, what: str) -> None:
    _log(ctx, "book", what)
    raise RuntimeError(f"no {what} available")


@ductor.step(name="saga.cancel_booking", retry=FLAKY)
def cancel_booking(ctx: StepContext, output: dict[str, str], input: dict[str, Any]) -> str:
    """Undo a booking; its first attempt fails (a flaky supplier) when the input says so."""
    if input.get("flaky_refunds") and ctx.attempt == 1:
        _log(ctx, "refund-failed", output["booking"])
        raise RuntimeError("supplier timeout")
    _log(ctx, "refund", output["booking"])
    return f"cancelled {output['booking']}"


trip = Workflow("trip")
trip.step("flight", book, args={"what": "flight"}, compensate=cancel_booking)
trip.step("hotel", book, after=["flight"], args={"what": "hotel"}, compensate=cancel_booking)
trip.step("car", fail, after=["hotel"], args={"what": "car"})
ductor.register(trip)


@ductor.step(name="saga.slow_book")
def slow_book(ctx: StepContext, what: str) -> dict[str, str]:
    """A booking still running when another node fails (a supplier that answers slowly)."""
    time.sleep(2.0)
    _log(ctx, "book", what)
    return {"booking": f"{what}-{ctx.run_id[:8]}"}


#: The flight is still being booked when the car fails: the saga waits for it, then undoes it.
race = Workflow("race")
race.step("flight", slow_book, args={"what": "flight"}, compensate=cancel_booking)
race.step("car", fail, args={"what": "car"})
ductor.register(race)
