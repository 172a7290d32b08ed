"""The Celery app of ``benchmarks/large_values.py``: a two-step run that makes a value of
``size`` characters and measures it, and a batched scatter over its input.

Configured from the environment: ``DUCTOR_DATABASE_URL``, ``E2E_BROKER_URL``, and
``LV_OFFLOAD_BYTES`` (``ductor_offload_bytes``; the benchmark raises it to keep a list inline
for the "small values" side of the scatter). Eager ticks and inline steps are off, so every
tick runs in the coordinator process and every step in the step worker: each process's memory
and I/O is its role's.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from ductor_celery import Ductor, StepContext, Workflow

app = Celery("large_values_app", broker=os.environ["E2E_BROKER_URL"])
app.conf.update(
    ductor_eager_ticks=False,
    ductor_inline_steps=0,
    ductor_sweep_interval=5.0,
    ductor_offload_bytes=int(os.environ.get("LV_OFFLOAD_BYTES", "262144")),
    worker_hijack_root_logger=False,
)


def build(d: Ductor) -> None:
    """The steps and workflows, on ``d`` (the workers' Ductor, or the benchmark's client)."""

    @d.step(name="lv.make")
    def make(ctx: StepContext, size: int) -> dict[str, Any]:
        return {"text": "x" * size}

    @d.step(name="lv.measure")
    def measure(ctx: StepContext, made: dict[str, Any]) -> int:
        return len(made["text"])

    @d.step(name="lv.double")
    def double(ctx: StepContext, item: dict[str, Any]) -> int:
        return int(item["n"]) * 2

    two = Workflow("lv_two")
    two.step("make", make, args={"size": "$.input.size"})
    two.step("measure", measure, after=["make"], args={"made": "$.nodes.make.output"})
    two.output("$.nodes.measure.output")
    d.register(two)

    scatter = Workflow("lv_scatter")
    scatter.scatter(
        "each",
        double,
        over="$.input",
        item_arg="item",
        batch_size=int(os.environ.get("LV_BATCH", "100")),
        max_parallel=16,
    )
    d.register(scatter)


ductor = Ductor(app)
build(ductor)
