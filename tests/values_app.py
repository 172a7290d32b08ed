"""The Celery app of the typed-values and secrets end-to-end tests (tests/e2e/test_values_e2e.py).

Configured from the environment like ``e2e_app`` (DUCTOR_DATABASE_URL, E2E_BROKER_URL). Its
model and dataclass live here, at module level, so the client and the worker processes both
import them by the path their stored form names.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from datetime import datetime
from decimal import Decimal

from celery import Celery
from pydantic import BaseModel

from ductor_celery import Ductor, RetryPolicy, StepContext, Workflow

app = Celery("values_e2e")
app.conf.update(
    broker_url=os.environ.get("E2E_BROKER_URL", "memory://"),
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    ductor_sweep_interval=0.5,
)
ductor = Ductor(app)
log = logging.getLogger("values_app")


class Order(BaseModel):
    id: uuid.UUID
    total: Decimal
    placed: datetime


@dataclasses.dataclass(frozen=True)
class Receipt:
    order_id: uuid.UUID
    charged: Decimal
    at: datetime
    note: str


@ductor.step(name="values.pay", retry=RetryPolicy(max_attempts=2, initial_interval=0.1))
def pay(ctx: StepContext, api_key: str, order: Order, at: datetime) -> Receipt:
    # Everything a careless step does with a key: log it, print it, heartbeat it, patch it,
    # raise it, return it. None of it may reach a table, a message or a log line.
    log.warning("charging %s with key %s", order.id, api_key)
    print(f"stdout: key {ctx.secret('stripe')}")  # noqa: T201 - Celery logs a task's stdout
    ctx.heartbeat({"key": api_key})
    ctx.patch({"last_key": api_key})
    if ctx.attempt == 1:
        raise RuntimeError(f"gateway refused key {api_key}")
    return Receipt(order.id, order.total, at, note=f"paid with {api_key}")


@ductor.step(name="values.check")
def check(ctx: StepContext, receipt: Receipt, order: Order) -> dict[str, object]:
    assert isinstance(receipt, Receipt) and isinstance(order, Order)
    return {"same_order": receipt.order_id == order.id, "charged": receipt.charged}


pay_wf = Workflow("values_pay")
pay_wf.step(
    "pay", pay, args={"api_key": "$.secret.stripe", "order": "$.input.order", "at": "$.input.at"}
)
pay_wf.step(
    "check", check, after=["pay"], args={"receipt": "$.nodes.pay.output", "order": "$.input.order"}
)
pay_wf.output({"receipt": "$.nodes.pay.output", "check": "$.nodes.check.output"})
ductor.register(pay_wf)
