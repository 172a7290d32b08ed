"""A value's JSON text, made once by its payload check (``payloads.JsonCheck.text``) and taken
by whoever needs the value's JSON after it: the large-value threshold and blob
(``blobs.large_text``), the lost-outcome keeper's size, and the carried outcome's query
parameter (``schema.stored_json_text``). Each of them must get exactly what encoding the value
again would give."""

from __future__ import annotations

import decimal
import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from ductor_celery.payloads import check_json
from ductor_celery.runtime.step_errors import checked_payload
from ductor_celery.store import blobs
from ductor_celery.store.schema import dumps_json, stored_json_text

LIMIT = 1 << 30

#: JSON values, and what a step may return that JSON normalizes: tuples, int keys, floats of
#: any size (a positive exponent is what ``stored_json_text`` rewrites), Decimals (encoded as
#: their envelopes), text outside ASCII.
VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.decimals(allow_nan=False, allow_infinity=False, places=3, max_value=10**6)
    | st.text(max_size=20).filter(lambda s: "\x00" not in s),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=8).filter(lambda s: "\x00" not in s), inner, max_size=5)
        # Keys that collide once made strings (1 and "1", True and "true"): the check's text
        # holds both, the value the last.
        | st.dictionaries(
            st.integers(-2, 2) | st.booleans() | st.none() | st.sampled_from(["1", "true", "null"]),
            inner,
            max_size=4,
        )
    ),
    max_leaves=30,
)


def _as_written(text: str) -> Any:
    """A JSON text's value with every number as the token it is written as: ``1e+16`` and
    ``10000000000000000.0`` differ here (PostgreSQL's jsonb reads the first back as an int)."""
    return json.loads(text, parse_float=lambda s: ("float", s), parse_int=lambda s: ("int", s))


@given(VALUES)
def test_the_checks_text_stands_for_the_checked_value(value: Any) -> None:
    checked = check_json(value, "x", LIMIT)
    assert checked.problem is None and checked.text is not None
    encoded = blobs._ENCODER.encode(checked.value)
    # The text reads back as the value (a key twice: the last, as jsonb reads it too); it is
    # the value's own encoding but for such keys, and never shorter.
    assert json.loads(checked.text) == json.loads(encoded)
    assert checked.text == encoded or len(checked.text) > len(encoded)
    # A value over the threshold is offloaded as its own encoding, whatever text it came with.
    if checked.value is not None:  # None is never offloaded
        assert blobs.large_text(checked.value, 0, checked.text) == encoded
        assert blobs.large_text(checked.value, LIMIT, checked.text) is None
    # The carried outcome's parameter: what dumps_json stores, every number as it writes it.
    stored = _as_written(stored_json_text(checked.text))
    assert stored == _as_written(dumps_json(json.loads(checked.text)))


def test_colliding_keys_are_offloaded_as_the_value_and_read_back() -> None:
    """``[{1: "a", "1": "b"}, ...]``: the check's text holds both keys, the value only "1":
    "b". Offloaded, its blob is the value's own bytes, so it reads back (its digest holds)."""
    from ductor_celery.definition.blobrefs import describe, iter_chunks, value_of

    checked = check_json([{1: "a", "1": "b"}] * 200, "x", LIMIT)
    assert checked.value == [{"1": "b"}] * 200 and checked.text is not None
    assert checked.text.count('"1"') == 400
    text = blobs.large_text(checked.value, 1000, checked.text)
    assert text == blobs._ENCODER.encode(checked.value)
    ref = describe(checked.value, text, "blob-1")
    assert value_of(list(iter_chunks(checked.value, text)), ref) == checked.value


def test_a_float_with_a_positive_exponent_is_stored_as_dumps_json_stores_it() -> None:
    checked = check_json({"big": 1e16, "small": 1e-7, "s": "1e+16", "é": [2.5e300]}, "x", LIMIT)
    assert checked.text is not None and "e+" in checked.text
    stored = stored_json_text(checked.text)
    assert '"big": 10000000000000000.0' in stored and '"s": "1e+16"' in stored
    assert _as_written(stored) == _as_written(dumps_json(checked.value))


def test_large_text_decides_on_the_text_it_is_given_and_offloads_the_value() -> None:
    """Under the threshold, the given text decides (the value is not encoded); over it, the
    value is encoded for its blob, and that text is what it returns."""
    value = {"a": "x" * 1000}
    assert blobs.large_text(value, 100, text='{"a": "short"}') is None
    long_text = '{"a": "' + "y" * 200 + '"}'
    assert blobs.large_text(value, 100, text=long_text) == blobs._ENCODER.encode(value)


def test_a_refused_value_has_no_text() -> None:
    assert check_json("x" * 50, "x", 10).text is None
    assert check_json({1, 2}, "x", LIMIT).text is None
    assert checked_payload({"k": float("nan")}, "x", LIMIT).text is None


def test_a_step_result_is_looked_for_the_reserved_key_in_its_text_only_when_it_is_there() -> None:
    """``checked_payload`` refuses the reserved key at any depth, and leaves a value alone when
    the key's name is only in a string."""
    forged = {"items": [{"ok": 1}, {"deep": {"__ductor_blob__": {"id": "x"}}}]}
    refused = checked_payload(forged, "step 's' result", LIMIT)
    assert refused.value is None and refused.problem is not None
    assert "$.items[1].deep" in refused.problem
    mentioned = checked_payload({"note": "__ductor_blob__"}, "r", LIMIT)
    assert mentioned.problem is None and mentioned.value == {"note": "__ductor_blob__"}
    allowed = checked_payload(forged, "r", LIMIT, refs_allowed=True)
    assert allowed.problem is None and allowed.text is not None


def test_decimal_envelopes_keep_their_text() -> None:
    checked = check_json({"price": decimal.Decimal("12.50")}, "x", LIMIT)
    assert checked.text is not None
    assert blobs._ENCODER.encode(checked.value) == checked.text


@given(VALUES)
def test_a_text_without_the_keys_holds_no_envelope_and_no_reference(value: Any) -> None:
    """The inline claim skips decoding its arguments and looking for references in them when
    their text holds neither key (``Call.plain_args``): then both walks find nothing."""
    from ductor_celery.definition.blobrefs import contains_ref, may_hold_ref
    from ductor_celery.values import decode, may_hold_envelope

    checked = check_json(value, "x", LIMIT)
    assert checked.text is not None
    if not may_hold_envelope(checked.text):
        assert decode(checked.value) is checked.value
    if not may_hold_ref(checked.text):
        assert not contains_ref(checked.value)


def test_the_keys_are_seen_in_the_text() -> None:
    from ductor_celery.definition.blobrefs import may_hold_ref
    from ductor_celery.values import may_hold_envelope

    typed = check_json({"price": decimal.Decimal("1.5")}, "x", LIMIT).text
    assert typed is not None and may_hold_envelope(typed) and not may_hold_ref(typed)
    ref = {"__ductor_blob__": {"id": "b", "size": 1, "sha256": "0" * 64}}
    with_ref = check_json({"big": ref}, "x", LIMIT).text
    assert with_ref is not None and may_hold_ref(with_ref)


def test_plain_arguments_are_passed_as_they_are() -> None:
    from ductor_celery.runtime.arguments import prepare

    args = {"a": {"n": [1, 2]}, "b": "s"}
    prepared = prepare(lambda ctx, a, b: None, "s", args, plain=True)
    assert prepared == args and prepared["a"] is args["a"]


def _whole_way(value: Any) -> tuple[Any, str]:
    """What the check made of a value before scalars had a path of their own: its encoding,
    and that encoding read back."""
    text = blobs._ENCODER.encode(value)
    return json.loads(text), text


@given(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([-0.0, 1e16, 1e-7, 2.5e300, 10**18 - 1, -(10**18) + 1, 10**18, -(10**18)])
)
def test_a_scalar_is_checked_as_the_whole_way_checks_it(value: Any) -> None:
    """The scalar path (``payloads._scalar_text``) gives the text and the value the whole way
    gives: the same type (``1`` stays an int, ``1.0`` a float, ``True`` a bool), the same
    token (``1e+16``, ``-0.0``)."""
    checked = check_json(value, "x", LIMIT)
    expected_value, expected_text = _whole_way(value)
    assert checked.problem is None and checked.text == expected_text
    assert checked.value == expected_value and type(checked.value) is type(expected_value)
    assert json.loads(checked.text) == value


def test_what_the_scalar_path_leaves_to_the_whole_way() -> None:
    """Subclasses are normalized to what JSON reads back; non-finite floats and integers too
    long to print are refused; the size limit holds for a scalar too."""
    import enum

    class Level(enum.IntEnum):
        HIGH = 3

    checked = check_json(Level.HIGH, "x", LIMIT)
    assert checked.value == 3 and type(checked.value) is int and checked.text == "3"
    for bad in (float("nan"), float("inf"), -float("inf")):
        assert check_json(bad, "x", LIMIT).problem is not None
    huge = check_json(10**5000, "x", LIMIT)
    assert huge.problem is not None and huge.value is None
    assert check_json(10**17, "x", LIMIT).text == "100000000000000000"
    too_large = check_json(123456, "result", 5)
    assert too_large.too_large and too_large.value is None
    assert too_large.problem == "result is 6 bytes, over ductor_max_payload_bytes=5"
    assert check_json(12345, "result", 5).text == "12345"
