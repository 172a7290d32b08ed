"""The Celery app of ``benchmarks/large_values.py``: a two-step run that makes a value of
``size`` characters and measures it, and a batched scatter over its input.

Configured from the environment: ``DUCTOR_DATABASE_URL``, ``E2E_BROKER_URL``, and
``LV_OFFLOAD_BYTES`` (``ductor_offload_bytes``; the benchmark raises it to keep a list inline
for the "small values" side of the scatter). Eager ticks and inline steps are off, so every
tick runs in the coordinator process and every step in the step worker: each process's memory
and I/O is its role's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
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


# -- measurement (``LV_TRACE_DIR`` set by the benchmark) ------------------------------------------
#: What this process did, written to ``$LV_TRACE_DIR/<pid>.json`` when the worker shuts down.
COUNTERS: dict[str, int] = {
    "ticks": 0,
    "computations": 0,
    "tick_value_bytes": 0,
    "blob_bytes_written": 0,
    "blob_bytes_read_by_ticks": 0,
    "blob_chunk_bytes_fetched": 0,
    "steps": 0,
}


def _size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, default=str).encode("utf-8"))


def _install(trace_dir: str) -> None:
    """Count, in this process: each tick's value bytes (the run's state, input, the outputs,
    results, signals, gathers, large values and list pages it computed over, and the arguments
    and output it wrote), blob bytes written, chunk bytes fetched from the database, steps
    run; written at shutdown."""
    from celery.signals import task_postrun, worker_shutdown

    from ductor_celery.coordinator import loop
    from ductor_celery.store import blobs

    real_compute, real_write, real_needs = loop.compute_tick, blobs.write, blobs.read_needs
    real_chunks = blobs._chunks
    memo: dict[int, int] = {}

    def input_size(value: Any) -> int:
        # The run's input is the same object tick after tick (the process caches it).
        key = id(value)
        if key not in memo:
            memo.clear()
            memo[key] = _size(value)
        return memo[key]

    def compute(spec: Any, state: Any, inputs: Any, now: Any) -> Any:
        payload = real_compute(spec, state, inputs, now)
        COUNTERS["computations"] += 1
        if payload.needs:
            return payload
        COUNTERS["ticks"] += 1
        loaded = [
            state.to_json(),
            inputs.outputs,
            [r.output for r in inputs.results],
            [s.payload for s in inputs.signals],
            inputs.gathered,
            inputs.blobs,
            {k: list(v.values()) for k, v in inputs.items.items()},
        ]
        written = [[a.args for a in payload.new_attempts], payload.output]
        COUNTERS["tick_value_bytes"] += input_size(inputs.input) + _size(loaded) + _size(written)
        return payload

    def write(conn: Any, run_id: str, value: Any, text: str | None = None) -> Any:
        ref = real_write(conn, run_id, value, text)
        COUNTERS["blob_bytes_written"] += ref.size
        return ref

    def read_needs(conn: Any, inputs: Any, needs: Any) -> Any:
        found = real_needs(conn, inputs, needs)
        COUNTERS["blob_bytes_read_by_ticks"] += _size(
            [
                [v for k, v in found.blobs.items() if k not in inputs.blobs],
                [list(v.values()) for v in found.items.values()],
            ]
        )
        return found

    def chunks(conn: Any, ref: Any, where: Any = None) -> Any:
        found = real_chunks(conn, ref, where)
        COUNTERS["blob_chunk_bytes_fetched"] += sum(len(c.data) for c in found)
        return found

    loop.compute_tick = compute
    blobs._chunks = chunks
    blobs.write = write
    blobs.read_needs = read_needs

    @task_postrun.connect(weak=False)
    def counted(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "name", "").startswith("lv."):
            COUNTERS["steps"] += 1

    @worker_shutdown.connect(weak=False)
    def report(**_: Any) -> None:
        Path(trace_dir, f"{os.getpid()}.json").write_text(json.dumps(COUNTERS))


if os.environ.get("LV_TRACE_DIR"):
    _install(os.environ["LV_TRACE_DIR"])
