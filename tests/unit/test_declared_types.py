"""Issue 22, items 1, 6 and 9: data never chooses code. A value's envelope is rebuilt into a
class only if the app declared it (``register_type``, a registered step's annotations); nothing
is imported because data names it; malformed envelopes and Decimals past the bounds stay plain
dicts where they are read and are refused where they come in."""

from __future__ import annotations

import dataclasses
import json
import sys
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Optional

import pytest
from celery import Celery
from hostile_json import (
    HOSTILE_MODULES,
    HOSTILE_PATHS,
    assert_only_plain_or_declared,
    envelope,
    hostile_json,
)
from hypothesis import HealthCheck, given, settings
from pydantic import BaseModel, model_validator

from ductor_celery import Ductor, StepContext
from ductor_celery.declared import declared, register_type
from ductor_celery.payloads import check_json
from ductor_celery.runtime.arguments import ArgumentRefused, prepare
from ductor_celery.runtime.step_context import StepContext as Ctx
from ductor_celery.values import (
    ValueNotDecodable,
    decode,
    decode_as_data,
    decode_lenient,
    encode,
    truthy,
)
from ductor_celery.views import NodeView, RunView

DECLARED_PATHS = ["test_declared_types:Declared", "test_declared_types:NotDeclared"]


class Declared(BaseModel):
    n: int = 0


class NotDeclared(BaseModel):
    n: int = 0


class Boom(BaseModel):
    """A declared model whose validator ends the process if anyone lets it."""

    n: int = 0

    @model_validator(mode="after")
    def _refuse(self) -> Boom:
        if self.n == 13:
            raise SystemExit(3)
        return self


@dataclasses.dataclass
class Leaf:
    at: datetime


@dataclasses.dataclass
class Tree:
    leaves: list[Leaf]
    best: Optional[Leaf] = None  # noqa: UP045 - Optional[...] as users write it


register_type(Declared)
register_type(Boom)

_envelope = envelope


def _hostile(kind: str, path: str, **extra: Any) -> dict[str, Any]:
    key = "data" if kind == "pydantic" else "fields"
    return _envelope(kind, {"class": path, key: {}, **extra})


def test_nothing_hostile_is_imported_by_this_process_to_begin_with() -> None:
    assert not [m for m in HOSTILE_MODULES if m in sys.modules]


@pytest.mark.parametrize("path", [*HOSTILE_PATHS, "test_declared_types:NotDeclared"])
@pytest.mark.parametrize("kind", ["pydantic", "dataclass"])
def test_an_envelope_naming_a_class_imports_nothing_and_stays_a_dict(kind: str, path: str) -> None:
    before = set(sys.modules)
    value = {"v": _hostile(kind, path)}
    for read in (decode, decode_lenient):
        assert read(value) == value
    assert decode_as_data(value) == {"v": {}}  # for an annotated parameter: only its data
    assert RunView.model_validate(_view(value)).input == value
    assert set(sys.modules) == before


def test_a_step_gets_the_dict_it_was_sent_never_an_object() -> None:
    def step(ctx: Any, value: Any, typed: dict[str, Any], bare: Any = None) -> None: ...

    sent = _hostile("dataclass", "ductor_celery.store.runs:RunFilter")
    got = prepare(step, "s", {"value": sent, "typed": sent, "bare": sent})
    assert got["value"] == sent and type(got["value"]) is dict
    # An annotated parameter gets what its annotation makes of the data: a dict here.
    assert got["typed"] == {}


def test_a_declared_class_is_rebuilt() -> None:
    assert decode(encode({"d": Declared(n=2)})) == {"d": Declared(n=2)}
    assert declared("test_declared_types:Declared") is Declared
    assert declared("test_declared_types:NotDeclared") is None


def test_register_type_refuses_anything_but_a_model_or_dataclass() -> None:
    for wrong in (dict, int, Declared(n=1), "test_declared_types:Declared", lambda: None):
        with pytest.raises(TypeError, match="register_type\\(\\) takes a pydantic model"):
            register_type(wrong)  # type: ignore[arg-type]


def test_a_steps_annotations_declare_their_classes_and_their_fields_classes() -> None:
    class_path = f"{__name__}:Tree"
    assert declared(class_path) is None
    d = Ductor(Celery("declared", set_as_current=False), database_url="sqlite://")

    @d.step(name="declared.grow")
    def grow(ctx: StepContext, seed: int) -> list[Tree]:
        return []

    assert declared(class_path) is Tree
    assert declared(f"{__name__}:Leaf") is Leaf  # named by Tree's field, Optional and list
    day = datetime(2024, 1, 1, tzinfo=UTC)
    tree = Tree([Leaf(day)], best=Leaf(day))
    assert decode(encode(tree)) == tree


def test_ductor_register_type_declares() -> None:
    @dataclasses.dataclass
    class Later:  # a class in a function cannot be encoded; declaring it is still checked
        x: int

    d = Ductor(Celery("declared2", set_as_current=False), database_url="sqlite://")
    d.register_type(Later)
    assert declared(f"{__name__}:{Later.__qualname__}") is Later
    with pytest.raises(TypeError):
        d.register_type(42)  # type: ignore[arg-type]


def test_a_declared_class_that_raises_systemexit_while_rebuilt_ends_nothing() -> None:
    boom = encode(Boom(n=1))
    boom["__value__"]["data"]["n"] = 13
    with pytest.raises(ValueNotDecodable, match="SystemExit"):
        decode(boom)
    assert decode_lenient({"b": boom}) == {"b": boom}
    assert RunView.model_validate(_view({"b": boom})).input == {"b": boom}

    def step(ctx: Any, b: Any) -> None: ...

    def typed(ctx: Any, b: Boom) -> None: ...

    with pytest.raises(ArgumentRefused, match="step 's' parameter 'b'.*SystemExit"):
        prepare(step, "s", {"b": boom})
    with pytest.raises(ArgumentRefused, match="step 's' parameter 'b'.*SystemExit"):
        prepare(typed, "s", {"b": boom})


def test_a_steps_context_and_input_never_end_the_worker() -> None:
    boom = encode(Boom(n=1))
    boom["__value__"]["data"]["n"] = 13
    ctx = Ctx(
        run_id="r", workflow_id="w", node="n", branch=None, attempt=1,
        context={"b": boom}, input_fn=lambda: {"b": boom},
    )  # fmt: skip
    assert ctx.context["b"] == boom
    from ductor_celery import NonRetryableError

    with pytest.raises(NonRetryableError, match="the run's input cannot be decoded"):
        _ = ctx.input


# -- item 9: envelopes that lie --------------------------------------------------------------


@pytest.mark.parametrize(
    "envelope",
    [
        _envelope("base64", "!!!"),
        _envelope("base64", 12),
        _envelope("bytes", ["x"]),
        _envelope("datetime", "yesterday"),
        _envelope("datetime", 1700000000),
        _envelope("date", None),
        _envelope("time", "25:00"),
        _envelope("decimal", "twelve"),
        _envelope("decimal", 12),
        _envelope("uuid", "12345678123456781234567812345678"),
        _envelope("uuid", {"hex": "zz"}),
        _envelope("uuid", {"hex": uuid.UUID(int=1).hex, "more": 1}),
        _envelope("pydantic", "test_declared_types:Declared"),
        _envelope("pydantic", {"class": "test_declared_types:Declared"}),
        _envelope("pydantic", {"class": "test_declared_types:Declared", "data": {}, "x": 1}),
        _envelope("dataclass", {"class": "test_declared_types:Leaf", "fields": []}),
        _envelope("pydantic", {"class": ["test_declared_types:Declared"], "data": {}}),
        _envelope("dataclass", {"class": "test_declared_types:Declared", "fields": {}}),
    ],
    ids=lambda e: f"{e['__type__']}-{json.dumps(e['__value__'])[:30]}",
)
def test_a_malformed_envelope_stays_a_plain_dict(envelope: dict[str, Any]) -> None:
    for read in (decode, decode_lenient):
        assert read({"e": envelope}) == {"e": envelope}
    assert truthy(envelope) is True  # the non-empty dict it stays


def test_well_formed_scalar_envelopes_still_read_back() -> None:
    assert decode(_envelope("base64", "aGk=")) == b"hi"
    assert decode(_envelope("decimal", "1.50")) == Decimal("1.50")


# -- item 6: numbers that pin a CPU -----------------------------------------------------------


@pytest.mark.parametrize(
    ("number", "words"),
    [
        (Decimal("1e999999999"), "exponent 999999999, beyond +-1,000"),
        (Decimal("1e-1001"), "exponent -1001"),
        (Decimal("9" * 1001), "1001 digits, over the limit of 1,000"),
        (Decimal("123e999"), "exponent 1001"),
    ],
)
def test_a_decimal_past_the_bounds_is_refused_at_the_door(number: Decimal, words: str) -> None:
    for value in ({"n": number}, {"n": {"__type__": "decimal", "__value__": str(number)}}):
        checked = check_json(value, "input", 1 << 20)
        assert checked.value is None and not checked.too_large
        assert words in (checked.problem or "") and "at $.n" in (checked.problem or "")


def test_decimals_within_the_bounds_are_kept_exactly() -> None:
    for number in (Decimal("1e1000"), Decimal("1e-1000"), Decimal("9" * 1000), Decimal("NaN")):
        checked = check_json({"n": number}, "input", 1 << 20)
        assert checked.problem is None
        assert str(decode(checked.value)["n"]) == str(number)


def test_a_worker_never_converts_a_decimal_past_the_bounds() -> None:
    """An envelope that got past the door (an older writer, a hand-edited row) stays a dict
    in the worker: an ``int`` parameter refuses it at once instead of computing for minutes."""

    def step(ctx: Any, n: int, m: Decimal) -> None: ...

    huge = {"__type__": "decimal", "__value__": "1e999999999"}
    assert decode(huge) == huge
    with pytest.raises(ArgumentRefused, match="parameter 'n'"):
        prepare(step, "s", {"n": huge})
    with pytest.raises(ArgumentRefused, match="parameter 'm'"):
        prepare(step, "s", {"m": huge})


# -- the property: every decoding entry point, arbitrary JSON and envelopes --------------------


def _only_plain_or_declared(value: Any) -> None:
    assert_only_plain_or_declared(value, (Declared, Boom, Leaf, Tree))


def _view(value: Any) -> dict[str, Any]:
    return {
        "run_id": "r",
        "workflow_id": "w",
        "workflow": "wf",
        "version": 1,
        "status": "running",
        "input": value,
        "context": {"c": value},
        "output": value,
        "created_at": datetime(2024, 1, 1, tzinfo=UTC).isoformat(),
    }


def _annotated(ctx: Any, value: Any, declared_arg: Declared, some: dict[str, Any]) -> None: ...


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_json(HOSTILE_PATHS + DECLARED_PATHS))
def test_no_entry_point_imports_or_builds_anything_data_names(value: Any) -> None:
    before = set(sys.modules)
    checked = check_json(value, "input", 1 << 20)
    for stored in (value, checked.value):
        for read in (decode_lenient, decode_as_data):
            _only_plain_or_declared(read(stored))
        try:
            _only_plain_or_declared(decode(stored))
        except ValueNotDecodable:
            pass  # a declared class whose data does not validate: refused, never half-built
        view = RunView.model_validate(_view(stored))
        _only_plain_or_declared([view.input, view.context, view.output])
        _only_plain_or_declared(NodeView(status="succeeded", output=stored).output)
        for args in ({"value": stored}, {"declared_arg": stored}, {"some": stored}):
            try:
                _only_plain_or_declared(prepare(_annotated, "s", args))
            except ArgumentRefused:
                pass  # the attempt fails without retry, naming the parameter
    assert set(sys.modules) == before
