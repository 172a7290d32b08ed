"""The client's hot statements on PostgreSQL, one round trip each: a start's run row and audit
entry in one statement committed by itself (no ``BEGIN``/``COMMIT`` around it), and the run
reads of ``get()`` and ``wait()`` on their own (no ``BEGIN``/``ROLLBACK``). What one statement
writes is all or nothing: a start refused for an open run of its workflow id leaves no entry."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
from celery import Celery
from support import record_psycopg_statements

from ductor_celery import Ductor, Workflow
from ductor_celery.store.db import get_engine
from ductor_celery.store.schema import audit, workflow_run
from ductor_celery.store.start_requests import RequestKey


@pytest.fixture
def ductor(database_url: str, tmp_path: Path) -> Ductor:
    app = Celery(f"trips{tmp_path.name}", set_as_current=False)
    app.conf.broker_url = "memory://"
    d = Ductor(app, database_url=database_url)
    d.runtime.dispatcher.first_tick = lambda run_id: None  # type: ignore[method-assign]
    d.runtime.dispatcher.wake = lambda run_id: None  # type: ignore[method-assign]
    d.step(name="trips.noop")(lambda ctx: None)
    wf = Workflow("trips")
    wf.step("a", "trips.noop")
    d.register(wf)
    return d


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Every statement psycopg sends from now on, with whether it went in autocommit."""
    return record_psycopg_statements(monkeypatch)


def _entries(database_url: str, run_id: str) -> list[str]:
    with get_engine(database_url).connect() as conn:
        return list(
            conn.execute(sa.select(audit.c.action).where(audit.c.run_id == run_id)).scalars()
        )


def test_a_start_writes_its_run_and_entry_in_one_statement_committed_alone(
    ductor: Ductor, database_url: str, sent: list[tuple[str, bool]]
) -> None:
    ductor.start("trips")  # the first start stores (or finds) the definition
    sent.clear()
    run_id = ductor.start("trips", workflow_id="trips-one").run_id
    assert len(sent) == 1, [s for s, _ in sent]
    statement, alone = sent[0]
    assert "INSERT INTO eec_workflow_run" in statement and "INSERT INTO eec_audit" in statement
    assert alone, "sent in autocommit: no BEGIN or COMMIT round trip"
    assert _entries(database_url, run_id) == ["start"]
    with get_engine(database_url).connect() as conn:
        row = conn.execute(
            sa.select(workflow_run.c.status, workflow_run.c.workflow_id).where(
                workflow_run.c.run_id == run_id
            )
        ).one()
    assert tuple(row) == ("pending", "trips-one")


def test_a_start_refused_for_an_open_run_writes_nothing(
    ductor: Ductor, database_url: str, sent: list[tuple[str, bool]]
) -> None:
    first = ductor.start("trips", workflow_id="trips-taken")
    sent.clear()
    again = ductor.start("trips", workflow_id="trips-taken")
    assert again.run_id == first.run_id, "the open run of the workflow id wins"
    assert any(alone and "INSERT INTO eec_audit" in s for s, alone in sent), sent
    with get_engine(database_url).connect() as conn:
        runs = conn.execute(
            sa.select(sa.func.count()).where(workflow_run.c.workflow_id == "trips-taken")
        ).scalar_one()
        entries = conn.execute(
            sa.select(sa.func.count()).where(audit.c.workflow_id == "trips-taken")
        ).scalar_one()
    assert (runs, entries) == (1, 1), "the refused start's entry went with its run row"


@pytest.mark.parametrize("extra", ["tags", "delay", "request", "large input"])
def test_a_start_with_more_rows_keeps_its_transaction(
    ductor: Ductor, database_url: str, sent: list[tuple[str, bool]], extra: str
) -> None:
    """Tags, a delayed start's timer, a start request and a large input's blob are rows of
    their own: such a start writes them and its run in one transaction, as before."""
    ductor.start("trips")
    sent.clear()
    if extra == "tags":
        run_id = ductor.start("trips", tags={"team": "ops"}).run_id
    elif extra == "delay":
        run_id = ductor.start("trips", delay=3600).run_id
    elif extra == "request":
        handle, created = ductor.client.start_request(RequestKey.api("trips", "k-1"), "trips")
        assert created
        run_id = handle.run_id
    else:
        run_id = ductor.start("trips", input={"blob": "x" * 300_000}).run_id  # over 256 KiB
    writes = [(s, alone) for s, alone in sent if s.startswith("INSERT")]
    assert len(writes) >= 3, [s for s, _ in writes]  # the run, the extra row(s), the entry
    assert not any(alone for _, alone in writes), "one transaction around them all"
    assert _entries(database_url, run_id) == ["start"]
    view = ductor.get(run_id)
    assert view.status == "pending"
    if extra == "tags":
        assert view.tags == {"team": "ops"}
    if extra == "large input":
        assert view.input == {"blob": "x" * 300_000}


def test_get_and_a_finished_wait_read_the_run_alone(
    ductor: Ductor, sent: list[tuple[str, bool]]
) -> None:
    run_id = ductor.start("trips").run_id
    with get_engine(ductor.runtime.settings.database_url).begin() as conn:
        conn.execute(
            sa.update(workflow_run)
            .where(workflow_run.c.run_id == run_id)
            .values(status="cancelled")
        )
    sent.clear()
    assert ductor.get(run_id).status == "cancelled"
    assert ductor.wait(run_id, timeout=5).status == "cancelled"
    run_reads = [(s, alone) for s, alone in sent if "FROM eec_workflow_run" in s]
    assert len(run_reads) == 2, [s for s, _ in sent]
    assert all(alone for _, alone in run_reads), "each read in autocommit"
