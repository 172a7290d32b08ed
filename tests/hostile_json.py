"""Hypothesis strategies for arbitrary JSON with envelopes mixed in (well-formed, malformed,
and naming classes, declared or not), and the check that what a decoder gave back holds
nothing but plain values, typed scalars and declared classes. Shared by the unit and the
integration properties of issue 22, item 1."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import date, datetime, time
from decimal import Decimal
from typing import Any

from hypothesis import strategies as st
from pydantic import BaseModel

from ductor_celery.values import KINDS

#: Modules a hostile envelope names that nothing in the test process imports: importing any of
#: them is what a decoder must never do. ``lib2to3.__main__`` raises SystemExit when imported,
#: which ended a prefork child before the fix.
HOSTILE_MODULES = ("lib2to3.__main__", "xmlrpc.server", "smtplib", "ftplib", "imaplib", "poplib")
HOSTILE_PATHS = [f"{m}:X" for m in HOSTILE_MODULES] + [
    "ductor_celery.store.runs:RunFilter",  # imported in every ductor process: still never built
    "os:system",
    "subprocess:Popen",
    "builtins:object",
    "nowhere",
    "",
]

SCALARS: tuple[type, ...] = (type(None), bool, int, float, str, datetime, date, time, Decimal)
SCALARS += (uuid.UUID, bytes)


def envelope(kind: str, value: Any) -> dict[str, Any]:
    return {"__type__": kind, "__value__": value}


def hostile_json(paths: list[str]) -> st.SearchStrategy[Any]:
    """JSON whose dicts may be envelopes of any kind (or none), naming any of ``paths``."""
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(-(2**70), 2**70)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=20)
    )
    kind = st.sampled_from(sorted(KINDS)) | st.text(max_size=8)
    path = st.sampled_from(paths) | st.text(max_size=30)
    scalar_text = st.sampled_from(
        ["!!!", "aGk=", "2024-01-01", "2024-01-01T00:00:00+14:00", "1e999999999", "1.5", "x"]
    )

    def envelopes(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        fields = st.dictionaries(st.text(max_size=5), inner, max_size=3)
        class_value = st.fixed_dictionaries(
            {"class": path}, optional={"data": inner, "fields": fields}
        )
        hex_value = st.fixed_dictionaries({"hex": st.text(max_size=32)})
        return st.builds(envelope, kind, class_value | scalar_text | hex_value | inner)

    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(st.text(max_size=8), inner, max_size=4)
            | envelopes(inner)
        ),
        max_leaves=25,
    )


def assert_only_plain_or_declared(value: Any, declared: tuple[type, ...]) -> None:
    """``value`` holds JSON, typed scalars and instances of ``declared`` only."""
    if isinstance(value, dict):
        for k, v in value.items():
            assert isinstance(k, str)
            assert_only_plain_or_declared(v, declared)
    elif isinstance(value, list):
        for item in value:
            assert_only_plain_or_declared(item, declared)
    elif isinstance(value, BaseModel) or dataclasses.is_dataclass(value):
        assert type(value) in declared, type(value)
    else:
        assert isinstance(value, SCALARS), type(value)
