"""Quickstart: an order workflow on the embedded default, no servers to set up.

    python -m examples.quickstart

A diamond (reserve -> charge and pack in parallel -> ship), a flaky step that succeeds on its
third attempt, and a context patch, all run by the same Celery tasks and tick as production,
consumed by threads in this process (``ductor.local_workers()``) with Celery's in-memory
transport and a SQLite file under ./.ductor/.
"""

from __future__ import annotations

import random
import time
from typing import Any

from celery import Celery
from rich.console import Console
from rich.live import Live
from rich.table import Table

from ductor_celery import Ductor, RetryPolicy, RunView, StepContext, Workflow

app = Celery("quickstart")
ductor = Ductor(app)  # no database URL: the embedded SQLite default


@ductor.step(name="shop.reserve")
def reserve(ctx: StepContext, order: dict[str, Any]) -> dict[str, Any]:
    time.sleep(0.3)
    ctx.patch({"reserved_at_attempt": ctx.attempt})
    return {"reservation": f"rsv-{order['id']}", "items": len(order["items"])}


@ductor.step(
    name="shop.charge",
    retry=RetryPolicy(max_attempts=5, initial_interval=0.3, backoff=2.0, max_interval=2.0),
)
def charge(ctx: StepContext, amount: int) -> dict[str, Any]:
    time.sleep(0.2)
    if ctx.attempt < 3:  # the payment provider is flaky today
        raise ConnectionError(f"payment gateway timeout (attempt {ctx.attempt})")
    return {"charge_id": f"ch-{random.randint(1000, 9999)}", "amount": amount}


@ductor.step(name="shop.pack")
def pack(ctx: StepContext, items: list[str]) -> dict[str, Any]:
    time.sleep(0.5)
    ctx.patch({"packed": sorted(items)})
    return {"boxes": (len(items) + 1) // 2}


@ductor.step(name="shop.ship")
def ship(ctx: StepContext, charge: dict[str, Any], boxes: int) -> dict[str, Any]:
    time.sleep(0.2)
    return {"tracking": f"TRK-{ctx.run_id[:8]}", "boxes": boxes, "paid": charge["charge_id"]}


order = Workflow("order", version=1)
order.step("reserve", reserve, args={"order": "$.input.order"})
order.step("charge", charge, after=["reserve"], args={"amount": "$.input.order.total"})
order.step("pack", pack, after=["reserve"], args={"items": "$.input.order.items"})
order.step(
    "ship",
    ship,
    after=["charge", "pack"],
    args={"charge": "$.nodes.charge.output", "boxes": "$.nodes.pack.output.boxes"},
)
order.output({"tracking": "$.nodes.ship.output.tracking", "charge": "$.nodes.charge.output"})
ductor.register(order)


def render(view: RunView) -> Table:
    table = Table(title=f"run {view.run_id[:12]}  workflow {view.workflow}  status {view.status}")
    for column in ("node", "status", "attempts", "output / error"):
        table.add_column(column)
    colors = {"succeeded": "green", "running": "yellow", "failed": "red", "skipped": "dim"}
    for node_id, node in view.nodes.items():
        detail = node.output if node.output is not None else (node.error or {}).get("message", "")
        table.add_row(
            node_id,
            f"[{colors.get(node.status, 'white')}]{node.status}[/]",
            str(node.attempts),
            str(detail)[:60],
        )
    return table


def main() -> RunView:
    console = Console()
    with ductor.local_workers():
        handle = ductor.start(
            "order",
            input={"order": {"id": 42, "total": 1999, "items": ["book", "lamp", "mug"]}},
        )
        with Live(
            render(ductor.get(handle.run_id)), console=console, refresh_per_second=10
        ) as live:
            while True:
                view = ductor.get(handle.run_id)
                live.update(render(view))
                if view.done:
                    break
                time.sleep(0.1)
        view = ductor.wait(handle.run_id, timeout=60)
    console.print()
    console.print(f"[bold]status:[/] {view.status}")
    console.print(f"[bold]output:[/] {view.output}")
    console.print(f"[bold]context:[/] {view.context}")
    return view


if __name__ == "__main__":
    main()
