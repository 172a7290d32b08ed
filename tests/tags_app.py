"""The Celery app of the run-tags end-to-end test (tests/e2e/test_tags_e2e.py).

Configured from the environment like ``rate_app`` (DUCTOR_DATABASE_URL, E2E_BROKER_URL).
``score`` tags the run from its input and fails its first attempt after tagging (that
attempt's tags must be dropped); ``mark`` follows it (inline on the worker that folded
``score`` where eager ticks allow) and tags again; ``each`` tags from scatter branches.
"""

from __future__ import annotations

import os

from celery import Celery

from ductor_celery import Ductor, RetryPolicy, StepContext, Workflow

app = Celery("tags_e2e")
app.conf.update(
    broker_url=os.environ.get("E2E_BROKER_URL", "memory://"),
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    ductor_sweep_interval=0.2,
)
ductor = Ductor(app)


@ductor.step(name="tags.score", retry=RetryPolicy(max_attempts=3, initial_interval=0.05))
def score(ctx: StepContext, total: int) -> str:
    risk = "high" if total > 100 else "low"
    ctx.tag("risk", risk)
    ctx.tag("seen-by", f"attempt-{ctx.attempt}")
    if ctx.attempt == 1:
        ctx.tag("first-attempt", "yes")  # dropped: this attempt fails
        raise ConnectionError("the scoring service is down")
    return risk


@ductor.step(name="tags.mark")
def mark(ctx: StepContext, risk: str) -> str:
    ctx.tag("marked", risk)
    return "ok"


@ductor.step(name="tags.each")
def each(ctx: StepContext, item: str) -> str:
    ctx.tag(f"item-{item}", "done")
    return item


flow = Workflow("tagged")
flow.step("score", score, args={"total": "$.input.total"})
flow.step("mark", mark, after=["score"], args={"risk": "$.nodes.score.output"})
flow.scatter("each", each, over="$.input.items", item_arg="item", after=["mark"])
flow.output({"risk": "$.nodes.score.output"})
ductor.register(flow)
