"""Issue 27 part 4: export a run from a real store (SQLite and PostgreSQL), replay its steps in
this process, load it into the harness and redrive it there (docs/replay.md).

The run is executed by the production runtime (``local_workers``): it waits for a signal
while paused and resumed (two controls), charges (the first attempt fails, a secret among its
arguments, a context patch) and fails at ``ship`` for good.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from replay_support import SECRET, SECRET_ENV, define, fingerprint

from ductor_celery import Ductor, NodeStatus, NonRetryableError, RunStatus, testing
from ductor_celery.cli import ductor as ductor_cli
from ductor_celery.cli.export import export_of
from ductor_celery.store.export_format import EXPORT_FORMAT, read_export
from ductor_celery.values import decode


def _ductor(url: str, *, ship_fixed: bool = False) -> Ductor:
    d = Ductor(Celery(f"replay{time.monotonic_ns()}", set_as_current=False), database_url=url)
    if url.startswith("sqlite"):
        d.migrate()
    define(d, ship_fixed=ship_fixed)
    return d


def _until(d: Ductor, run_id: str, node: str, status: NodeStatus) -> None:
    deadline = time.monotonic() + 30
    while d.get(run_id).nodes[node].status != status:
        assert time.monotonic() < deadline, d.get(run_id)
        time.sleep(0.02)


def run_order(d: Ductor, order_id: int = 42) -> str:
    """The run, executed by the production runtime; its run id (it ends failed at ship)."""
    with d.local_workers(concurrency=2):
        handle = d.start(
            "replay_order",
            input={"id": order_id, "total": "12.50"},
            workflow_id=f"order-{order_id}",
        )
        _until(d, handle.run_id, "paid", NodeStatus.WAITING)
        d.pause(handle.run_id, reason="hold on")
        d.resume(handle.run_id)
        d.signal(handle.run_id, "payment_received", {"paid_at": "2030-01-01", "by": "card"})
        view = d.wait(handle.run_id, timeout=60)
    assert view.status == RunStatus.FAILED, view.error
    return handle.run_id


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/replay.sqlite3"
    url: str = request.getfixturevalue("database_url")
    return url


@pytest.fixture
def exported(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Ductor, dict[str, Any]]]:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    d = _ductor(db_url)
    run_id = run_order(d)
    yield d, export_of(d, run_id)


def _iso(value: Any) -> bool:
    from datetime import datetime

    return isinstance(value, str) and datetime.fromisoformat(value).tzinfo is not None


def test_the_export_holds_every_section_of_the_run(exported: tuple[Ductor, dict[str, Any]]) -> None:
    d, doc = exported
    view = d.get("order-42")
    text = json.dumps(doc)
    assert SECRET not in text  # secrets stay references
    assert doc["format"] == EXPORT_FORMAT == 1 and doc["kind"] == "ductor-run-export"
    assert _iso(doc["exported_at"])
    run = doc["run"]
    assert run["run_id"] == view.run_id and run["workflow_id"] == "order-42"
    assert (run["workflow"], run["version"], run["status"]) == ("replay_order", 1, "failed")
    assert run["error"]["node"] == "ship" and "no carrier for order 42" in run["error"]["message"]
    assert run["record_version"] >= 5 and run["transition_count"] == len(doc["transitions"])
    assert _iso(run["created_at"]) and _iso(run["finished_at"])
    spec = d.client.definition_of(view.run_id)
    assert doc["definition"] == {
        "spec_hash": spec.spec_hash,
        "name": "replay_order",
        "version": 1,
        "spec": spec.model_dump(mode="json"),
    }
    assert run["spec_hash"] == spec.spec_hash
    assert doc["input"] == run["input"] == {"id": 42, "total": "12.50"}
    assert doc["context"] == {"charged": "12.50"} == run["state"]["context"]

    attempts = [(a["node"], a["attempt"], a["outcome"]) for a in doc["attempts"]]
    assert attempts == [
        ("charge", 1, "failed"),
        ("charge", 2, "succeeded"),
        ("ship", 1, "failed"),
    ]
    first, second, ship = doc["attempts"]
    # Arguments as the step received them, before the worker filled in the secret.
    assert first["args"] == second["args"] == {"amount": "12.50", "key": "$.secret.REPLAY_KEY"}
    assert first["error"]["type"] == "ConnectionError"
    assert first["error"]["message"] == "gateway down for 12.50"
    assert first["retryable"] is True and ship["retryable"] is False
    assert second["output"] == {
        "amount": {"__type__": "decimal", "__value__": "12.50"},
        "key": fingerprint(SECRET),
        "attempt": 2,
    }
    assert second["patch"] == {"charged": "12.50"}
    assert ship["args"] == {"order": {"id": 42, "total": "12.50"}}
    assert ship["error"]["type"] == "NonRetryableError"
    for a in doc["attempts"]:
        assert a["step"] in ("replay.charge", "replay.ship") and a["folded"] is True
        assert all(_iso(a[k]) for k in ("created_at", "claimed_at", "finished_at"))

    [signal] = doc["signals"]
    assert signal["name"] == "payment_received" and signal["applied_to"] == "paid"
    assert signal["payload"] == {"paid_at": "2030-01-01", "by": "card"}
    assert _iso(signal["applied_at"])
    controls = [(c["kind"], c["reason"], c["result"]) for c in doc["controls"]]
    assert controls == [("pause", "hold on", "applied"), ("resume", None, "applied")]

    seqs = [t["seq"] for t in doc["transitions"]]
    assert seqs == sorted(seqs) and len(seqs) == len(set(seqs))
    moves = {(t["node"], t["to_status"]) for t in doc["transitions"]}
    assert {("charge", "succeeded"), ("ship", "failed"), (None, "failed")} <= moves
    assert doc["timer"] is None  # a finished run has nothing to wake it
    assert doc["tags"] == dict(getattr(view, "tags", {}) or {})
    # A file of it reads back to the same rows.
    assert read_export(json.loads(json.dumps(doc))).rows.attempts[1]["output"] == second["output"]


def test_replay_calls_the_current_step_with_the_recorded_arguments(
    exported: tuple[Ductor, dict[str, Any]], tmp_path: Path
) -> None:
    d, doc = exported
    # The succeeded attempt: the same output, its secret resolved again in this process.
    again = testing.replay(doc, node="charge", ductor=d)
    recorded = next(a for a in doc["attempts"] if a["outcome"] == "succeeded")
    assert again == decode(recorded["output"])
    assert again["amount"] == Decimal("12.50") and again["key"] == fingerprint(SECRET)
    # Its failed first attempt: the same error again.
    with pytest.raises(ConnectionError, match="^gateway down for 12.50$"):
        testing.replay(doc, node="charge", attempt=1, ductor=d)
    # The node that failed the run: the same error, by default its latest attempt.
    ship = next(a for a in doc["attempts"] if a["node"] == "ship")
    with pytest.raises(NonRetryableError) as raised:
        testing.replay(doc, node="ship", ductor=d)
    assert str(raised.value) == ship["error"]["message"]
    # The code as it is now: a fixed ship returns, given the same arguments.
    fixed = _ductor(f"sqlite:///{tmp_path}/fixed.sqlite3", ship_fixed=True)
    assert testing.replay(doc, node="ship", ductor=fixed) == {
        "tracking": "TRK-42",
        "charged": "12.50",
    }
    # Nothing was written: the run is as it was, with its three attempts.
    assert d.get("order-42").nodes["ship"].attempts == 1
    assert d.get("order-42").status == RunStatus.FAILED


def test_from_export_then_redrive_finishes_the_run_in_the_harness(
    exported: tuple[Ductor, dict[str, Any]], tmp_path: Path
) -> None:
    d, doc = exported
    fixed = _ductor(f"sqlite:///{tmp_path}/fixed.sqlite3", ship_fixed=True)
    with testing.harness(fixed, from_export=doc) as h:
        assert h.run_id == doc["run"]["run_id"]
        assert h.now.isoformat() == doc["exported_at"]
        before = h.get(h.run_id)
        assert before.status == RunStatus.FAILED and before.nodes["ship"].attempts == 1
        assert before.context == {"charged": "12.50"}
        fixed.redrive(h.run_id)
        after = h.run(h.run_id)
        assert after.status == RunStatus.SUCCEEDED, after.error
        assert after.output == {
            "charge": {"amount": Decimal("12.50"), "key": fingerprint(SECRET), "attempt": 2},
            "ship": {"tracking": "TRK-42", "charged": "12.50"},
        }
        assert after.nodes["charge"].attempts == 2  # kept, not run again
        steps = [m.task for m in h.messages if m.kind == "step"]
        assert steps == ["replay.ship"]
    # The production database is as it was.
    assert d.get("order-42").status == RunStatus.FAILED


def test_ductor_export_prints_the_document_and_fails_in_one_line(
    exported: tuple[Ductor, dict[str, Any]], tmp_path: Path
) -> None:
    d, doc = exported
    runner = CliRunner()
    result = runner.invoke(ductor_cli, ["export", "order-42"], obj=SimpleNamespace(app=d.app))
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert {k: v for k, v in printed.items() if k != "exported_at"} == {
        k: v for k, v in doc.items() if k != "exported_at"
    }
    out = tmp_path / "run.json"
    result = runner.invoke(
        ductor_cli, ["export", doc["run"]["run_id"], "-o", str(out)], obj=SimpleNamespace(app=d.app)
    )
    assert result.exit_code == 0 and result.stdout == ""
    assert read_export(out).run_id == doc["run"]["run_id"]
    nowhere = runner.invoke(
        ductor_cli,
        ["export", "order-42", "-o", str(tmp_path / "no" / "dir.json")],
        obj=SimpleNamespace(app=d.app),
    )
    assert nowhere.exit_code == 1 and nowhere.stdout == ""
    assert nowhere.stderr.startswith("error: cannot write ") and "No such file" in nowhere.stderr
    missing = runner.invoke(ductor_cli, ["export", "no-such-run"], obj=SimpleNamespace(app=d.app))
    assert missing.exit_code == 1 and missing.stdout == ""
    assert missing.stderr.strip() == "error: no run with run id or workflow id 'no-such-run'"
