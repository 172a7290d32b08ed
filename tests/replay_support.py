"""The workflow of the export and replay tests (docs/replay.md), on any Ductor.

``replay_order`` waits for a payment signal, charges (failing its first attempt, with a secret
among its arguments and a context patch) and ships; ``ship`` fails for good unless the Ductor
is built with ``ship_fixed=True``: the "current code" a replay or a redrive runs after a fix.
Every output depends only on the arguments, so a replay returns what the worker returned.
"""

from __future__ import annotations

import hashlib
from decimal import Decimal
from typing import Any

from ductor_celery import Ductor, NonRetryableError, RetryPolicy, StepContext, Workflow

SECRET_NAME = "REPLAY_KEY"
SECRET_ENV = f"DUCTOR_SECRET_{SECRET_NAME}"
SECRET = "sk_live_replay_0123456789"


def fingerprint(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def define(d: Ductor, *, ship_fixed: bool = False) -> Workflow:
    @d.step(name="replay.charge", retry=RetryPolicy(max_attempts=3, initial_interval=0.05))
    def charge(ctx: StepContext, amount: Decimal, key: str) -> dict[str, Any]:
        if ctx.attempt == 1:
            raise ConnectionError(f"gateway down for {amount}")
        ctx.patch({"charged": str(amount)})
        return {"amount": amount, "key": fingerprint(key), "attempt": ctx.attempt}

    @d.step(name="replay.ship")
    def ship(ctx: StepContext, order: dict[str, Any]) -> dict[str, Any]:
        if not ship_fixed:
            raise NonRetryableError(f"no carrier for order {order['id']}")
        return {"tracking": f"TRK-{order['id']}", "charged": ctx.context.get("charged")}

    wf = Workflow("replay_order")
    wf.wait_signal("paid", signal="payment_received")
    wf.step(
        "charge",
        charge,
        after=["paid"],
        args={"amount": "$.input.total", "key": f"$.secret.{SECRET_NAME}"},
    )
    wf.step("ship", ship, after=["charge"], args={"order": "$.input"})
    wf.output({"charge": "$.nodes.charge.output", "ship": "$.nodes.ship.output"})
    d.register(wf)
    return wf
