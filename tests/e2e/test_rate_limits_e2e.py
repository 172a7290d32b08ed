"""Rate limits and run concurrency end to end: real ``celery worker`` processes on two "hosts"
(two workers), many runs of one key at once (docs/flow-control.md).

What is checked is the database's own record of every claim (``claimed_at`` of the attempts,
the bucket's clock) against the promise: over any window of length ``w``, one key starts at
most ``N + floor(w * N / period)`` attempts. The steps' own log shows each ran exactly once.
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from ductor_celery import RunStatus

pytestmark = pytest.mark.e2e

N = 4  # rate_app's default "4/s"
INTERVAL = 1.0 / N


@pytest.fixture
def rate_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """rate_app's Ductor in this process, pointed at a cluster's database and broker."""

    def make(cluster: Any) -> Any:
        monkeypatch.setenv("DUCTOR_DATABASE_URL", cluster.database_url)
        monkeypatch.setenv("E2E_BROKER_URL", cluster.broker_url)
        sys.modules.pop("rate_app", None)
        module = importlib.import_module("rate_app")
        with cluster.engine.begin() as conn:
            conn.execute(sa.text(module.LOG_DDL))
        return module.ductor

    yield make
    sys.modules.pop("rate_app", None)


def _claims(cluster: Any, customer: str) -> list[float]:
    """Claim times of the key's attempts, in seconds, in order."""
    with cluster.engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT extract(epoch FROM claimed_at) FROM eec_workflow_step_attempt "
                "WHERE rate_key = :k AND claimed_at IS NOT NULL ORDER BY claimed_at"
            ),
            {"k": f"rate.limited|{customer}"},
        ).scalars()
        return [float(t) for t in rows]


def _over_the_bucket(claims: list[float]) -> list[tuple[int, int, float]]:
    """Every window [claims[i], claims[j]] holding more claims than the bucket allows. Every
    claim is stamped with the time its bucket took its token at (a worker's claim, and an
    inline one by the take in its tick's commit: ``rates.take_for_claim``), so the bucket's
    promise holds on ``claimed_at`` exactly."""
    bad = []
    for i, start in enumerate(claims):
        for j in range(i, len(claims)):
            window = claims[j] - start
            if j - i + 1 > N + int(window / INTERVAL + 1e-6):
                bad.append((i, j, window))
    return bad


def test_two_workers_never_start_one_key_faster_than_its_bucket(
    cluster_factory: Any, rate_client: Any
) -> None:
    cluster = cluster_factory(app="rate_app")
    ductor = rate_client(cluster)
    cluster.start_coordinator()
    cluster.start_steps(concurrency=2, name="steps-a")
    cluster.start_steps(concurrency=2, name="steps-b")
    acme = [ductor.start("rated", input={"customer": "acme"}) for _ in range(20)]
    globex = [ductor.start("rated", input={"customer": "globex"}) for _ in range(N)]
    for handle in acme + globex:
        view = ductor.wait(handle.run_id, timeout=60)
        assert view.status == RunStatus.SUCCEEDED, cluster.logs()

    acme_claims = _claims(cluster, "acme")
    globex_claims = _claims(cluster, "globex")
    assert len(acme_claims) == 20 and len(globex_claims) == N
    assert _over_the_bucket(acme_claims) == []
    # The bucket was the brake: 20 claims from a bucket of 4 refilled at 4/s need 4 s at the
    # least (16 refills), whatever the workers could do.
    assert acme_claims[-1] - acme_claims[0] >= (20 - N) * INTERVAL - 0.01
    # The other key was not held behind acme's waiters: its whole burst went through before
    # acme's ninth claim (which its bucket allows 1 s after its first at the earliest).
    assert max(globex_claims) < acme_claims[8], (globex_claims, acme_claims)
    with cluster.engine.connect() as conn:
        ran = conn.execute(sa.text("SELECT run_id FROM rate_log")).scalars().all()
        waiting = conn.execute(
            sa.text(
                "SELECT count(*) FROM eec_workflow_step_attempt WHERE rate_wait_since IS NOT NULL"
            )
        ).scalar_one()
    assert sorted(ran) == sorted(h.run_id for h in acme + globex)  # each step ran once
    assert waiting == 0
    gaps = [b - a for a, b in zip(acme_claims, acme_claims[1:], strict=False)]
    print(  # noqa: T201
        f"\nacme: 20 claims over {acme_claims[-1] - acme_claims[0]:.2f}s "
        f"(bucket minimum {(20 - N) * INTERVAL:.2f}s), largest gap {max(gaps) * 1000:.0f} ms"
    )


def _wait_inside(cluster: Any, run_id: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with cluster.engine.connect() as conn:
            if conn.execute(
                sa.text("SELECT 1 FROM rate_log WHERE run_id = :r"), {"r": run_id}
            ).first():
                return
        time.sleep(0.02)
    raise AssertionError(f"run {run_id} never entered its step:\n{cluster.logs()}")


def test_one_run_per_key_at_a_time_and_waiters_by_priority(
    cluster_factory: Any, rate_client: Any
) -> None:
    cluster = cluster_factory(app="rate_app")
    ductor = rate_client(cluster)
    cluster.start_coordinator()
    cluster.start_steps(concurrency=2, name="steps-a")
    cluster.start_steps(concurrency=2, name="steps-b")
    holder = ductor.start("one_at_a_time", input={"customer": "acme", "seconds": 1.0})
    _wait_inside(cluster, holder.run_id)
    # Four more while the holder runs: they wait, and go by priority, then start order.
    waiting = {
        name: ductor.start(
            "one_at_a_time", input={"customer": "acme", "seconds": 0.2}, priority=priority
        )
        for name, priority in (("low", 1), ("default", 0), ("urgent", 9), ("mid", 5))
    }
    other = ductor.start("one_at_a_time", input={"customer": "globex", "seconds": 0.2})
    for handle in [holder, other, *waiting.values()]:
        view = ductor.wait(handle.run_id, timeout=60)
        assert view.status == RunStatus.SUCCEEDED, cluster.logs()
    with cluster.engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT run_id, entered_at, exited_at FROM rate_log WHERE customer = 'acme' "
                "ORDER BY entered_at"
            )
        ).all()
        globex = conn.execute(
            sa.text("SELECT entered_at FROM rate_log WHERE customer = 'globex'")
        ).scalar_one()
        slots = conn.execute(sa.text("SELECT count(*) FROM eec_run_slot")).scalar_one()
    by_run = {h.run_id: name for name, h in waiting.items()} | {holder.run_id: "holder"}
    assert [by_run[r.run_id] for r in rows] == ["holder", "urgent", "mid", "low", "default"]
    for before, after in zip(rows, rows[1:], strict=False):
        assert before.exited_at <= after.entered_at  # never two of acme's runs at once
    assert globex < rows[0].exited_at  # another key did not wait for acme's line
    assert slots == 0  # every run's slot released with its end


def test_cancel_in_progress_and_cancel_newest_on_real_workers(
    cluster_factory: Any, rate_client: Any
) -> None:
    cluster = cluster_factory(app="rate_app")
    ductor = rate_client(cluster)
    cluster.start_coordinator()
    cluster.start_steps(concurrency=2)
    acme = {"customer": "acme", "seconds": 0.1}
    # cancel_in_progress: the newer run makes the older one cancel, then starts.
    older = ductor.start("one_cancel_in_progress", input=acme)
    _wait_inside(cluster, older.run_id)
    newer = ductor.start("one_cancel_in_progress", input=acme)
    assert ductor.wait(older.run_id, timeout=30).status == RunStatus.CANCELLED
    _wait_inside(cluster, newer.run_id)  # it ran its step once the older one had ended
    ductor.signal(newer.run_id, "go")
    assert ductor.wait(newer.run_id, timeout=30).status == RunStatus.SUCCEEDED
    # cancel_newest: the run beyond the limit is cancelled at once, naming the limit.
    first = ductor.start("one_cancel_newest", input=acme)
    _wait_inside(cluster, first.run_id)
    refused = ductor.wait(ductor.start("one_cancel_newest", input=acme).run_id, timeout=30)
    assert refused.status == RunStatus.CANCELLED
    assert refused.error["type"] == "RunConcurrencyLimit", refused.error
    assert refused.nodes["work"].status.value == "pending"  # it never ran a step
    ductor.signal(first.run_id, "go")
    assert ductor.wait(first.run_id, timeout=30).status == RunStatus.SUCCEEDED
    with cluster.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM eec_run_slot")).scalar_one() == 0
