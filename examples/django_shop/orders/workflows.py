"""The order's fulfilment: reserve the items, charge, then mark the order confirmed."""

from __future__ import annotations

from typing import Any

from shop_site.celery import ductor

from ductor_celery import StepContext, Workflow

from .models import Order


@ductor.step(name="shop.reserve")
def reserve(ctx: StepContext, items: list[str]) -> dict[str, Any]:
    return {"reserved": sorted(items)}


@ductor.step(name="shop.charge")
def charge(ctx: StepContext, total: int) -> dict[str, Any]:
    # A real payment call would pass ctx.idempotency_key to the provider.
    return {"charge_id": f"ch_{ctx.idempotency_key[-12:]}", "amount": total}


@ductor.step(name="shop.confirm")
def confirm(ctx: StepContext, order_id: int) -> str:
    Order.objects.filter(pk=order_id).update(status="confirmed")
    return "confirmed"


order = Workflow("order")
order.step("reserve", reserve, args={"items": "$.input.items"})
order.step("charge", charge, after=["reserve"], args={"total": "$.input.total"})
order.step("confirm", confirm, after=["charge"], args={"order_id": "$.input.order_id"})
order.output({"charge": "$.nodes.charge.output"})
ductor.register(order)
