"""Placing an order: the order row and its durable run, in one transaction."""

from __future__ import annotations

from django.db import transaction
from shop_site.celery import ductor

from .models import Order

#: What the warehouse cannot ship (checked after the run is started, to show a rollback).
OUT_OF_STOCK = frozenset({"unicorn"})


class OutOfStock(Exception):
    pass


def place_order(customer: str, items: list[str], total: int, *, using: str = "default") -> Order:
    """Insert the order and start its run inside one ``transaction.atomic()``.

    The run's row is written in this transaction (``using=``): if anything below raises, the
    order and the run roll back together, and no worker ever hears of the run. Its first
    wake-up is sent by ``transaction.on_commit``, after the commit.
    """
    with transaction.atomic(using=using):
        placed = Order.objects.using(using).create(customer=customer, total=total)
        handle = ductor.start(
            "order",
            input={"order_id": placed.pk, "items": items, "total": total},
            workflow_id=f"order-{placed.pk}",
            using=using,
        )
        placed.run_id = handle.run_id
        placed.save(using=using, update_fields=["run_id"])
        missing = sorted(OUT_OF_STOCK.intersection(items))
        if missing:
            raise OutOfStock(f"out of stock: {', '.join(missing)}")
    return placed
