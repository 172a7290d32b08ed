"""The Celery app of the hostile-values end-to-end test (tests/e2e/test_hostile_values_e2e.py).

Configured from the environment like ``e2e_app`` (DUCTOR_DATABASE_URL, E2E_BROKER_URL). Its
steps report what they were handed, so the test sees what a real prefork worker made of an
envelope that names a class.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from celery import Celery
from pydantic import BaseModel, model_validator

from ductor_celery import Ductor, RetryPolicy, StepContext, Workflow

app = Celery("hostile_e2e")
app.conf.update(
    broker_url=os.environ.get("E2E_BROKER_URL", "memory://"),
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    ductor_sweep_interval=0.5,
)
ductor = Ductor(app)


class Guarded(BaseModel):
    """Declared by ``guarded``'s annotation; its validator ends the process on n == 13."""

    n: int

    @model_validator(mode="after")
    def _refuse(self) -> Guarded:
        if self.n == 13:
            raise SystemExit(3)
        return self


@ductor.step(name="hostile.echo", retry=RetryPolicy(max_attempts=3, initial_interval=0.1))
def echo(ctx: StepContext, value: Any) -> dict[str, Any]:
    return {
        "type": type(value).__name__,
        "value": value,
        "imported": sorted(m for m in ("lib2to3.__main__",) if m in sys.modules),
        "pid": os.getpid(),
    }


@ductor.step(name="hostile.guarded", retry=RetryPolicy(max_attempts=3, initial_interval=0.1))
def guarded(ctx: StepContext, g: Guarded) -> int:
    return g.n


echo_wf = Workflow("hostile_echo")
echo_wf.step("echo", echo, args={"value": "$.input.value"})
echo_wf.output("$.nodes.echo.output")
ductor.register(echo_wf)

guarded_wf = Workflow("hostile_guarded")
guarded_wf.step("guarded", guarded, args={"g": "$.input.g"})
ductor.register(guarded_wf)
