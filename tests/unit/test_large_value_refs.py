"""Large values by reference, the pure parts (docs/large-values.md): the reference format, the
chunks a value is cut into and read back from, the door check, and how the pure tick treats
references (opaque where a path names the whole value; a need where it reads inside one or a
scatter dispatches items of an offloaded list)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import CFG, NOW, RUN, pure_tick

from ductor_celery.definition import Workflow
from ductor_celery.definition.blobrefs import (
    REF_KEY,
    BlobRef,
    chunks_of,
    contains_ref,
    describe,
    page_of,
    ref_of,
    refs_in,
    replace_refs,
    reserved_key_problem,
    value_of,
)
from ductor_celery.engine import AttemptResult, RunState, TickInputs
from ductor_celery.errors import DefinitionError

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=30),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=30,
)


def _text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def test_a_reference_round_trips_and_malformed_ones_are_plain_values() -> None:
    ref = BlobRef("a" * 32, 10, "b" * 64, 3)
    assert ref_of(ref.to_json()) == ref
    assert ref_of(BlobRef("c" * 32, 5, "d" * 64).to_json()) == BlobRef("c" * 32, 5, "d" * 64)
    for not_one in (
        {REF_KEY: "x"},
        {REF_KEY: {"id": 1, "size": 1, "sha256": "s"}},
        {REF_KEY: {"id": "i", "size": True, "sha256": "s"}},
        {REF_KEY: {"id": "i", "size": 1, "sha256": "s", "items": "3"}},
        {**ref.to_json(), "other": 1},
        [ref.to_json()],
    ):
        assert ref_of(not_one) is None
    assert contains_ref({"a": [1, {"b": ref.to_json()}]})
    assert not contains_ref({"a": [1, {"b": {REF_KEY: "x"}}]})
    assert refs_in({"a": [ref.to_json(), 2]}) == [ref]
    assert replace_refs({"a": [ref.to_json(), 2]}, {ref.id: "v"}) == {"a": ["v", 2]}


@given(JSON, st.integers(min_value=1, max_value=64))
def test_any_value_is_cut_into_chunks_and_read_back(value: Any, chunk_bytes: int) -> None:
    text = _text(value)
    ref = describe(value, text, "0" * 32)
    chunks = chunks_of(value, text, chunk_bytes)
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert value_of(chunks, ref) == value
    if ref.items is None:
        assert all(len(c.data) <= chunk_bytes for c in chunks)
        assert ref.size == len(text.encode("utf-8"))


@given(
    st.lists(JSON, min_size=1, max_size=40),
    st.integers(min_value=1, max_value=200),
    st.data(),
)
def test_a_list_is_cut_between_items_and_any_page_reads_only_its_chunks(
    items: list[Any], chunk_bytes: int, data: st.DataObject
) -> None:
    text = _text(items)
    ref = describe(items, text, "0" * 32)
    assert ref.items == len(items)
    chunks = chunks_of(items, text, chunk_bytes)
    firsts = [c.first_item for c in chunks]
    assert firsts[0] == 0 and firsts == sorted(firsts) and len(set(firsts)) == len(firsts)
    for chunk in chunks:  # whole items; over the size only when one item alone is
        assert isinstance(json.loads(chunk.data), list)
        if len(chunk.data) > chunk_bytes:
            assert len(json.loads(chunk.data)) == 1
    start = data.draw(st.integers(0, len(items) - 1))
    stop = data.draw(st.integers(start + 1, len(items)))
    # The chunks the store reads for the page: from the last one starting at or before
    # ``start`` to those starting before ``stop``.
    low = max(f for f in firsts if f is not None and f <= start)
    needed = [
        (c.first_item, json.loads(c.data))
        for c in chunks
        if c.first_item is not None and low <= c.first_item < stop
    ]
    assert page_of(needed, start, stop) == {i: items[i] for i in range(start, stop)}
    assert value_of(chunks, ref) == items


def test_a_damaged_blob_is_refused_naming_it() -> None:
    value = {"text": "x" * 100}
    text = _text(value)
    ref = describe(value, text, "f" * 32)
    chunks = chunks_of(value, text, 10)
    try:
        value_of(chunks[:-1], ref)
    except ValueError as exc:
        assert "f" * 32 in str(exc)
    else:
        raise AssertionError("a missing chunk went unnoticed")


def test_the_reserved_key_is_refused_at_the_door_naming_where() -> None:
    value = {"a": [{"b": {REF_KEY: {}}}]}
    problem = reserved_key_problem(_text(value), value)
    assert problem is not None and "$.a[0].b" in problem
    assert reserved_key_problem(_text({"a": REF_KEY}), {"a": REF_KEY}) is None
    assert reserved_key_problem('{"a": 1}', {"a": 1}) is None


def _two_steps() -> Any:
    wf = Workflow("refs")
    wf.step("make", "make")
    wf.step(
        "use",
        "use",
        after=["make"],
        args={"whole": "$.nodes.make.output", "part": "$.nodes.make.output.tag"},
    )
    return wf.build()


def test_a_path_inside_a_reference_is_a_need_and_the_whole_value_travels_as_the_reference() -> None:
    spec = _two_steps()
    ref = BlobRef("e" * 32, 400_000, "0" * 64)
    first = pure_tick(
        spec, RunState.initial(spec.graph.order), TickInputs(run_id=RUN, config=CFG), NOW
    )
    token = first.new_attempts[0].token
    result = AttemptResult(token=token, node="make", outcome="succeeded", output=ref.to_json())
    without = pure_tick(
        spec, first.state, TickInputs(run_id=RUN, config=CFG, results=(result,)), NOW
    )
    assert without.needs is not None and set(without.needs.values) == {ref.id}
    value = {"tag": "t", "text": "x" * 10}
    with_value = pure_tick(
        spec,
        first.state,
        TickInputs(run_id=RUN, config=CFG, results=(result,), blobs={ref.id: value}),
        NOW,
    )
    assert with_value.needs is None
    (attempt,) = with_value.new_attempts
    assert attempt.args == {"whole": ref.to_json(), "part": "t"}


def test_a_scatter_over_an_offloaded_list_needs_only_the_page_it_dispatches() -> None:
    wf = Workflow("paged")
    wf.scatter("each", "work", over="$.input", max_parallel=3)
    spec = wf.build()
    ref = BlobRef("a" * 32, 900_000, "0" * 64, items=10_000)
    state = RunState.initial(spec.graph.order)
    first = pure_tick(spec, state, TickInputs(run_id=RUN, config=CFG, input=ref.to_json()), NOW)
    assert first.needs is not None and first.needs.pages == {ref.id: (ref, [(0, 3)])}
    page = {i: {"n": i} for i in range(3)}
    second = pure_tick(
        spec,
        state,
        TickInputs(run_id=RUN, config=CFG, input=ref.to_json(), items={ref.id: page}),
        NOW,
    )
    assert second.needs is None
    assert [a.args for a in second.new_attempts] == [{"item": {"n": i}} for i in range(3)]
    scatter = second.state.nodes["each"].scatter
    assert scatter is not None and scatter.total == 10_000 and scatter.next == 3


def test_several_scatters_over_one_offloaded_list_each_get_their_page() -> None:
    """Each scatter adds its span to what the tick needs (none overwrites another's), so one
    read round gives every scatter its page."""
    wf = Workflow("paged_twice")
    wf.scatter("wide", "work", over="$.input", max_parallel=5)
    wf.scatter("narrow", "work", over="$.input", max_parallel=2)
    spec = wf.build()
    ref = BlobRef("b" * 32, 900_000, "0" * 64, items=100)
    state = RunState.initial(spec.graph.order)
    first = pure_tick(spec, state, TickInputs(run_id=RUN, config=CFG, input=ref.to_json()), NOW)
    assert first.needs is not None
    assert first.needs.pages == {ref.id: (ref, [(0, 5), (0, 2)])}
    page = {i: i for i in range(5)}
    second = pure_tick(
        spec,
        state,
        TickInputs(run_id=RUN, config=CFG, input=ref.to_json(), items={ref.id: page}),
        NOW,
    )
    assert second.needs is None
    assert sorted((a.node, a.args["item"]) for a in second.new_attempts) == sorted(
        [("wide", i) for i in range(5)] + [("narrow", i) for i in range(2)]
    )


@given(refused=st.sets(st.integers(min_value=0, max_value=3)))
def test_a_paged_scatter_with_refused_branches_stops_at_its_page_and_is_due_again(
    refused: set[int],
) -> None:
    """A branch refused for its arguments takes no place in the scatter: the tick must not read
    past the page it has (it used to raise KeyError on every tick), and since room is left for
    more branches the run's next tick is due at once, for the next page."""
    wf = Workflow("paged_refused")
    wf.scatter("each", "work", over="$.input", max_parallel=4, tolerated_failures=10)
    spec = wf.build()
    ref = BlobRef("c" * 32, 900_000, "0" * 64, items=20)
    config = dataclasses.replace(CFG, max_payload_bytes=1000)
    page = {i: ("y" * 2000 if i in refused else i) for i in range(4)}
    state = RunState.initial(spec.graph.order)
    tick = pure_tick(
        spec,
        state,
        TickInputs(run_id=RUN, config=config, input=ref.to_json(), items={ref.id: page}),
        NOW,
    )
    assert tick.needs is None
    scatter = tick.state.nodes["each"].scatter
    assert scatter is not None and scatter.next == 4
    assert set(scatter.errors) == refused
    assert sorted(a.args["item"] for a in tick.new_attempts) == sorted(set(range(4)) - refused)
    assert (tick.next_wake_at == NOW) == bool(refused)


@pytest.mark.parametrize(
    "declare",
    [
        lambda wf, ref: wf.step("peek", "peek", args={"x": ref}),
        lambda wf, ref: wf.step("peek", "peek", args={"x": [1, {"deep": ref}]}),
        lambda wf, ref: wf.output({"held": ref}),
        lambda wf, ref: wf.subworkflow("sub", workflow="other", input=ref),
    ],
)
def test_a_definition_literal_cannot_forge_a_reference(declare: Any) -> None:
    """A literal reference in a template would be trusted as ductor's own (a step would read
    another run's blob): refused when the workflow is declared, naming the key."""
    ref = BlobRef("d" * 32, 5000, "0" * 64).to_json()
    wf = Workflow("forger")
    with pytest.raises(DefinitionError, match="'__ductor_blob__' at .* is reserved"):
        declare(wf, ref)
        wf.build()


def test_an_altered_list_chunk_is_refused_though_the_item_count_matches() -> None:
    items = [{"n": i, "text": "t" * 50} for i in range(40)]
    text = _text(items)
    ref = describe(items, text, "e" * 32)
    chunks = chunks_of(items, text, 300)
    assert len(chunks) > 1
    altered = json.loads(chunks[1].data)
    altered[0]["n"] = -1  # same number of items, another value
    chunks[1] = dataclasses.replace(chunks[1], data=json.dumps(altered).encode())
    with pytest.raises(ValueError, match="e{32} does not match its reference"):
        value_of(chunks, ref)
