"""Issue 15, item 1: typed values in the one tagged JSON encoding (ductor_celery.values), paths
on encoded values, and a step's annotated parameters converted by pydantic."""

from __future__ import annotations

import dataclasses
import json
import uuid
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest
from pydantic import BaseModel

from ductor_celery.declared import register_type
from ductor_celery.definition.paths import Scope, resolve
from ductor_celery.payloads import check_json, json_problem
from ductor_celery.runtime.arguments import ArgumentRefused, converters_for, prepare
from ductor_celery.store.schema import dumps_json
from ductor_celery.values import (
    ValueNotDecodable,
    decode,
    decode_lenient,
    encode,
    truthy,
)


class Item(BaseModel):
    sku: str
    qty: int


class Order(BaseModel):
    id: uuid.UUID
    total: Decimal
    placed: datetime
    items: list[Item]


class StrictOrder(BaseModel, strict=True):
    placed: datetime
    total: Decimal


class Undeclared(BaseModel):
    """Imported wherever this module is, named by no step and never registered."""

    x: int = 0


@dataclasses.dataclass(frozen=True)
class Point:
    x: int
    y: int


@dataclasses.dataclass
class Shipment:
    to: Point
    at: datetime
    tags: list[str] = dataclasses.field(default_factory=list)
    computed: int = dataclasses.field(default=0, init=False)


# The app's word that values may carry them (Shipment declares Point, its field's class).
for declared_class in (Order, StrictOrder, Shipment):
    register_type(declared_class)

ORDER = Order(
    id=uuid.UUID("12345678-1234-5678-1234-567812345678"),
    total=Decimal("10.50"),
    placed=datetime(2024, 1, 2, 3, 4, 5, 678901, tzinfo=UTC),
    items=[Item(sku="a", qty=2)],
)

VALUES: list[Any] = [
    datetime(2024, 1, 2, 3, 4, 5, 6, tzinfo=UTC),
    datetime(2024, 1, 2, 3, 4, 5, tzinfo=timezone(timedelta(hours=-5, minutes=-30))),
    datetime(2024, 1, 2, 3, 4, 5),  # noqa: DTZ001 - a naive one stays naive
    date(2024, 2, 29),
    time(23, 59, 59, 999999),
    Decimal("10.50"),
    Decimal("-1E+30"),
    Decimal("0.000000000000000000000000000001"),
    uuid.UUID("12345678-1234-5678-1234-567812345678"),
    b"bytes \x00 ok",
    b"\xff\xfe not utf-8",
    ORDER,
    StrictOrder(placed=datetime(2024, 1, 1, tzinfo=UTC), total=Decimal("1.1")),
    Point(1, 2),
    Shipment(to=Point(3, 4), at=datetime(2024, 5, 6, tzinfo=UTC), tags=["x"]),
    {"nested": [Decimal("1.1"), {"when": date(2024, 1, 1)}], "plain": 1},
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_a_typed_value_comes_back_as_the_same_type_and_equal(value: Any) -> None:
    checked = check_json({"v": value}, "input", 1 << 20)
    assert checked.problem is None
    stored = json.loads(dumps_json(checked.value))  # what a database hands back
    back = decode(stored)["v"]
    assert type(back) is type(value)
    assert back == value
    if isinstance(value, datetime):
        assert back.utcoffset() == value.utcoffset()


def test_a_dataclass_field_outside_init_is_kept() -> None:
    shipment = Shipment(to=Point(1, 1), at=datetime(2024, 1, 1, tzinfo=UTC))
    shipment.computed = 7
    back = decode(encode(shipment))
    assert back.computed == 7 and back == shipment


def test_the_encoding_is_kombus_and_idempotent() -> None:
    from kombu.utils.json import loads as kombu_loads

    value = {"d": Decimal("1.5"), "t": datetime(2024, 1, 1, tzinfo=UTC), "u": uuid.UUID(int=7)}
    encoded = encode(value)
    assert encoded["d"] == {"__type__": "decimal", "__value__": "1.5"}
    assert kombu_loads(json.dumps(encoded)) == value  # kombu reads the same text back
    assert encode(encoded) == encoded  # an encoded value is plain JSON: checking again is a no-op
    assert check_json(encoded, "x", 1 << 20).value == encoded


def test_plain_json_is_untouched_and_decodes_to_the_same_objects() -> None:
    value = {"a": [1, 2.5, "x", None, True], "b": {"__type__": "mine", "n": 1}}
    assert check_json(value, "x", 1 << 20).value == value
    assert decode(value) is value  # no copy when nothing is typed
    # A dict with a __type__ key that is not an envelope reads back as itself.
    other = {"__type__": "datetime", "__value__": "x", "more": 1}
    assert decode(other) is other


def test_the_size_limit_counts_the_encoded_form() -> None:
    encoded_size = len(json.dumps(encode({"d": Decimal("1.5")}), separators=(", ", ": ")))
    assert check_json({"d": Decimal("1.5")}, "input", encoded_size).problem is None
    refused = check_json({"d": Decimal("1.5")}, "input", 20)
    assert refused.too_large and "input is" in (refused.problem or "")


def test_a_class_defined_inside_a_function_is_refused_naming_it() -> None:
    class Local(BaseModel):
        x: int

    value, problem = json_problem({"a": [Local(x=1)]}, "step 's' result", 1 << 20)
    assert value is None and problem is not None
    assert "Local is defined inside a function" in problem and "$.a[0]" in problem


def test_a_type_without_an_encoding_is_refused_naming_its_place() -> None:
    _, problem = json_problem({"when": object()}, "step 's' result", 1 << 20)
    assert problem == "step 's' result is not JSON-serializable: a value of type object at $.when"


def test_an_envelope_of_an_undeclared_class_stays_the_dict_it_was_sent_as() -> None:
    stored = {"__type__": "pydantic", "__value__": {"class": "nowhere.at_all:Order", "data": {}}}
    assert decode({"o": stored}) == {"o": stored}
    assert decode_lenient({"o": stored}) == {"o": stored}
    # A class that exists and is imported here is still not rebuilt unless declared.
    not_declared = encode(Undeclared(x=1))
    assert decode(not_declared) is not_declared


def test_a_declared_class_whose_data_does_not_validate() -> None:
    bad = {"__type__": "pydantic", "__value__": {"class": "test_values:Order", "data": {"id": 1}}}
    with pytest.raises(ValueNotDecodable, match="test_values:Order: the stored data does not"):
        decode(bad)
    assert decode_lenient({"o": bad}) == {"o": bad}  # readers still get the run


def test_paths_read_inside_encoded_models_and_dataclasses() -> None:
    encoded = encode({"order": ORDER, "ship": Shipment(Point(5, 6), ORDER.placed)})
    scope = Scope(input=encoded, context={}, outputs={})
    # A model's fields are its JSON (model_dump(mode="json")): an annotated parameter converts.
    assert resolve("$.input.order.total", scope) == "10.50"
    assert resolve("$.input.order.items[0].sku", scope) == "a"
    assert resolve("$.input.ship.to.x", scope) == 5
    assert decode(resolve("$.input.ship.at", scope)) == ORDER.placed  # dataclass fields typed
    assert decode(resolve("$.input.order", scope)) == ORDER


# -- annotated parameters ------------------------------------------------------------------------


def _step(ctx: Any, order: Order, when: datetime, amount: Decimal, note: Any, raw: object) -> Any:
    return None


def test_annotated_parameters_are_converted() -> None:
    args = encode({"order": ORDER.model_dump(mode="json"), "when": "2024-01-02T03:04:05Z"})
    args |= {"amount": "12.30", "note": {"free": "form"}, "raw": [1]}
    got = prepare(_step, "s", args)
    assert got["order"] == ORDER and isinstance(got["order"], Order)
    assert got["when"] == datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert got["amount"] == Decimal("12.30")
    assert got["note"] == {"free": "form"} and got["raw"] == [1]


def test_the_signature_is_read_once_per_function() -> None:
    assert converters_for(_step) is converters_for(_step)
    assert set(converters_for(_step)) == {"order", "when", "amount"}


def test_an_argument_that_does_not_convert_names_the_parameter_not_the_value() -> None:
    with pytest.raises(ArgumentRefused) as refused:
        prepare(_step, "shop.charge", {"amount": "sk_live_not_a_number"})
    message = str(refused.value)
    assert "step 'shop.charge' parameter 'amount'" in message and "Decimal" in message
    assert "sk_live_not_a_number" not in message


def test_an_annotated_parameter_rebuilds_a_model_whose_path_does_not_import_here() -> None:
    moved = encode(ORDER)
    moved["__value__"]["class"] = "shop.old_models:Order"  # as a client elsewhere wrote it
    got = prepare(_step, "s", {"order": moved})
    assert got["order"] == ORDER
    # Unannotated: nothing declares that path, so the envelope arrives as the dict it is.
    assert prepare(_step, "s", {"note": moved})["note"] == moved


@pytest.mark.parametrize(
    ("value", "expected"),
    [(Decimal("0"), False), (Decimal("0.01"), True), (b"", False), (b"x", True)]
    + [(time(0, 0), True), (ORDER, True), (Point(0, 0), True), ({"a": 1}, True), ([], False)],
)
def test_a_condition_on_an_encoded_value_is_as_true_as_the_value(
    value: Any, expected: bool
) -> None:
    encoded = encode({"v": value})
    assert truthy(encoded["v"]) is expected
    scope = Scope(input=encoded, context={}, outputs={})
    assert resolve("!$.input.v", scope) is (not expected)
