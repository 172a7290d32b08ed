"""Exports as files (docs/replay.md): the committed format-1 export keeps loading, replaying and
redriving; a run exported mid-flight resumes in the harness; every bad file or request is one
``ExportError`` naming the problem, never another exception.

``tests/fixtures/export_format1.json`` was written by ``ductor export`` of a ``replay_order``
run (tests/replay_support.py) on SQLite, as the integration test runs it. Never regenerate it
to make a test pass: it stands for the exports users already hold.
"""

from __future__ import annotations

import copy
import json
import re
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from replay_support import SECRET, SECRET_ENV, define, fingerprint

from ductor_celery import (
    Ductor,
    DuctorError,
    NodeStatus,
    NonRetryableError,
    RunStatus,
    Workflow,
    testing,
)
from ductor_celery.cli.export import export_of
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store.export_format import read_export
from ductor_celery.values import decode

FIXTURE = Path(__file__).parent.parent / "fixtures" / "export_format1.json"


def _ductor(tmp_path: Path, *, ship_fixed: bool = False, steps: bool = True) -> Ductor:
    url = f"sqlite:///{tmp_path}/user{time.monotonic_ns()}.sqlite3"
    d = Ductor(Celery(f"fmt{time.monotonic_ns()}", set_as_current=False), database_url=url)
    if steps:
        define(d, ship_fixed=ship_fixed)
    return d


@pytest.fixture
def secret(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    yield


def _fixture() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(FIXTURE.read_text())
    return loaded


# -- the committed export ----------------------------------------------------------------------


def test_the_committed_format_1_export_still_loads_and_replays(
    tmp_path: Path, secret: None
) -> None:
    doc = _fixture()
    exported = read_export(FIXTURE)
    assert exported.run_id == doc["run"]["run_id"] and exported.source == str(FIXTURE)
    assert [a["outcome"] for a in exported.rows.attempts] == ["failed", "succeeded", "failed"]
    d = _ductor(tmp_path)
    recorded = exported.rows.attempts[1]["output"]
    assert testing.replay(FIXTURE, node="charge", ductor=d) == decode(recorded)
    assert decode(recorded) == {
        "amount": Decimal("12.50"),
        "key": fingerprint(SECRET),
        "attempt": 2,
    }
    with pytest.raises(NonRetryableError, match="^no carrier for order 7$"):
        testing.replay(str(FIXTURE), node="ship", ductor=d)


def test_the_committed_export_redrives_to_success_in_the_harness(
    tmp_path: Path, secret: None
) -> None:
    d = _ductor(tmp_path, ship_fixed=True)
    with testing.harness(d, from_export=FIXTURE) as h:
        assert h.get("order-7").status == RunStatus.FAILED
        d.redrive("order-7")
        view = h.run("order-7")
        assert view.status == RunStatus.SUCCEEDED, view.error
        assert view.output["ship"] == {"tracking": "TRK-7", "charged": "12.50"}
        # Its history goes on from the exported one.
        attempts, transitions = d.client.history(view.run_id, limit=1000)
        assert len(attempts) == 4 and len(transitions) > len(_fixture()["transitions"])


def test_a_run_exported_mid_flight_resumes_in_the_harness(tmp_path: Path, secret: None) -> None:
    """Exported while waiting for its signal, then while its charge attempt is out and not
    claimed: each loads and goes on from there."""
    d = _ductor(tmp_path, ship_fixed=True)
    with testing.harness(d) as h:
        handle = h.start("replay_order", input={"id": 9, "total": "3.10"})
        waiting = export_of(d, handle.run_id)
        # The signal's tick commits the charge attempt and sends its message: not delivered.
        d.signal(handle.run_id, "payment_received", {"by": "card"})
        run_tick(d.runtime, handle.run_id)
        in_flight = export_of(d, handle.run_id)
    assert waiting["run"]["status"] == "running" and waiting["attempts"] == []
    [out] = in_flight["attempts"]
    assert out["claimed_at"] is None and out["finished_at"] is None

    with testing.harness(d, from_export=waiting) as h:
        assert h.get(h.run_id).nodes["paid"].status == NodeStatus.WAITING
        h.signal(h.run_id, "payment_received", {"by": "card"})
        assert h.run(h.run_id).status == RunStatus.SUCCEEDED

    with testing.harness(d, from_export=in_flight) as h:
        queued = [(m.kind, m.token) for m in h.messages]
        assert queued == [("step", out["token"]), ("wakeup", None)]
        view = h.run(h.run_id)
        assert view.status == RunStatus.SUCCEEDED, view.error
        assert view.nodes["charge"].attempts == 2  # the exported one failed, as it does first


# -- bad files and requests ---------------------------------------------------------------------


def _write(tmp_path: Path, value: Any) -> Path:
    path = tmp_path / "run.json"
    path.write_text(value if isinstance(value, str) else json.dumps(value))
    return path


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ({**_fixture(), "format": 2}, "is an export of format 2; this ductor reads format 1"),
        ({**_fixture(), "format": "1"}, "is an export of format '1'"),
        ({"hello": "world"}, 'is not a ductor run export (no "kind": "ductor-run-export"'),
        ([1, 2, 3], "is not a ductor run export"),
        ("{not json", "is not a ductor run export (not JSON"),
        ({k: v for k, v in _fixture().items() if k != "attempts"}, "'attempts' must be a list"),
        ({**_fixture(), "run": {"run_id": "x"}}, "'run' lacks workflow_id"),
        ({**_fixture(), "exported_at": "yesterday"}, "exported_at must be an ISO 8601 time"),
    ],
)
def test_a_file_that_is_not_a_format_1_export_is_one_clear_error(
    tmp_path: Path, content: Any, words: str
) -> None:
    path = _write(tmp_path, content)
    d = _ductor(tmp_path)
    for attempt in (
        lambda: testing.replay(path, node="charge", ductor=d),
        lambda: read_export(path),
    ):
        with pytest.raises(testing.ExportError) as raised:
            attempt()
        assert str(path) in str(raised.value) and words in str(raised.value)
        assert isinstance(raised.value, DuctorError) and isinstance(raised.value, ValueError)
    before = (d.settings, d.runtime.dispatcher)
    with pytest.raises(testing.ExportError, match=re.escape(words)):
        with testing.harness(d, from_export=path):
            pass
    # The Ductor is as it was: no harness half set up.
    assert (d.settings, d.runtime.dispatcher) == before


def test_rows_the_tables_refuse_are_one_clear_error_and_no_harness(tmp_path: Path) -> None:
    doc = _fixture()
    doc["attempts"][1]["token"] = doc["attempts"][0]["token"]  # two attempts, one token
    d = _ductor(tmp_path)
    before = (d.settings, d.runtime.dispatcher)
    with pytest.raises(testing.ExportError) as raised:
        with testing.harness(d, from_export=doc):
            pass
    assert str(raised.value).startswith(
        "the export does not load: its rows are refused by the database (UNIQUE constraint"
    )
    assert (d.settings, d.runtime.dispatcher) == before


def _damaged(section: str, key: str, value: Any) -> dict[str, Any]:
    doc = _fixture()
    (doc[section][0] if isinstance(doc[section], list) else doc[section])[key] = value
    return doc


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        (_damaged("run", "status", "exploded"), "the run's status 'exploded' is not a run status"),
        (_damaged("run", "status", 3), "the run's status must be str, got int"),
        (_damaged("run", "record_version", "7"), "the run's record_version must be int, got str"),
        (_damaged("run", "transition_count", 1.5), "transition_count must be int, got float"),
        (_damaged("run", "priority", True), "the run's priority must be int, got bool"),
        (_damaged("attempts", "outcome", "exploded"), "attempts[0] outcome 'exploded' is not"),
        (_damaged("attempts", "outcome", {"a": 1}), "attempts[0] outcome \"{'a': 1}\" is not"),
        (
            _damaged("attempts", "step", "replay.ship"),
            "attempts[0] step 'replay.ship' is not the step of node 'charge' in the run's "
            "definition ('replay.charge')",
        ),
        (_damaged("attempts", "node", "elsewhere"), "node 'elsewhere' is not a step node of"),
    ],
)
def test_run_and_attempt_columns_a_restore_writes_are_checked(
    tmp_path: Path, doc: dict[str, Any], words: str
) -> None:
    """A status or an outcome ductor never writes would be restored as is and break the
    harness's first tick: refused when the file is read, naming the column."""
    d = _ductor(tmp_path)
    with pytest.raises(testing.ExportError) as raised:
        read_export(doc)
    assert words in str(raised.value)
    with pytest.raises(testing.ExportError, match=re.escape(words)):
        with testing.harness(d, from_export=doc):
            pass


def test_a_missing_file_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(
        testing.ExportError, match=r"nothere.json is not a ductor run export \(no such file\)"
    ):
        read_export(tmp_path / "nothere.json")


def test_a_node_not_in_the_export_is_one_clear_error(tmp_path: Path) -> None:
    d = _ductor(tmp_path)
    with pytest.raises(testing.ExportError) as raised:
        testing.replay(FIXTURE, node="refund", ductor=d)
    assert str(raised.value) == (
        f"node 'refund' is not in workflow 'replay_order' of {FIXTURE} (nodes: paid, charge, ship)"
    )
    with pytest.raises(testing.ExportError, match="node 'paid' has no attempt"):
        testing.replay(FIXTURE, node="paid", ductor=d)
    with pytest.raises(
        testing.ExportError, match=r"no attempt 5 .*\(there: attempt 1, attempt 2\)"
    ):
        testing.replay(FIXTURE, node="charge", attempt=5, ductor=d)


def test_a_step_no_longer_registered_is_one_clear_error(tmp_path: Path) -> None:
    bare = _ductor(tmp_path, steps=False)
    with pytest.raises(testing.ExportError) as raised:
        testing.replay(FIXTURE, node="ship", ductor=bare)
    assert str(raised.value).startswith(
        "step 'replay.ship' (node 'ship') is not registered in this process (registered: none)"
    )


def test_without_ductor_the_one_ductor_registering_the_step_is_used(
    tmp_path: Path, secret: None
) -> None:
    doc = _fixture()
    renamed = json.loads(json.dumps(doc).replace("replay.charge", "replay.charge_only_here"))
    d = Ductor(Celery(f"only{time.monotonic_ns()}", set_as_current=False))

    @d.step(name="replay.charge_only_here")
    def charge(ctx: Any, amount: Decimal, key: str) -> str:
        return f"{ctx.node}:{ctx.attempt}:{amount}:{key == SECRET}:{ctx.input['id']}"

    assert testing.replay(renamed, node="charge") == "charge:2:12.50:True:7"


# Any one key of the document replaced by any JSON value, or dropped: an ExportError, or (a
# value the format accepts there) a document that loads; never another exception.
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    section=st.sampled_from(sorted(_fixture())),
    inner=st.none() | st.sampled_from(["run", "definition", "attempts", "signals", "controls"]),
    value=_json | st.just("__drop__"),
)
def test_any_damaged_key_is_an_export_error_or_loads(
    section: str, inner: str | None, value: Any
) -> None:
    doc = copy.deepcopy(_fixture())
    target = doc
    if inner is not None and section == inner:
        entry = doc[section]
        target = entry[0] if isinstance(entry, list) and entry else entry
        key = sorted(target)[len(str(value)) % len(target)]
    else:
        key = section
    if value == "__drop__":
        target.pop(key)
    else:
        target[key] = value
    try:
        read_export(doc)
    except testing.ExportError as exc:
        assert str(exc).startswith("the export ")


def test_a_scatter_branch_replays_by_branch_and_a_batched_one_is_refused(tmp_path: Path) -> None:
    d = _ductor(tmp_path, steps=False)

    @d.step(name="replay.pack")
    def pack(ctx: Any, item: str, prefix: str) -> str:
        return f"{prefix}{item.upper()}#{ctx.branch}"

    for name, batch_size in (("packing", 1), ("batched", 2)):
        wf = Workflow(name)
        wf.scatter(
            "pack",
            pack,
            over="$.input.items",
            item_arg="item",
            args={"prefix": "$.input.prefix"},
            batch_size=batch_size,
        )
        d.register(wf)
    with testing.harness(d) as h:
        one = h.start("packing", input={"items": ["a", "b", "c"], "prefix": "box-"})
        assert h.run(one).status == RunStatus.SUCCEEDED
        each = export_of(d, one.run_id)
        many = h.start("batched", input={"items": ["a", "b", "c"], "prefix": "box-"})
        assert h.run(many).status == RunStatus.SUCCEEDED
        batched = export_of(d, many.run_id)
    assert testing.replay(each, node="pack", branch=1, ductor=d) == "box-B#1"
    assert testing.replay(each, node="pack", branch=2, ductor=d) == "box-C#2"
    with pytest.raises(
        testing.ExportError,
        match=r"no attempt of branch 7 in the export \(there: attempt 1 of branch 0, ",
    ):
        testing.replay(each, node="pack", branch=7, ductor=d)
    with pytest.raises(testing.ExportError, match="node 'pack' ran batched"):
        testing.replay(batched, node="pack", ductor=d)
