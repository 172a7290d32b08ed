"""The run row's state names the nodes it does not hold (store/done_nodes.py; migration 0020):
a step node that succeeded at its first attempt is kept by its attempt row (``done``), a node
that never started is a name (``unstarted``), and PostgreSQL gives both back wherever a
state is read (``eec_run_state``). What every commit stored reads back as the state the tick
computed; a reader that skips the function fails loudly; a lost attempt row is an error,
never a pending node.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from support import recording_ductor, run_to_end

from ductor_celery import Workflow
from ductor_celery.engine.state import RunState
from ductor_celery.store import pg_commit

STEPS = 4


@pytest.fixture
def chain(database_url: str) -> Any:
    d = recording_ductor(database_url, "done_nodes")

    @d.step(name="dn.step")
    def step(ctx: Any, value: int = 0) -> int:
        return value + 1

    wf = Workflow("dn_chain")
    for i in range(STEPS):
        args = {"value": f"$.nodes.s{i - 1}.output"} if i else {"value": "$.input.value"}
        wf.step(f"s{i}", step, after=[f"s{i - 1}"] if i else [], args=args)
    wf.output(f"$.nodes.s{STEPS - 1}.output")
    d.register(wf)
    d.url = database_url  # type: ignore[attr-defined]
    return d


def _raw_and_whole(url: str, run_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    with psycopg.connect(url.replace("postgresql+psycopg", "postgresql")) as conn:
        row = conn.execute(
            "SELECT state, eec_run_state(state, run_id) FROM eec_workflow_run WHERE run_id = %s",
            (run_id,),
        ).fetchone()
    assert row is not None
    return row[0], row[1]


def test_every_commit_reads_back_as_the_state_its_tick_computed(
    chain: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = pg_commit.commit
    seen: list[tuple[dict[str, Any], RunState]] = []

    def commit(conn: Any, **kw: Any) -> Any:
        done = real(conn, **kw)
        if done.matched:
            raw, whole = _raw_and_whole(chain.url, kw["run_id"])
            seen.append((raw, whole, kw["payload"].state))
        return done

    monkeypatch.setattr(pg_commit, "commit", commit)
    run_id = run_to_end(chain, "dn_chain", {"value": 10})
    assert chain.get(run_id).output == 10 + STEPS
    assert len(seen) >= STEPS
    for _raw, whole, computed in seen:
        assert RunState.from_json(whole) == computed
    # The store names what it does not hold: by the end, every step is in "done".
    last_raw = seen[-1][0]
    assert last_raw["done"].split(",") == [f"s{i}" for i in range(STEPS)]
    assert last_raw["open"] == {}
    # "nodes" is null: a process from before 0.3.18 (a rolling upgrade's) fails on such a
    # state (its ``data.get("nodes", {}).items()``) instead of reading succeeded steps as
    # pending and running them again.
    assert last_raw["nodes"] is None
    with pytest.raises(AttributeError):
        {k: v for k, v in last_raw.get("nodes", {}).items()}  # noqa: C416 - as 0.3.17 reads it
    first_raw = seen[0][0]
    assert set(first_raw["unstarted"].split(",")) == {f"s{i}" for i in range(1, STEPS)}


def test_a_state_read_without_the_function_is_refused(chain: Any) -> None:
    run_id = run_to_end(chain, "dn_chain", {"value": 1})
    raw, whole = _raw_and_whole(chain.url, run_id)
    with pytest.raises(ValueError, match="nodes was read without them"):
        RunState.from_json(raw)
    state = RunState.from_json(whole)
    assert [n.status.value for n in state.nodes.values()] == ["succeeded"] * STEPS
    # Every reader gets the whole state: the run's view lists every node.
    view = chain.get(run_id)
    assert view.status == "succeeded"


def test_a_done_node_whose_attempt_row_is_gone_is_an_error_not_a_pending_node(
    chain: Any,
) -> None:
    run_id = run_to_end(chain, "dn_chain", {"value": 1})
    with psycopg.connect(chain.url.replace("postgresql+psycopg", "postgresql")) as conn:
        conn.execute("DELETE FROM eec_workflow_step_attempt WHERE token = %s", (f"{run_id}:s1:1",))
    _raw, whole = _raw_and_whole(chain.url, run_id)
    assert whole["done"] == "s1"
    with pytest.raises(ValueError, match="s1"):
        RunState.from_json(whole)


def test_the_downgrade_writes_every_state_back_whole(chain: Any) -> None:
    """Code from before migration 0020 knows no ``done`` or ``unstarted``: the downgrade
    writes each compact state back whole, as the function gives it."""
    from ductor_celery.store.db import forget_engine
    from ductor_celery.store.migrate import downgrade, upgrade

    run_id = run_to_end(chain, "dn_chain", {"value": 1})
    raw, whole = _raw_and_whole(chain.url, run_id)
    assert "done" in raw
    forget_engine(chain.url)
    downgrade(chain.url, "0019")
    with psycopg.connect(chain.url.replace("postgresql+psycopg", "postgresql")) as conn:
        row = conn.execute(
            "SELECT state FROM eec_workflow_run WHERE run_id = %s", (run_id,)
        ).fetchone()
    assert row is not None and row[0] == whole
    assert RunState.from_json(row[0]).nodes.keys() == {f"s{i}" for i in range(STEPS)}
    upgrade(chain.url)


def test_the_downgrade_refuses_a_state_whose_done_node_lost_its_attempt_row(
    chain: Any,
) -> None:
    from ductor_celery.store.db import forget_engine
    from ductor_celery.store.migrate import downgrade

    run_id = run_to_end(chain, "dn_chain", {"value": 1})
    with psycopg.connect(chain.url.replace("postgresql+psycopg", "postgresql")) as conn:
        conn.execute("DELETE FROM eec_workflow_step_attempt WHERE token = %s", (f"{run_id}:s0:1",))
    forget_engine(chain.url)
    with pytest.raises(Exception, match="attempt row is gone"):
        downgrade(chain.url, "0019")
    raw, _whole = _raw_and_whole(chain.url, run_id)
    assert raw["done"].split(",") == [f"s{i}" for i in range(STEPS)]  # nothing written


def test_the_plpgsql_function_gives_what_the_sql_one_gave(chain: Any) -> None:
    """Migration 0022 rewrote ``eec_run_state`` in PL/pgSQL (its plan kept by the connection
    instead of made at every call): for stored states of every shape, the same result as
    0020's ``LANGUAGE sql`` body, which its downgrade puts back."""
    from ductor_celery.store.db import forget_engine
    from ductor_celery.store.migrate import downgrade, upgrade

    run_id = run_to_end(chain, "dn_chain", {"value": 1})
    raw, _whole = _raw_and_whole(chain.url, run_id)
    inputs: list[tuple[str | None, str]] = [
        (None, run_id),
        ('{"nodes": {"a": {"status": "pending"}}, "status": "running"}', run_id),
        ('{"nodes": null, "open": {}, "done": "", "unstarted": "a,b"}', run_id),
        ('{"nodes": null, "open": {"x": {"status": "running"}}, "done": "s0,s2"}', run_id),
        ('{"nodes": null, "open": {}, "done": "s0,gone"}', run_id),  # a lost attempt row
        ('{"nodes": null, "open": {}, "done": "s1"}', "f" * 32),  # another run's names
    ]
    dsn = chain.url.replace("postgresql+psycopg", "postgresql")

    def results() -> tuple[str, list[Any]]:
        with psycopg.connect(dsn) as conn:
            (language,) = conn.execute(
                "SELECT l.lanname FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang "
                "WHERE p.proname = 'eec_run_state'"
            ).fetchone() or ("missing",)
            found = [
                conn.execute("SELECT eec_run_state(%s::jsonb, %s)", (text, of_run)).fetchone()
                for text, of_run in inputs
            ]
            found.append(
                conn.execute(
                    "SELECT eec_run_state(state, run_id) FROM eec_workflow_run WHERE run_id = %s",
                    (run_id,),
                ).fetchone()
            )
        return language, found

    language, now = results()
    assert language == "plpgsql"
    assert now[0] == (None,) and now[3][0]["nodes"]["s2"]["status"] == "succeeded"
    assert now[4][0]["done"] == "gone" and now[5][0]["done"] == "s1"
    assert "done" in raw and now[-1][0]["nodes"].keys() == {f"s{i}" for i in range(STEPS)}
    forget_engine(chain.url)
    downgrade(chain.url, "0021")
    try:
        language, before = results()
        assert language == "sql"
        assert before == now
    finally:
        forget_engine(chain.url)
        upgrade(chain.url)
    assert results()[0] == "plpgsql"
