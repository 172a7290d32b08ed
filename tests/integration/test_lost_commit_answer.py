"""A tick commit that landed, but whose answer the worker never got: the connection dropped
after PostgreSQL committed (a failover with synchronous replication: the primary dies while
the commit waits for the standby's acknowledgement, which the standby had sent; a restart; a
network cut). The worker retries the tick, as it retries any transient error, and the retry
finds the run moved on.

When that commit claimed the run's next step for this worker (an inline step, claimed in the
tick's commit with no message: runtime/inline.py), the claim is in the database under an
identity only this worker holds. The retried tick does not create that attempt again (it
exists), so the worker must find its claim and run the step: before, the chain ended and the
step stayed claimed by a worker that had moved on, until the step's timeout (300 s by
default). The end-to-end failover test met it once (tests/e2e/test_failover_e2e.py).
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from support import recording_ductor, run_to_end

from ductor_celery import Workflow
from ductor_celery.store import pg_commit

STEPS = 3


@pytest.fixture
def chain(database_url: str) -> Any:
    d = recording_ductor(database_url, "lost_answer")
    d.calls = []  # type: ignore[attr-defined]

    @d.step(name="la.step")
    def step(ctx: Any, value: int = 0) -> int:
        d.calls.append(ctx.node)  # type: ignore[attr-defined]
        return value + 1

    wf = Workflow("la_chain")
    for i in range(STEPS):
        args = {"value": f"$.nodes.s{i - 1}.output"} if i else {"value": "$.input.value"}
        wf.step(f"s{i}", step, after=[f"s{i - 1}"] if i else [], args=args)
    wf.output(f"$.nodes.s{STEPS - 1}.output")
    d.register(wf)
    return d


def _answer_lost(monkeypatch: pytest.MonkeyPatch, which: str, *, landed: bool = True) -> list[str]:
    """The next commit of the kind ``which`` ("first": a run's first tick; "carried": a tick
    carrying an outcome) that claims an attempt for this worker lands (``landed``; else it
    fails before it reaches the server), and then the connection drops as if before its
    answer came: a transient error, retried."""
    lost: list[str] = []
    real = pg_commit.commit

    def commit(conn: Any, **kw: Any) -> Any:
        kind = "carried" if kw.get("carried") is not None else "first"
        if not lost and kind == which and kw.get("claim") is not None:
            lost.append(kw["claim"].token)
            if landed:
                real(conn, **kw)
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return real(conn, **kw)

    monkeypatch.setattr(pg_commit, "commit", commit)
    return lost


def _ran_once_each(chain: Any, run_id: str, lost: list[str]) -> None:
    view = chain.get(run_id)
    assert lost, "no commit lost its answer: the test did not test anything"
    assert view.status == "succeeded" and view.output == 10 + STEPS
    # Each step ran once: the claim was run by the worker that held it, and by no one else.
    assert chain.calls == [f"s{i}" for i in range(STEPS)]


_RUN_IT = "claimed for this worker by a commit whose answer was lost"


@pytest.mark.parametrize("which", ["first", "carried"])
def test_a_claim_whose_commit_answer_was_lost_is_still_run_by_its_worker(
    chain: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, which: str
) -> None:
    lost = _answer_lost(monkeypatch, which)
    run_id = run_to_end(chain, "la_chain", {"value": 10})
    _ran_once_each(chain, run_id, lost)
    assert [r for r in caplog.records if _RUN_IT in r.getMessage()], "found by the lookup"
    # Nothing went through the broker: the whole chain ran in its first message.
    assert [m.kind for m in chain.queue] == []


@pytest.mark.parametrize("which", ["first", "carried"])
def test_a_claim_whose_commit_did_not_land_is_claimed_again_by_the_retry_and_run_once(
    chain: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, which: str
) -> None:
    """The same token, made again by the retry under a new identity: the choice in doubt
    finds it claimed by another identity and drops it; the retry's claim runs it once."""
    lost = _answer_lost(monkeypatch, which, landed=False)
    run_id = run_to_end(chain, "la_chain", {"value": 10})
    _ran_once_each(chain, run_id, lost)
    assert not [r for r in caplog.records if _RUN_IT in r.getMessage()]


def test_a_first_tick_whose_retry_fails_still_runs_the_claim_its_lost_commit_made(
    chain: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The run's first tick lands with its answer lost, and its retry fails outright (here a
    load that raises; a database away past the retries' deadline does the same): the start
    message's worker wakes the coordinator, and still runs the step its lost commit claimed
    for it, which nobody else would run before the step's timeout."""
    from ductor_celery.store.tick_store import SqlTickTransaction

    lost = _answer_lost(monkeypatch, "first")
    real_load = SqlTickTransaction.load

    def load(self: Any, *args: Any, **kw: Any) -> Any:
        if lost and not failed:
            failed.append(True)
            raise RuntimeError("the retry fails")
        return real_load(self, *args, **kw)

    failed: list[bool] = []
    monkeypatch.setattr(SqlTickTransaction, "load", load)
    run_id = run_to_end(chain, "la_chain", {"value": 10})
    assert failed, "the retry did not fail: the test did not test anything"
    _ran_once_each(chain, run_id, lost)
    assert [r for r in caplog.records if _RUN_IT in r.getMessage()]


@pytest.mark.parametrize("which", ["first", "carried"])
def test_an_outcome_written_by_a_commit_whose_answer_was_lost_is_reported_as_written(
    chain: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, which: str
) -> None:
    """The carried tick's commit wrote the step's outcome and its answer was lost: the retry
    finds the attempt finished. The step's result (Flower's view) and the attempt metrics
    say what it was, as for every other step, not "closed" (an attempt someone else closed,
    counted by whoever closed it)."""
    from ductor_celery.runtime import metrics

    recorded: list[tuple[str, str]] = []
    monkeypatch.setattr(
        metrics, "record_attempt", lambda step, outcome, seconds: recorded.append((step, outcome))
    )
    lost = _answer_lost(monkeypatch, which)
    run_id = run_to_end(chain, "la_chain", {"value": 10})
    _ran_once_each(chain, run_id, lost)
    assert recorded == [("la.step", "succeeded")] * STEPS
    written = [r for r in caplog.records if "this worker's own commit" in r.getMessage()]
    assert len(written) == (1 if which == "carried" else 0)
