"""Run tags end to end (docs/tags.md): real ``celery worker`` processes (a coordinator and two
step workers), runs started with tags, steps that tag with ``ctx.tag`` (a first attempt that
fails after tagging, a step that runs inline after it, scatter branches), and ``list_runs``
filtering on tags the starts and the steps wrote.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from ductor_celery import RunStatus

pytestmark = pytest.mark.e2e


@pytest.fixture
def tags_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """tags_app's Ductor in this process, pointed at a cluster's database and broker."""

    def make(cluster: Any) -> Any:
        monkeypatch.setenv("DUCTOR_DATABASE_URL", cluster.database_url)
        monkeypatch.setenv("E2E_BROKER_URL", cluster.broker_url)
        sys.modules.pop("tags_app", None)
        return importlib.import_module("tags_app").ductor

    yield make
    sys.modules.pop("tags_app", None)


def test_steps_tag_runs_on_real_workers_and_lists_find_them(
    cluster_factory: Any, tags_client: Any
) -> None:
    cluster = cluster_factory(app="tags_app")
    ductor = tags_client(cluster)
    cluster.start_coordinator()
    cluster.start_steps(concurrency=2, name="steps-a")
    cluster.start_steps(concurrency=2, name="steps-b")
    big = [
        ductor.start("tagged", input={"total": 500, "items": ["x", "y"]}, tags={"customer": c})
        for c in ("c-1", "c-2", "c-1")
    ]
    small = [
        ductor.start("tagged", input={"total": 5, "items": ["x"]}, tags={"customer": c})
        for c in ("c-1", "c-3")
    ]
    views = {h.run_id: ductor.wait(h.run_id, timeout=90) for h in big + small}
    for view in views.values():
        assert view.status == RunStatus.SUCCEEDED, view.error
        assert view.nodes["score"].attempts == 2  # the first attempt failed
        risk = view.output["risk"]
        items = {f"item-{i}": "done" for i in view.input["items"]}
        assert view.tags == {
            "customer": view.tags["customer"],
            "risk": risk,
            "seen-by": "attempt-2",
            "marked": risk,
            **items,
        }, view.tags  # no "first-attempt": that attempt failed

    def found(**tags: str) -> set[str]:
        return {v.run_id for v in ductor.list_runs(tags=tags, limit=100)}

    assert found(risk="high") == {h.run_id for h in big}
    assert found(customer="c-1", risk="high") == {big[0].run_id, big[2].run_id}
    assert found(customer="c-1", risk="low") == {small[0].run_id}
    assert found(**{"item-y": "done"}) == {h.run_id for h in big}
    assert found(**{"first-attempt": "yes"}) == set()
    # ``mark`` ran inline (claimed in the eager tick that folded ``score``; its carrier is the
    # message that began the chain, not its own token) for some runs: those tags went the
    # same way as the others.
    with cluster.engine.connect() as conn:
        inline = conn.execute(
            sa.text(
                "SELECT count(*) FROM eec_workflow_step_attempt "
                "WHERE node = 'mark' AND carrier IS NOT NULL AND carrier <> token"
            )
        ).scalar_one()
    assert inline >= 1
