"""Raw Celery's figures, the baseline of every ratio: a 10-task chain's latency, plain tasks/s."""

from __future__ import annotations

import time
from typing import Any

from common import STEPS, log, payload_items, summary_ms
from harness import Bench


def raw_chain_once(bench: Bench) -> float:
    from celery import chain

    items = bench.args.payload_items
    first: Any
    if items:  # each task passes a document on (--payload-items), as ductor's steps do
        document = {"n": 0, "items": payload_items(items)}
        task, first = bench.app.raw_carry, document
        expected: Any = {"n": STEPS, "items": document["items"]}
    else:
        task, first, expected = bench.app.raw_echo, 0, STEPS
    t0 = time.perf_counter()
    result = chain(task.s(first), *(task.s() for _ in range(STEPS - 1))).apply_async()
    value = result.get(timeout=60)
    elapsed = time.perf_counter() - t0
    if value != expected:
        raise RuntimeError(f"raw chain returned {value!r}")
    result.forget()
    return elapsed


def raw_latency(bench: Bench) -> dict[str, float]:
    for _ in range(bench.args.warmup):
        raw_chain_once(bench)
    samples = [raw_chain_once(bench) for _ in range(bench.args.runs)]
    figures = summary_ms(samples)
    log(f"raw chain latency: {figures}")
    return figures


def raw_throughput(bench: Bench) -> dict[str, Any]:
    import redis

    n = bench.args.raw_tasks
    counter = redis.Redis.from_url(bench.redis.url(3))
    counter.set(bench.app.COUNTER_KEY, 0)
    task = bench.app.raw_count
    t0 = time.perf_counter()
    with bench.app.raw.producer_or_acquire() as producer:
        for i in range(n):
            task.apply_async(args=[i], producer=producer)
    t_sent = time.perf_counter()
    deadline = t0 + bench.args.phase_timeout
    while int(counter.get(bench.app.COUNTER_KEY) or 0) < n:
        if time.perf_counter() > deadline:
            raise RuntimeError("raw throughput: tasks not done in time")
        time.sleep(0.005)
    wall = time.perf_counter() - t0
    counter.close()
    figures = {
        "tasks": n,
        "wall_s": round(wall, 3),
        "send_phase_s": round(t_sent - t0, 3),
        "tasks_per_s": round(n / wall, 1),
    }
    log(f"raw throughput: {figures}")
    return figures


def raw_phases(bench: Bench) -> None:
    with bench.cpu_phase(
        "raw_chain_latency", (bench.args.runs + bench.args.warmup) * STEPS, "task"
    ):
        bench.results["raw_chain_latency"] = raw_latency(bench)
    with bench.cpu_phase("raw_throughput", bench.args.raw_tasks, "task"):
        bench.results["raw_throughput"] = raw_throughput(bench)
