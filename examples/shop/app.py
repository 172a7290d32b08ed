r"""The shop example: an order workflow on PostgreSQL and Redis with real Celery workers.

From the repository root, where its configuration (celeryconfig.py) sits:

ductor -A examples.shop.app migrate
celery -A examples.shop.app worker -Q ductor-steps -c 4
celery -A examples.shop.app worker -Q ductor-coord -c 1
ductor -A examples.shop.app start order --wait \
    --input '{"order": {"id": 7, "total": 1250, "items": ["mug"]}}'
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from ductor_celery import (
    ConcurrencyLimit,
    Ductor,
    NonRetryableError,
    RetryPolicy,
    StepContext,
    Workflow,
)

app = Celery("shop")
# The repository's production-style configuration (celeryconfig.py at the top): the broker
# and the database from CELERY_BROKER_URL and DUCTOR_DATABASE_URL, loopback defaults.
app.config_from_object("celeryconfig")
ductor = Ductor(app)


@ductor.step(name="shop.reserve")
def reserve(ctx: StepContext, order: dict[str, Any]) -> dict[str, Any]:
    if not order.get("items"):
        raise NonRetryableError("an order needs at least one item")
    ctx.patch({"reserved": True})
    return {"reservation": f"rsv-{order['id']}", "items": len(order["items"])}


@ductor.step(
    name="shop.charge",
    retry=RetryPolicy(
        max_attempts=5,
        initial_interval=1.0,
        backoff=2.0,
        max_interval=30.0,
        non_retryable=(ValueError,),
    ),
    timeout=30.0,
)
def charge(ctx: StepContext, amount: int) -> dict[str, Any]:
    if amount <= 0:
        raise ValueError(f"cannot charge {amount}")
    # ctx.idempotency_key is stable across retries: pass it to the payment provider.
    return {"charge_id": f"ch-{ctx.idempotency_key[-12:]}", "amount": amount}


@ductor.step(name="shop.pack")
def pack(ctx: StepContext, items: list[str]) -> dict[str, Any]:
    return {"boxes": (len(items) + 1) // 2}


# At most two picks run at once across every order: the warehouse has two pickers.
@ductor.step(name="shop.pick", concurrency=ConcurrencyLimit(key="warehouse", limit=2))
def pick(ctx: StepContext, item: str) -> str:
    return f"picked {item} (#{ctx.branch})"


@ductor.step(name="shop.gift_wrap")
def gift_wrap(ctx: StepContext, boxes: int) -> str:
    return f"{boxes} boxes wrapped"


@ductor.step(name="shop.ship")
def ship(ctx: StepContext, charge: dict[str, Any], boxes: int) -> dict[str, Any]:
    return {"tracking": f"TRK-{ctx.run_id[:8]}", "boxes": boxes, "paid": charge["charge_id"]}


order = Workflow("order", version=1)
order.step("reserve", reserve, args={"order": "$.input.order"})
order.step("charge", charge, after=["reserve"], args={"amount": "$.input.order.total"})
order.step("pack", pack, after=["reserve"], args={"items": "$.input.order.items"})
order.scatter("pick", pick, over="$.input.order.items", after=["reserve"], max_parallel=8)
order.step(
    "gift_wrap",
    gift_wrap,
    after=["pack"],
    args={"boxes": "$.nodes.pack.output.boxes"},
    when="$.input.order.gift",
)
order.step(
    "ship",
    ship,
    after=["charge", "gift_wrap", "pick"],
    args={"charge": "$.nodes.charge.output", "boxes": "$.nodes.pack.output.boxes"},
)
order.output(
    {
        "tracking": "$.nodes.ship.output.tracking",
        "charge": "$.nodes.charge.output",
        "picked": "$.nodes.pick.output",
    }
)
ductor.register(order)
