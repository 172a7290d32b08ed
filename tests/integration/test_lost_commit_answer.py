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


def _answer_lost(monkeypatch: pytest.MonkeyPatch, which: str) -> list[str]:
    """The next commit of the kind ``which`` ("first": a run's first tick; "carried": a tick
    carrying an outcome) that claims an attempt for this worker lands, and then the
    connection drops as if before its answer came: a transient error, retried."""
    lost: list[str] = []
    real = pg_commit.commit

    def commit(conn: Any, **kw: Any) -> Any:
        done = real(conn, **kw)
        kind = "carried" if kw.get("carried") is not None else "first"
        if not lost and kind == which and kw.get("claim") is not None:
            lost.append(kw["claim"].token)
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return done

    monkeypatch.setattr(pg_commit, "commit", commit)
    return lost


@pytest.mark.parametrize("which", ["first", "carried"])
def test_a_claim_whose_commit_answer_was_lost_is_still_run_by_its_worker(
    chain: Any, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    lost = _answer_lost(monkeypatch, which)
    run_id = run_to_end(chain, "la_chain", {"value": 10})
    view = chain.get(run_id)
    assert lost, "no commit lost its answer: the test did not test anything"
    assert view.status == "succeeded" and view.output == 10 + STEPS
    # Each step ran once: the claim was run by the worker that held it, and by no one else.
    assert chain.calls == [f"s{i}" for i in range(STEPS)]
    # Nothing went through the broker: the whole chain ran in its first message.
    assert [m.kind for m in chain.queue] == []
