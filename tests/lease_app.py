"""The Celery app of the concurrency-lease end-to-end tests (tests/e2e/test_leases.py).

Configured from the environment like ``e2e_app`` (DUCTOR_DATABASE_URL, E2E_BROKER_URL). The
limited step records when it enters and leaves in ``lease_log`` (a table of the tests, not
of ductor), with the database clock, so a test can compute how many ran at once per key
from what the steps themselves saw.
"""

from __future__ import annotations

import os
import time

import sqlalchemy as sa
from celery import Celery

from ductor_celery import ConcurrencyLimit, Ductor, RetryPolicy, StepContext, Workflow

app = Celery("lease_e2e")
app.conf.update(
    broker_url=os.environ.get("E2E_BROKER_URL", "memory://"),
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    ductor_sweep_interval=float(os.environ.get("LEASE_SWEEP_INTERVAL", "0.5")),
    ductor_resend_unclaimed_after=float(os.environ.get("LEASE_RESEND_AFTER", "30")),
)
ductor = Ductor(app)

LIMIT = int(os.environ.get("LEASE_LIMIT", "2"))

#: Created by the tests before workers start (one DDL, no race between worker processes).
LOG_DDL = """
CREATE TABLE IF NOT EXISTS lease_log (
    id bigserial PRIMARY KEY,
    run_id text NOT NULL,
    node text NOT NULL,
    attempt int NOT NULL,
    customer text NOT NULL,
    pid int NOT NULL,
    entered_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    exited_at timestamptz
)
"""


@ductor.step(
    name="lease.limited",
    concurrency=ConcurrencyLimit(key="$.input.customer", limit=LIMIT),
    timeout=float(os.environ.get("LEASE_STEP_TIMEOUT", "30")),
    retry=RetryPolicy(max_attempts=3, initial_interval=0.2, backoff=1.0),
)
def limited(ctx: StepContext, customer: str, seconds: float) -> dict[str, object]:
    engine = ductor.runtime.engine()
    with engine.begin() as conn:
        row_id = conn.execute(
            sa.text(
                "INSERT INTO lease_log (run_id, node, attempt, customer, pid) "
                "VALUES (:r, :n, :a, :c, :p) RETURNING id"
            ),
            {"r": ctx.run_id, "n": ctx.node, "a": ctx.attempt, "c": customer, "p": os.getpid()},
        ).scalar_one()
    time.sleep(seconds)
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE lease_log SET exited_at = clock_timestamp() WHERE id = :i"),
            {"i": row_id},
        )
    return {"customer": customer, "attempt": ctx.attempt}


limited_wf = Workflow("limited")
limited_wf.step(
    "work", limited, args={"customer": "$.input.customer", "seconds": "$.input.seconds"}
)
limited_wf.output("$.nodes.work.output")
ductor.register(limited_wf)
