"""Workflow(...).build(): validation errors, the spec hash, the graph, retry math and paths."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import FakeStep

from ductor_celery.definition import RetryPolicy, RetrySpec, Workflow
from ductor_celery.definition.builder import StepLike
from ductor_celery.definition.paths import Scope, is_path, iter_paths, parse_path, resolve
from ductor_celery.definition.retry import backoff_delay
from ductor_celery.errors import DefinitionError
from ductor_celery.limits import MAX_BACKOFF

KNOWN = {"s": FakeStep("s"), "t": FakeStep("t", timeout=12.0, queue="q-t")}


def resolver(name: str) -> StepLike | None:
    return KNOWN.get(name)


def build_error(wf: Workflow, resolve_step: Any = resolver) -> str:
    with pytest.raises(DefinitionError) as info:
        wf.build(resolve_step)
    return str(info.value)


# --- graph errors ------------------------------------------------------------------------------


def test_two_node_cycle_names_both_nodes() -> None:
    wf = Workflow("w").step("a", "s", after=["b"]).step("b", "s", after=["a"])
    msg = build_error(wf)
    assert "cycle" in msg
    assert "'a'" in msg and "'b'" in msg


def test_three_node_cycle_names_every_node_on_it() -> None:
    wf = (
        Workflow("w")
        .step("root", "s")
        .step("x", "s", after=["root", "z"])
        .step("y", "s", after=["x"])
        .step("z", "s", after=["y"])
    )
    msg = build_error(wf)
    assert "cycle" in msg
    for node in ("x", "y", "z"):
        assert f"'{node}'" in msg
    # The root is not on the cycle and is not blamed.
    assert "'root'" not in msg


def test_cycle_reached_only_through_a_downstream_node_still_names_the_cycle() -> None:
    # 'tail' depends on the cycle; the message must name the cycle, not just the tail.
    wf = (
        Workflow("w")
        .step("tail", "s", after=["p"])
        .step("p", "s", after=["q"])
        .step("q", "s", after=["p"])
    )
    msg = build_error(wf)
    assert "'p'" in msg and "'q'" in msg


def test_self_dependency_is_a_cycle() -> None:
    msg = build_error(Workflow("w").step("a", "s", after=["a"]))
    assert "'a'" in msg and "cycle" in msg


def test_unknown_dependency_names_node_and_dependency() -> None:
    msg = build_error(Workflow("w").step("a", "s").step("b", "s", after=["a", "ghost"]))
    assert "'b'" in msg and "'ghost'" in msg and "unknown" in msg


def test_duplicate_node_id() -> None:
    msg = build_error(Workflow("w").step("a", "s").step("a", "t"))
    assert "duplicate" in msg and "'a'" in msg


def test_unknown_step_by_name_when_resolver_returns_none() -> None:
    msg = build_error(Workflow("w").step("a", "s").step("b", "nope"))
    assert "'b'" in msg and "'nope'" in msg and "unknown step" in msg


def test_step_object_not_registered_with_resolver() -> None:
    msg = build_error(Workflow("w").step("a", FakeStep("elsewhere")))
    assert "'a'" in msg and "'elsewhere'" in msg


def test_step_that_is_neither_name_nor_step_object() -> None:
    msg = build_error(Workflow("w").step("a", 42))  # type: ignore[arg-type]
    assert "'a'" in msg and "42" in msg


def test_unknown_step_names_are_accepted_without_a_resolver() -> None:
    spec = Workflow("w").step("a", "anything").build()
    assert spec.nodes[0].step == "anything"


def test_invalid_node_id() -> None:
    msg = build_error(Workflow("w").step("1abc", "s"))
    assert "'1abc'" in msg


def test_workflow_without_nodes() -> None:
    msg = build_error(Workflow("empty"))
    assert "'empty'" in msg and "no nodes" in msg


@pytest.mark.parametrize(("name", "version"), [("", 1), ("w", 0), ("w", True), ("w", "1")])
def test_bad_workflow_name_or_version(name: str, version: Any) -> None:
    with pytest.raises(DefinitionError):
        Workflow(name, version=version)


# --- path errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "$.inputs.x",  # unknown root
        "$.nodes.a",  # node path without .output
        "$.nodes.a.result",  # node path with something else than .output
        "$.input..x",  # empty segment
        "$.input.x[",  # unterminated index
        "$.",  # nothing after the root marker
    ],
)
def test_malformed_path_in_args_names_the_path(path: str) -> None:
    wf = Workflow("w").step("a", "s").step("b", "s", after=["a"], args={"v": path})
    msg = build_error(wf)
    assert "malformed path" in msg
    assert repr(path) in msg


def test_malformed_path_nested_in_args_is_found() -> None:
    wf = Workflow("w").step("a", "s", args={"deep": {"list": [1, "$.context..k"]}})
    assert "'$.context..k'" in build_error(wf)


def test_malformed_path_in_when_names_the_path() -> None:
    wf = Workflow("w").step("a", "s", when="!$.inputs.flag")
    assert "'!$.inputs.flag'" in build_error(wf)


def test_when_that_is_not_a_path_names_the_node() -> None:
    msg = build_error(Workflow("w").step("a", "s", when="input.flag"))
    assert "'a'" in msg and "'input.flag'" in msg


def test_malformed_path_in_output_names_the_path() -> None:
    wf = Workflow("w").step("a", "s").output({"x": "$.nodes.a"})
    assert "'$.nodes.a'" in build_error(wf)


def test_path_to_missing_node_names_node_and_path() -> None:
    wf = Workflow("w").step("a", "s", args={"v": "$.nodes.zz.output"})
    msg = build_error(wf)
    assert "'a'" in msg and "'$.nodes.zz.output'" in msg and "'zz'" in msg


def test_output_path_to_missing_node() -> None:
    wf = Workflow("w").step("a", "s").output({"r": "$.nodes.zz.output.x"})
    msg = build_error(wf)
    assert "output" in msg and "'zz'" in msg


def test_path_to_node_the_reader_does_not_depend_on() -> None:
    wf = (
        Workflow("w")
        .step("a", "s")
        .step("b", "s")
        .step("c", "s", after=["b"], args={"v": "$.nodes.a.output"})
    )
    msg = build_error(wf)
    assert "'c'" in msg and "'a'" in msg and "does not depend" in msg


def test_when_path_to_node_the_reader_does_not_depend_on() -> None:
    wf = Workflow("w").step("a", "s").step("b", "s", when="$.nodes.a.output.ok")
    msg = build_error(wf)
    assert "'b'" in msg and "'a'" in msg


def test_path_to_a_transitive_ancestor_is_allowed() -> None:
    spec = (
        Workflow("w")
        .step("a", "s")
        .step("b", "s", after=["a"])
        .step("c", "s", after=["b"], args={"v": "$.nodes.a.output"}, when="$.nodes.a.output.go")
        .build(resolver)
    )
    assert spec.graph.reads["c"] == frozenset({"a"})


def test_item_path_outside_a_scatter() -> None:
    msg = build_error(Workflow("w").step("a", "s", args={"i": "$.item.sku"}))
    assert "'a'" in msg and "'$.item.sku'" in msg and "scatter" in msg


def test_item_path_in_output_outside_a_scatter() -> None:
    msg = build_error(Workflow("w").step("a", "s").output("$.item"))
    assert "'$.item'" in msg


@pytest.mark.parametrize("timeout", [0, -1.0, "10"])
def test_bad_node_timeout(timeout: Any) -> None:
    msg = build_error(Workflow("w").step("a", "s", timeout=timeout))
    assert "'a'" in msg and "timeout" in msg


def test_args_must_be_a_mapping() -> None:
    msg = build_error(Workflow("w").step("a", "s", args=["x"]))  # type: ignore[arg-type]
    assert "'a'" in msg and "args" in msg


# --- happy paths -------------------------------------------------------------------------------


def order_workflow(total_path: str = "$.input.order.total") -> Workflow:
    return (
        Workflow("order", version=2)
        .step("reserve", "s", args={"order": "$.input.order"})
        .step("charge", "t", after=["reserve"], args={"amount": total_path}, when=total_path)
        .step("notify", "s", after="charge", args={"r": "$.nodes.reserve.output.id"})
        .output({"charge": "$.nodes.charge.output", "fixed": [1, "two"]})
    )


def test_build_freezes_the_node_settings() -> None:
    spec = order_workflow().build(resolver)
    assert spec.name == "order" and spec.version == 2
    charge = spec.graph.nodes["charge"]
    assert charge.step == "t"
    assert charge.after == ("reserve",)
    assert charge.args == {"amount": "$.input.order.total"}
    assert charge.when == "$.input.order.total"
    assert charge.timeout == 12.0 and charge.queue == "q-t"  # taken from the step object
    assert spec.graph.nodes["notify"].after == ("charge",)  # a single string is one dependency
    assert spec.graph.nodes["reserve"].retry == RetrySpec()  # the default policy


def test_node_retry_overrides_step_retry_and_exceptions_become_names() -> None:
    policy = RetryPolicy(max_attempts=5, initial_interval=0.5, non_retryable=(ValueError,))
    spec = Workflow("w").step("a", "s", retry=policy, timeout=3).build(resolver)
    node = spec.graph.nodes["a"]
    assert node.retry.max_attempts == 5
    assert node.retry.initial_interval == 0.5
    assert node.retry.non_retryable == ("builtins.ValueError",)
    assert node.timeout == 3


def test_spec_hash_is_stable_across_builds() -> None:
    first = order_workflow().build(resolver)
    second = order_workflow().build(resolver)
    assert first is not second
    assert first.spec_hash == second.spec_hash
    assert re.fullmatch(r"[0-9a-f]{64}", first.spec_hash)
    assert first.canonical_json() == second.canonical_json()


def test_spec_hash_differs_for_different_specs() -> None:
    base = order_workflow().build(resolver).spec_hash
    other_path = order_workflow("$.input.order.amount").build(resolver).spec_hash
    other_version = Workflow("order", version=3)
    other_version._nodes = order_workflow()._nodes
    other_version._output = order_workflow()._output
    bumped = other_version.build(resolver).spec_hash
    other_retry = (
        Workflow("order", version=2)
        .step("reserve", "s", args={"order": "$.input.order"}, retry=RetryPolicy(max_attempts=4))
        .step(
            "charge",
            "t",
            after=["reserve"],
            args={"amount": "$.input.order.total"},
            when="$.input.order.total",
        )
        .step("notify", "s", after="charge", args={"r": "$.nodes.reserve.output.id"})
        .output({"charge": "$.nodes.charge.output", "fixed": [1, "two"]})
        .build(resolver)
        .spec_hash
    )
    assert len({base, other_path, bumped, other_retry}) == 4


def test_graph_order_is_topological_and_stable() -> None:
    spec = (
        Workflow("w")
        .step("d", "s", after=["b", "c"])
        .step("b", "s", after=["a"])
        .step("a", "s")
        .step("c", "s", after=["a"])
        .step("e", "s")
        .build(resolver)
    )
    order = spec.graph.order
    assert sorted(order) == ["a", "b", "c", "d", "e"]
    position = {n: i for i, n in enumerate(order)}
    for node in spec.nodes:
        for dep in node.after:
            assert position[dep] < position[node.id], (dep, node.id, order)
    # Roots in declaration order first, then dependants as they become ready.
    assert order == ["a", "e", "b", "c", "d"]
    assert spec.graph.dependants["a"] == ["b", "c"]
    assert spec.graph.dependants["d"] == []


def test_graph_reads_and_output_reads() -> None:
    spec = order_workflow().build(resolver)
    assert spec.graph.reads == {
        "reserve": frozenset(),
        "charge": frozenset(),
        "notify": frozenset({"reserve"}),
    }
    assert spec.graph.output_reads == frozenset({"charge"})


# --- RetryPolicy -------------------------------------------------------------------------------


def test_retry_policy_defaults_match_the_contract() -> None:
    policy = RetryPolicy()
    assert (policy.max_attempts, policy.initial_interval, policy.backoff, policy.max_interval) == (
        3,
        1.0,
        2.0,
        60.0,
    )
    assert policy.non_retryable == ()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"initial_interval": -1.0},
        {"max_interval": -0.5},
        {"backoff": 0.5},
        {"non_retryable": (ValueError, "KeyError")},
        {"non_retryable": (ValueError(),)},
    ],
)
def test_retry_policy_rejects_bad_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(DefinitionError):
        RetryPolicy(**kwargs)


def test_retry_policy_to_spec() -> None:
    class Custom(Exception):
        pass

    spec = RetryPolicy(max_attempts=4, backoff=3.0, non_retryable=(KeyError, Custom)).to_spec()
    assert spec.max_attempts == 4 and spec.backoff == 3.0
    assert spec.non_retryable == (
        "builtins.KeyError",
        f"{__name__}.test_retry_policy_to_spec.<locals>.Custom",
    )


@pytest.mark.parametrize(
    ("failed_attempt", "expected"),
    [(0, 1.0), (1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (6, 32.0), (7, 60.0), (50, 60.0)],
)
def test_backoff_delay_doubles_up_to_the_cap(failed_attempt: int, expected: float) -> None:
    retry = RetrySpec(initial_interval=1.0, backoff=2.0, max_interval=60.0)
    assert backoff_delay(retry, failed_attempt) == expected


def test_backoff_delay_other_shapes() -> None:
    assert backoff_delay(RetrySpec(initial_interval=0.5, backoff=3.0, max_interval=100), 3) == 4.5
    assert backoff_delay(RetrySpec(initial_interval=5.0, backoff=1.0, max_interval=100), 9) == 5.0
    assert backoff_delay(RetrySpec(initial_interval=0.0, backoff=2.0, max_interval=100), 9) == 0.0
    assert backoff_delay(RetrySpec(initial_interval=10.0, backoff=2.0, max_interval=3.0), 1) == 3.0


@pytest.mark.parametrize("backoff", [MAX_BACKOFF, 1e9])
def test_backoff_delay_never_overflows(backoff: float) -> None:
    # A spec refuses a backoff over MAX_BACKOFF; backoff_delay stays total past it anyway.
    huge = RetrySpec.model_construct(
        max_attempts=1000, initial_interval=1.0, backoff=backoff, max_interval=60.0
    )
    for attempt in (1, 2, 10, 40, 65, 999, 10**9):
        delay = backoff_delay(huge, attempt)
        assert math.isfinite(delay) and 0 <= delay <= 60.0
    assert backoff_delay(huge, 1) == 1.0
    assert backoff_delay(huge, 1000) == 60.0


# --- paths -------------------------------------------------------------------------------------


SCOPE = Scope(
    input={"order": {"total": 12, "items": [{"sku": "a"}, {"sku": "b"}], "empty": []}, "f": 0},
    context={"charged": True, "n": None},
    outputs={"reserve": {"id": "r-1", "lines": [10, 20, 30]}, "plain": 7},
)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (5, 5),
        ("plain text", "plain text"),
        ("$ not a path", "$ not a path"),
        (None, None),
        ("$.input.order.total", 12),
        ("$.input.order.items[1].sku", "b"),
        ("$.input.order.items[2].sku", None),  # index out of range
        ("$.input.order.missing.deeper", None),  # missing key
        ("$.input.f.x", None),  # key below a scalar
        ("$.input.order[0]", None),  # index into a dict
        ("$.input.order.items.sku", None),  # key into a list
        ("$.context.charged", True),
        ("$.context.nope", None),
        ("$.nodes.reserve.output", {"id": "r-1", "lines": [10, 20, 30]}),
        ("$.nodes.reserve.output.lines[2]", 30),
        ("$.nodes.plain.output", 7),
        ("$.nodes.unloaded.output.x", None),  # a node whose output was not loaded
        ("!$.input.f", True),
        ("!$.input.order.total", False),
        ("!$.input.missing", True),
        ("!$.input.order.empty", True),
        ("!$.context.charged", False),
    ],
)
def test_resolve_single_values(template: Any, expected: Any) -> None:
    assert resolve(template, SCOPE) == expected


def test_resolve_nested_dicts_and_lists() -> None:
    template = {
        "total": "$.input.order.total",
        "skus": ["$.input.order.items[0].sku", "$.input.order.items[1].sku", "lit"],
        "deep": {"id": "$.nodes.reserve.output.id", "none": "$.context.n", "k": [1, {"x": 2}]},
        "tuple": ("$.input.f", "!$.input.f"),
    }
    assert resolve(template, SCOPE) == {
        "total": 12,
        "skus": ["a", "b", "lit"],
        "deep": {"id": "r-1", "none": None, "k": [1, {"x": 2}]},
        "tuple": [0, True],
    }
    # The template itself is left alone.
    assert template["skus"] == ["$.input.order.items[0].sku", "$.input.order.items[1].sku", "lit"]


def test_resolve_item_root() -> None:
    scope = Scope(input=None, context={}, outputs={}, item={"sku": "z", "n": [4, 5]})
    assert resolve({"s": "$.item.sku", "n": "$.item.n[1]", "all": "$.item"}, scope) == {
        "s": "z",
        "n": 5,
        "all": {"sku": "z", "n": [4, 5]},
    }


def test_parse_path_pieces() -> None:
    path = parse_path("$.nodes.reserve.output.lines[2].x")
    assert (path.root, path.node, path.keys) == ("nodes", "reserve", ("lines", 2, "x"))
    negated = parse_path("!$.input.a-b[0]")
    assert (negated.root, negated.node, negated.keys) == ("input", None, ("a-b", 0))
    assert is_path("$.input") and is_path("!$.context.x")
    assert not is_path("$input") and not is_path(3) and not is_path("!x")


def test_iter_paths_walks_nested_templates() -> None:
    found = iter_paths({"a": ["$.input.x", {"b": "!$.nodes.n.output"}], "c": ("$.context.k",)})
    assert sorted(p.text for p in found) == ["!$.nodes.n.output", "$.context.k", "$.input.x"]


def test_the_graph_lists_the_nodes_each_tick_pass_looks_at_in_topological_order() -> None:
    """``Graph.scatters``, ``parked`` and ``subworkflows``: the only nodes the tick's passes
    over scatters, waits and sub-workflows look at (a pass over a graph without that kind
    does nothing), each in the order the passes used to visit every node."""
    wf = Workflow("kinds")
    wf.step("a", "s")
    wf.sleep("nap", seconds=5, after=["fan"])
    wf.scatter("fan", "s", over="$.input.items", item_arg="x", after=["a"])
    wf.wait_signal("paid", signal="p", after=["a"])
    wf.approval("ok", after=["nap"])
    wf.event_set("kyc", events=["e1", "e2"], after=["a"])
    wf.subworkflow("child", workflow="other", after=["a"])
    wf.scatter("kids", workflow="other", over="$.input.items", as_child_runs=True, after=["a"])
    wf.checkpoint("done", after=["ok"])
    graph = wf.build(resolver).graph
    assert graph.order[:1] == ["a"]
    assert graph.scatters == ("fan", "kids")
    assert graph.parked == ("paid", "kyc", "nap", "ok")
    assert graph.subworkflows == ("child",)  # "nap", declared before "fan", comes after it


# -- a batch's items resolved by one resolver ---------------------------------------------------

_TEMPLATE_LEAVES = st.sampled_from(
    ["$.item", "$.item.a", "$.item.b[1]", "!$.item.a", "$.input.x", "$.context.c", "!$.input.x",
     "$.nodes.n.output.k", "$.secret.token", "plain", 3, None, True]
)  # fmt: skip
_TEMPLATES = st.recursive(
    _TEMPLATE_LEAVES,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(st.sampled_from(["value", "x", "y"]), inner, max_size=3)
    ),
    max_leaves=8,
)
_ITEMS = st.recursive(
    st.none() | st.integers() | st.text(max_size=3) | st.booleans(),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3)
    ),
    max_leaves=6,
)


@given(_TEMPLATES, st.lists(_ITEMS, max_size=4))
def test_an_item_resolver_resolves_each_item_as_resolve_does(template: Any, items: list) -> None:
    from ductor_celery.definition.paths import item_resolver

    scope = Scope(input={"x": [1, {"y": 2}]}, context={"c": "ctx"}, outputs={"n": {"k": 7}})
    of_item = item_resolver(template, scope)
    for item in items:
        with_item = Scope(scope.input, scope.context, scope.outputs, item=item)
        assert of_item(item) == resolve(template, with_item)
