"""The Celery app of the rate-limit end-to-end tests (tests/e2e/test_rate_limits_e2e.py).

Configured from the environment like ``lease_app`` (DUCTOR_DATABASE_URL, E2E_BROKER_URL). The
limited step records when it starts in ``rate_log`` (a table of the tests, not of ductor),
with the database clock, so a test can count executions per key from what the steps saw.
"""

from __future__ import annotations

import os
import time

import sqlalchemy as sa
from celery import Celery

from ductor_celery import Ductor, RateLimit, RunConcurrency, StepContext, Workflow

app = Celery("rate_e2e")
app.conf.update(
    broker_url=os.environ.get("E2E_BROKER_URL", "memory://"),
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    ductor_sweep_interval=float(os.environ.get("RATE_SWEEP_INTERVAL", "0.2")),
)
ductor = Ductor(app)

RATE = os.environ.get("RATE_LIMIT", "4/s")

#: Created by the tests before workers start (one DDL, no race between worker processes).
LOG_DDL = """
CREATE TABLE IF NOT EXISTS rate_log (
    id bigserial PRIMARY KEY,
    run_id text NOT NULL,
    customer text NOT NULL,
    attempt int NOT NULL,
    entered_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    exited_at timestamptz
)
"""


@ductor.step(name="rate.limited", rate_limit=RateLimit(RATE, key="$.input.customer"))
def limited(ctx: StepContext, customer: str) -> dict[str, object]:
    with ductor.runtime.engine().begin() as conn:
        conn.execute(
            sa.text("INSERT INTO rate_log (run_id, customer, attempt) VALUES (:r, :c, :a)"),
            {"r": ctx.run_id, "c": customer, "a": ctx.attempt},
        )
    return {"customer": customer}


@ductor.step(name="rate.free")
def free(ctx: StepContext, customer: str) -> str:
    return customer


# Two steps: the second (unlimited) follows the limited one, inline where eager ticks allow.
rated = Workflow("rated")
rated.step("call", limited, args={"customer": "$.input.customer"})
rated.step("after", free, after=["call"], args={"customer": "$.input.customer"})
rated.output("$.nodes.call.output")
ductor.register(rated)


@ductor.step(name="rate.serial")
def serial(ctx: StepContext, customer: str, seconds: float) -> int:
    """Logs its execution (enter and exit, database clock) for the run-concurrency test."""
    with ductor.runtime.engine().begin() as conn:
        row = conn.execute(
            sa.text(
                "INSERT INTO rate_log (run_id, customer, attempt) VALUES (:r, :c, :a) RETURNING id"
            ),
            {"r": ctx.run_id, "c": customer, "a": ctx.attempt},
        ).scalar_one()
    time.sleep(seconds)
    with ductor.runtime.engine().begin() as conn:
        conn.execute(
            sa.text("UPDATE rate_log SET exited_at = clock_timestamp() WHERE id = :i"), {"i": row}
        )
    return int(row)


#: One open run per customer at a time; the rest wait, higher priority first.
one_at_a_time = Workflow(
    "one_at_a_time", concurrency=RunConcurrency(key="$.input.customer", limit=1)
)
one_at_a_time.step(
    "work", serial, args={"customer": "$.input.customer", "seconds": "$.input.seconds"}
)
one_at_a_time.output("$.nodes.work.output")
ductor.register(one_at_a_time)


#: The two cancel strategies, one open run per customer.
for _strategy in ("cancel_in_progress", "cancel_newest"):
    _wf = Workflow(
        f"one_{_strategy}",
        concurrency=RunConcurrency(key="$.input.customer", limit=1, strategy=_strategy),
    )
    _wf.step("work", serial, args={"customer": "$.input.customer", "seconds": "$.input.seconds"})
    _wf.wait_signal("go", signal="go", after=["work"])
    _wf.output("$.nodes.work.output")
    ductor.register(_wf)
