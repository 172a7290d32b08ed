"""Issue 9, values side: the one payload rule (``check_json`` / ``json_problem``) refuses what
PostgreSQL cannot store exactly, never raises, and keeps what it accepts exactly; child workflow
ids fit their column."""

from __future__ import annotations

import math
from typing import Any

import pytest

from ductor_celery.engine.children import child_workflow_id
from ductor_celery.limits import MAX_ID_LENGTH, MAX_JSON_DEPTH
from ductor_celery.payloads import check_json, json_problem

LIMIT = 1 << 20


def nested(depth: int) -> Any:
    """A value of ``depth`` nested lists (and dicts, alternately) around 0."""
    value: Any = 0
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


def refused(value: Any, *needles: str) -> str:
    checked = check_json(value, "input of workflow 'w'", LIMIT)
    assert checked.problem is not None, value
    assert checked.value is None and not checked.too_large
    assert checked.problem.startswith("input of workflow 'w' is not JSON-serializable")
    for needle in needles:
        assert needle in checked.problem
    return checked.problem


@pytest.mark.parametrize(
    ("value", "where"),
    [
        (float("nan"), "at $"),
        (float("inf"), "at $"),
        (-float("inf"), "at $"),
        ({"a": [1, float("nan")]}, "at $.a[1]"),
        ({float("inf"): 1}, "key inf"),
    ],
)
def test_nan_and_infinity_are_refused_naming_where(value: Any, where: str) -> None:
    refused(value, "NaN or Infinity", where)


@pytest.mark.parametrize(
    ("value", "where"), [("a\x00b", "at $"), ({"x": ["ok", "\x00"]}, "at $.x[1]")]
)
def test_nul_in_a_string_is_refused(value: Any, where: str) -> None:
    refused(value, "NUL", where)


def test_nul_in_a_key_is_refused() -> None:
    problem = refused({"outer": {"k\x00": 1}}, "NUL", "key 'k\\x00' at $.outer")
    assert "\x00" not in problem  # the message itself must be storable


def test_an_escaped_backslash_u0000_is_text_not_nul() -> None:
    assert check_json("\\u0000 and \\\\u0000", "x", LIMIT).value == "\\u0000 and \\\\u0000"


@pytest.mark.parametrize("value", ["\ud800", ["ok", "x\udfffy"], {"\ud83d": 1}])
def test_lone_surrogates_are_refused(value: Any) -> None:
    problem = refused(value, "lone surrogate")
    problem.encode("utf-8")  # the message itself is valid UTF-8


def test_depth_100_is_accepted_and_101_refused() -> None:
    assert MAX_JSON_DEPTH == 100
    assert check_json(nested(100), "x", LIMIT).value == nested(100)
    refused(nested(101), "nested deeper than 100 levels")


def test_depth_5000_is_refused_without_an_exception() -> None:
    refused(nested(5000), "nested deeper than 100 levels")
    value, problem = json_problem(nested(5000), "x", LIMIT)
    assert value is None and problem is not None


def test_a_cycle_is_refused_without_an_exception() -> None:
    loop: dict[str, Any] = {}
    loop["self"] = loop
    refused(loop)


def test_an_integer_of_5000_digits_is_refused() -> None:
    refused(10**4999, "integer of more than 4300 digits")
    refused({"n": [-(10**4999)]}, "integer of more than 4300 digits", "$.n[0]")


def test_big_ints_and_floats_round_trip_exactly() -> None:
    checked = check_json({"big": 2**64 + 1, "one": 1.0, "minus_zero": -0.0}, "x", LIMIT)
    assert checked.problem is None
    big, one, minus_zero = checked.value["big"], checked.value["one"], checked.value["minus_zero"]
    assert big == 2**64 + 1 and type(big) is int
    assert one == 1.0 and type(one) is float
    assert minus_zero == 0.0 and math.copysign(1.0, minus_zero) == -1.0


def test_the_byte_limit_counts_utf8_bytes_of_multibyte_text() -> None:
    text = "é" * 99  # 198 UTF-8 bytes, 200 with the quotes
    assert check_json(text, "x", 200).value == text
    over = check_json(text, "x", 199)
    assert over.too_large and over.value is None
    assert over.problem == "x is 200 bytes, over ductor_max_payload_bytes=199"


def test_non_json_types_are_not_serializable_not_too_large() -> None:
    refused({"s": {1, 2}}, "a value of type set at $.s")
    refused({(1, 2): 3}, "key (1, 2)")


def test_a_value_whose_serialization_raises_is_refused_not_raised() -> None:
    class Hostile(dict):  # type: ignore[type-arg]
        def items(self) -> Any:
            raise RuntimeError("boom \x00 \ud800")

    problem = refused(Hostile(a=1), "RuntimeError")
    assert "\x00" not in problem
    problem.encode("utf-8")


def test_json_problem_keeps_its_contract() -> None:
    assert json_problem({"a": (1, 2), 3: None}, "x", LIMIT) == ({"a": [1, 2], "3": None}, None)
    value, problem = json_problem("y" * 200, "x", 100)
    assert value is None and problem == "x is 202 bytes, over ductor_max_payload_bytes=100"


def test_a_child_workflow_id_that_fits_is_kept_as_today() -> None:
    assert child_workflow_id("order-42", "/ship[3]~2") == "order-42/ship[3]~2"
    exact = "p" * (MAX_ID_LENGTH - 4)
    assert child_workflow_id(exact, "/sub") == exact + "/sub"


def test_a_child_workflow_id_of_a_200_char_parent_fits_and_stays_distinct() -> None:
    parent = "p" * MAX_ID_LENGTH
    ids = [child_workflow_id(parent, f"/ship[{i}]") for i in range(3)]
    ids.append(child_workflow_id(parent, "/ship[0]~2"))
    assert all(len(i) <= MAX_ID_LENGTH for i in ids)
    assert len(set(ids)) == len(ids) and parent not in ids  # no sibling or parent collision
    assert all(i.startswith("p" * 150) for i in ids)
    assert child_workflow_id(parent, "/ship[1]") == ids[1]  # deterministic
