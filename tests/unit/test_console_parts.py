"""The console's pure parts: the graph layout, times typed by people, the runs list's query,
the actions' bodies, and RunPage standing in for the list list_runs used to return."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from support import FakeStep

from ductor_celery import RunPage, RunView
from ductor_celery.definition import Workflow
from ductor_celery.engine.state import NodeState, ScatterState, StepWork
from ductor_celery.engine.status import NodeStatus
from ductor_celery.web.actions import check_body, parse_json
from ductor_celery.web.layout import BOX_H, BOX_W, graph_nodes, layout
from ductor_celery.web.live import node_label, scatter_counts
from ductor_celery.web.params import BadRequest, list_query
from ductor_celery.web.timeparse import parse_time

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def _diamond() -> Any:
    wf = Workflow("d")
    step = FakeStep()
    wf.step("start", step)
    wf.step("left", step, after=["start"])
    wf.step("right", step, after=["start"])
    wf.step("join", step, after=["left", "right"])
    wf.scatter("fan", step, over="$.input.items", after=["join"])
    wf.approval("ok", after=["start"])
    return wf.build()


def test_layout_ranks_nodes_below_their_dependencies_without_overlap() -> None:
    spec = _diamond()
    drawn = layout(graph_nodes(spec))
    at = {b.node.id: b for b in drawn.boxes}
    assert len(drawn.boxes) == 6 and len(drawn.edges) == 6
    for node in spec.nodes:
        for dep in node.after:
            assert at[dep].y + BOX_H < at[node.id].y  # every edge points down
    for a in drawn.boxes:
        for b in drawn.boxes:
            if a is not b and a.y == b.y:
                assert abs(a.x - b.x) >= BOX_W  # side by side, never on top of each other
    assert all(0 <= b.x and b.x + BOX_W <= drawn.width for b in drawn.boxes)
    assert at["fan"].node.caption == "scatter of s.x" and at["ok"].node.caption == "approval"


def test_layout_of_a_long_chain_is_one_column() -> None:
    wf = Workflow("chain")
    for i in range(30):
        wf.step(f"s{i}", FakeStep(), after=[f"s{i - 1}"] if i else [])
    drawn = layout(graph_nodes(wf.build()))
    assert len({b.x for b in drawn.boxes}) == 1
    assert drawn.height > 30 * BOX_H


def test_a_scatter_label_counts_items_not_elements() -> None:
    sc = ScatterState(run="r", base=0, total=1000, next=100, succeeded=30, failed=2)
    sc.branches = {i: None for i in range(30, 98)}  # type: ignore[misc]
    ns = NodeState(status=NodeStatus.RUNNING, work=sc)
    assert scatter_counts(ns) == {"total": 1000, "done": 30, "running": 68, "failed": 2}
    assert node_label(ns) == "30/1000 done · 68 running · 2 failed"
    assert node_label(
        NodeState(status=NodeStatus.RUNNING, generation=3, work=StepWork(attempt=3))
    ) == ("running · attempt 3")
    assert node_label(NodeState()) == "pending"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90s", NOW - timedelta(seconds=90)),
        ("15m", NOW - timedelta(minutes=15)),
        ("2h", NOW - timedelta(hours=2)),
        ("7d", NOW - timedelta(days=7)),
        ("1w", NOW - timedelta(days=7)),
        ("2026-01-02T03:04:05Z", datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)),
        ("2026-01-02 03:04", datetime(2026, 1, 2, 3, 4, tzinfo=UTC)),  # no zone: UTC
        ("2026-01-02", datetime(2026, 1, 2, tzinfo=UTC)),
        (
            "2026-01-02T03:04:05+02:00",
            datetime(2026, 1, 2, 1, 4, 5, tzinfo=UTC),
        ),
    ],
)
def test_times_people_type(text: str, expected: datetime) -> None:
    assert parse_time(text, "since", NOW) == expected


@pytest.mark.parametrize("text", ["yesterday", "2h ago", "5y", "", "99999999w"])
def test_times_that_mean_nothing_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="since"):
        parse_time(text, "since", NOW)


def test_list_query_checks_like_list_runs() -> None:
    got = list_query({"status": ["failed"], "limit": ["20"], "since": ["1h"]}, NOW, strict=True)
    assert got["status"] == "failed" and got["limit"] == 20
    assert got["since"] == NOW - timedelta(hours=1)
    assert list_query({"workflow": [""]}, NOW, strict=True)["workflow"] is None  # empty: any
    for params, needle in [
        ({"limit": ["2", "3"]}, "limit is given 2 times"),
        ({"limit": ["1e3"]}, "limit must be an integer"),
        ({"status": ["nope"]}, "unknown run status"),
        ({"nope": ["1"]}, "unknown query parameter 'nope'"),
    ]:
        with pytest.raises(BadRequest, match=needle):
            list_query(params, NOW, strict=True)
    assert list_query({"node": ["x"]}, NOW, strict=False)["limit"] == 50  # pages ignore extras


def test_action_bodies_have_their_keys_only() -> None:
    assert check_body("pause", None) == {}
    assert check_body("approve", {"node": "ok", "by": "a"}) == {"node": "ok", "by": "a"}
    for action, body, needle in [
        ("approve", {"by": "a"}, "approve needs 'node'"),
        ("resume", {"reason": "x"}, "resume takes no key 'reason' \\(keys: none\\)"),
        ("signal", "name", "must be a JSON object"),
        ("fly", {}, "unknown action 'fly'"),
    ]:
        with pytest.raises(BadRequest, match=needle):
            check_body(action, body)


def test_json_bodies_are_strict() -> None:
    assert parse_json('{"a": [1, 2.5, null]}', "body") == {"a": [1, 2.5, None]}
    assert parse_json("[" * 100 + "]" * 100, "body") is not None  # 100 levels: the limit
    for text, needle in [
        ("[" * 101 + "]" * 101, "nested too deeply"),
        ("[" * 100_000, "nested too deeply|not valid JSON"),
        ("NaN", "not a JSON number"),
        ("1" * 5000, "digits"),
        ("{", "not valid JSON"),
    ]:
        with pytest.raises(BadRequest, match=needle):
            parse_json(text, "body")


def test_a_run_page_behaves_like_the_list_it_replaces() -> None:
    views = list(
        RunView(
            run_id=f"r{i}",
            workflow_id=f"r{i}",
            workflow="w",
            version=1,
            status="running",
            created_at=NOW,
        )
        for i in range(3)
    )
    page = RunPage(runs=views, next_cursor="abc")
    assert (
        len(page) == 3
        and page[0].run_id == "r0"
        and [v.run_id for v in page[1:]]
        == [
            "r1",
            "r2",
        ]
    )
    assert list(page) == list(views) and page == list(views) and views[1] in page
    assert RunPage(runs=[]) == [] and not RunPage(runs=[])
    assert page.runs == views and page == tuple(views)
    assert page.next_cursor == "abc"
