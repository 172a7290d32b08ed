"""Issue 9, the limits table as properties (README "Limits", ``ductor_celery/limits.py``).

Hypothesis draws definitions, inputs, payloads, ids and controls from a mix of good values and
the bad shapes of the issue (nan, inf, 1e20, negative and huge durations; numbers that must
round-trip exactly; JSON nested near and over the depth limit; NaN, Infinity, NUL and lone
surrogates; ids empty, of 200 and 201 characters, with NUL, of the wrong type; wrong types for
reason=, limit=, timeout=), and checks three things:

- a definition is registered, or refused at once with a DefinitionError, exactly when one of
  its values is bad; a registered one stores only finite numbers within the limits and reads
  back the same;
- each client call returns, or raises at once the exception an independent model of the
  limits predicts; a refused call writes nothing and wakes nothing, an accepted one stores its
  values exactly (ints stay ints, ``1.0`` and ``-0.0`` stay floats); on SQLite and PostgreSQL;
- an accepted run never gets stuck: it finishes within its timers and retries.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
import sqlalchemy as sa
from celery import Celery
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from ductor_celery import (
    ConcurrencyLimit,
    Ductor,
    DuctorError,
    InvalidOperation,
    PayloadNotSerializable,
    PayloadTooLarge,
    RetryPolicy,
    RunNotFound,
    RunStatus,
    StepContext,
    Workflow,
    WorkflowNotFound,
)
from ductor_celery.call_checks import check_timeout
from ductor_celery.cli import ductor as ductor_cli
from ductor_celery.definition import WorkflowSpec
from ductor_celery.errors import DefinitionError
from ductor_celery.limits import (
    MAX_ATTEMPTS,
    MAX_BACKOFF,
    MAX_BATCH_SIZE,
    MAX_DURATION_S,
    MAX_ID_LENGTH,
    MAX_INT,
    MAX_JSON_DEPTH,
    MAX_LEASE_KEY_LENGTH,
    MAX_LIST_LIMIT,
    show,
)
from ductor_celery.payloads import check_json
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store import external
from ductor_celery.store.migrate import upgrade
from ductor_celery.store.runs import load_definition

NAN = float("nan")
INF = float("inf")
#: ductor_max_payload_bytes at the client door: small, so "too large" is cheap to build.
MAX_BYTES = 2000
#: The integers Python prints (``sys.get_int_max_str_digits()``): 4300 digits.
MAX_DIGITS = 4300
#: How long any call at the door may take ("at once").
AT_ONCE_S = 3.0

SLOW = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# -- the model: what the limits say, written independently of ductor's own checks ----------


def nested(depth: int, leaf: Any = 0, kind: str = "list") -> Any:
    """``depth`` levels of lists (or dicts) around ``leaf``."""
    value = leaf
    for _ in range(depth):
        value = [value] if kind == "list" else {"k": value}
    return value


def text_ok(value: str) -> bool:
    if "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def storable(value: Any, depth_limit: int = MAX_JSON_DEPTH) -> bool:
    """JSON both databases store exactly: no NaN/Infinity, no NUL or lone surrogate, ints that
    print, JSON types only (a tuple is read as a list), at most ``depth_limit`` levels of
    containers."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if type(item) is dict or type(item) is list or type(item) is tuple:
            if depth + 1 > depth_limit:
                return False
            if type(item) is dict:
                for key, child in item.items():
                    if type(key) is not str or not text_ok(key):
                        return False
                    stack.append((child, depth + 1))
            else:
                stack += [(child, depth + 1) for child in item]
        elif item is None or type(item) is bool:
            continue
        elif type(item) is int:
            if abs(item) >= 10**MAX_DIGITS:
                return False
        elif type(item) is float:
            if not math.isfinite(item):
                return False
        elif type(item) is str:
            if not text_ok(item):
                return False
        else:
            return False
    return True


def normalized(value: Any) -> Any:
    """What an accepted value reads back as: JSON has no tuples, they become lists."""
    if isinstance(value, list | tuple):
        return [normalized(v) for v in value]
    if isinstance(value, dict):
        return {k: normalized(v) for k, v in value.items()}
    return value


def payload_verdict(value: Any) -> tuple[type[Exception], ...] | None:
    """None when the value must be accepted as a payload, else the exceptions allowed."""
    if not storable(value):
        # Size is measured first: a value both too deep and too big may be either.
        return (PayloadNotSerializable, PayloadTooLarge)
    size = len(json.dumps(value, ensure_ascii=False).encode("utf-8"))
    return (PayloadTooLarge,) if size > MAX_BYTES else None


def id_verdict(value: Any) -> type[Exception] | None:
    """An id: a str (TypeError) of 1..200 characters, no NUL, valid Unicode (ValueError)."""
    if not isinstance(value, str):
        return TypeError
    if not 1 <= len(value) <= MAX_ID_LENGTH or not text_ok(value):
        return ValueError
    return None


def text_verdict(value: Any) -> type[Exception] | None:
    """A reason: None, or a str without NUL or lone surrogates of at most MAX_BYTES bytes."""
    if value is None:
        return None
    if not isinstance(value, str):
        return TypeError
    if not text_ok(value):
        return ValueError
    return PayloadTooLarge if len(value.encode("utf-8")) > MAX_BYTES else None


def timeout_verdict(value: Any) -> type[Exception] | None:
    """wait()'s timeout: None, or a finite number (not a bool) >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return TypeError
    if isinstance(value, float) and not math.isfinite(value):
        return ValueError
    if value < 0:
        return ValueError
    if isinstance(value, int) and value > 1e308:  # no float holds it: not a usable deadline
        return ValueError
    return None


def same(a: Any, b: Any, signed_zero: bool = True) -> bool:
    """Equal and of the same type all the way down (an int is not a float, 1.0 is not 1);
    with ``signed_zero``, zeros keep their sign too."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        if signed_zero and math.copysign(1, a) != math.copysign(1, b):
            return False
        return a == b
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y, signed_zero) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], signed_zero) for k in a)
    return bool(a == b)


# -- strategies: good values and the bad shapes ---------------------------------------------


def too_many_digits(exponent: int) -> int:
    """``10**|exponent|`` (negative for a negative exponent): an int of more digits than
    Python prints. Made in a map, since Hypothesis prints the values of ``sampled_from``."""
    value = 10 ** abs(exponent)
    return value if exponent > 0 else -value


#: Text that is valid everywhere: no NUL, no surrogates, never a path ("$...", "!$...").
SAFE_TEXT = st.text(
    alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\x00$!"), max_size=8
)
GOOD_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([2**64 + 1, -(2**70), 1.0, -0.0, 0.0, 1e16, 1e300, 5e-324, -2.5e20]),
    st.just(MAX_DIGITS).map(lambda digits: 10**digits - 1),  # the longest int that prints
    SAFE_TEXT,
    st.sampled_from(["é" * 10, "\\u0000", "a\\\\u0000", "😀", "\u2028"]),
)
BAD_SCALARS = st.sampled_from(
    [NAN, INF, -INF, "a\x00b", "\x00", "\ud800", "x\udfff"]
) | st.sampled_from([MAX_DIGITS, -5000]).map(too_many_digits)
# (bytes are no longer one: a typed value since issue 15, stored as its envelope.)
BAD_OBJECTS = st.sampled_from([{1, 2}, object(), Ellipsis, 1j])


def json_values(leaves: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        leaves,
        lambda kids: (
            st.lists(kids, max_size=3)
            | st.lists(kids, max_size=2).map(tuple)
            | st.dictionaries(SAFE_TEXT | st.sampled_from(["k", "é", "😀"]), kids, max_size=3)
        ),
        max_leaves=8,
    )


GOOD_JSON = json_values(GOOD_SCALARS)
DEPTH_KINDS = st.sampled_from(["list", "dict"])


def deep(depths: list[int], leaves: st.SearchStrategy[Any] = GOOD_SCALARS) -> Any:
    """Values nested exactly one of ``depths`` levels deep."""
    return st.builds(nested, st.sampled_from(depths), leaves, DEPTH_KINDS)


#: Near and over the depth limit (100 levels).
DEEP = deep([1, 50, 98, 99, 100, 101, 150, 5000])
#: Somewhere inside, one value no database stores exactly.
POISONED = st.one_of(
    BAD_SCALARS,
    st.builds(lambda xs, b: [*xs, b], st.lists(GOOD_JSON, max_size=2), BAD_SCALARS),
    st.builds(
        lambda d, b: {**d, "bad": b}, st.dictionaries(SAFE_TEXT, GOOD_JSON, max_size=2), BAD_SCALARS
    ),
    deep([1, 3, 99], BAD_SCALARS),
    st.dictionaries(st.sampled_from(["k\x00", "\ud800"]), GOOD_SCALARS, min_size=1),
    st.just({INF: 1}),
)


def usually(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A good value four times in five, else a bad one: a call has up to four arguments, and
    about half the calls should pass the door."""
    return st.integers(0, 4).flatmap(lambda n: bad if n == 1 else good)


#: Payloads at the client door (ductor_max_payload_bytes=MAX_BYTES): the serialized size of
#: "é" * 999 is exactly MAX_BYTES.
ANY_PAYLOAD = usually(
    GOOD_JSON | deep([1, 99, 100]) | st.sampled_from(["é" * 999, "x" * (MAX_BYTES - 2)]),
    st.one_of(
        POISONED,
        deep([101, 150, 5000]),
        BAD_OBJECTS,
        st.sampled_from(["é" * 1000, "x" * (MAX_BYTES - 1)]),
    ),
)

GOOD_IDS = st.one_of(
    st.text(
        alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\x00"),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from(["i" * MAX_ID_LENGTH, "é" * MAX_ID_LENGTH, "😀", " "]),
)
BAD_IDS = st.sampled_from(
    [
        "",
        "i" * (MAX_ID_LENGTH + 1),
        "a\x00b",
        "\x00",
        "\ud800",
        "a\udc00",
        5,
        1.0,
        None,
        b"id",
        ["i"],
    ]
)
#: Durations that are never usable.
BAD_DURATIONS = st.sampled_from(
    [NAN, INF, -INF, 1e20, -1, -0.5, MAX_DURATION_S * 1.0000001, 10**400, True, "10", [1]]
)
REASONS = usually(
    st.none() | SAFE_TEXT | st.just("é" * 1000),
    st.sampled_from(["é" * 1001, "why\x00", "\ud800", 5, b"why", 1.5]),
)


# -- a: definitions ---------------------------------------------------------------------------


#: One value in GOOD_WEIGHT + 1 drawn by ``mix`` is bad.
GOOD_WEIGHT = 30


class Drawn(NamedTuple):
    value: Any
    ok: bool


def mix(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> st.SearchStrategy[Drawn]:
    """A good value (``ok``), or now and then a bad one: a plan has about thirty values, so
    most plans hold none or one bad value, and a refusal then has one cause."""
    return st.integers(0, GOOD_WEIGHT).flatmap(
        lambda n: (
            bad.map(lambda v: Drawn(v, False)) if n == 1 else good.map(lambda v: Drawn(v, True))
        )
    )


POSITIVE_S = st.one_of(
    st.floats(min_value=0.001, max_value=MAX_DURATION_S),
    st.integers(min_value=1, max_value=int(MAX_DURATION_S)),
    st.sampled_from([MAX_DURATION_S, 1e-9]),
)
ZERO_OK_S = POSITIVE_S | st.sampled_from([0, 0.0, -0.0])
TIMEOUT = mix(st.none() | POSITIVE_S, BAD_DURATIONS | st.sampled_from([0, 0.0]))
SLEEP_S = mix(ZERO_OK_S, BAD_DURATIONS | st.none())
INTERVAL = mix(ZERO_OK_S, BAD_DURATIONS)
BAD_INTS = st.sampled_from([0, -1, MAX_INT + 1, 2**70, True, 1.5, "1", None]) | st.just(5000).map(
    too_many_digits
)
NAMES_OF_ARGS = st.sampled_from(["a", "b", "x"])
#: A literal template: JSON a definition stores and a run's arguments can carry (the argument
#: set is one level deeper than each value in it).
GOOD_LITERAL = st.one_of(GOOD_JSON, deep([1, 98, 99]))
BAD_LITERAL = st.one_of(POISONED, deep([100, 101, 5000]))
GOOD_PATHS = st.sampled_from(["$.input", "$.input.x", "$.context.y", "$.input.x[0]"])


@st.composite
def retry_policies(draw: st.DrawFn) -> Drawn:
    """RetryPolicy keyword arguments (built inside the call: its constructor checks them)."""
    fields = {
        "max_attempts": draw(mix(st.integers(1, MAX_ATTEMPTS), BAD_INTS)),
        "initial_interval": draw(INTERVAL),
        "backoff": draw(
            mix(
                st.floats(1, MAX_BACKOFF) | st.sampled_from([1, 2, 1000]),
                st.sampled_from([0.5, 0, -1, MAX_BACKOFF + 1, NAN, INF, 10**400, True, "2"]),
            )
        ),
        "max_interval": draw(INTERVAL),
    }
    kwargs = {k: v.value for k, v in fields.items()}
    return Drawn(kwargs, all(v.ok for v in fields.values()))


@dataclass
class Plan:
    """A definition to build: the step's options, the workflow, and which values are bad."""

    name: Any
    version: Any
    step_options: dict[str, Any]
    nodes: list[tuple[str, Any, dict[str, Any]]] = field(default_factory=list)
    output: Any = None
    bad: list[str] = field(default_factory=list)


class _Step:
    """Marks where the plan's registered step goes (a @ductor.step object)."""


STEP = _Step()


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    bad: list[str] = []

    def take(label: str, drawn: Drawn) -> Any:
        if not drawn.ok:
            bad.append(label)
        return drawn.value

    name = take("name", draw(mix(GOOD_IDS, BAD_IDS)))
    version = take("version", draw(mix(st.integers(1, MAX_INT), BAD_INTS)))
    step_retry = draw(st.none().map(lambda v: Drawn(v, True)) | retry_policies())
    concurrency = draw(
        st.none().map(lambda v: Drawn(v, True))
        | st.fixed_dictionaries(
            {
                "key": mix(
                    st.sampled_from(["$.input.customer", "shared", "k" * MAX_LEASE_KEY_LENGTH]),
                    st.sampled_from(["", "k" * (MAX_LEASE_KEY_LENGTH + 1), "k\x00", 5]),
                ),
                "limit": mix(st.integers(1, MAX_INT), BAD_INTS),
            }
        ).map(lambda f: Drawn({k: v.value for k, v in f.items()}, all(v.ok for v in f.values())))
    )
    step_options = {
        "timeout": take("step timeout", draw(TIMEOUT)),
        "heartbeat_timeout": take("step heartbeat_timeout", draw(TIMEOUT)),
        "retry": take("step retry", step_retry),
        "concurrency": take("step concurrency", concurrency),
    }
    plan = Plan(name, version, step_options, bad=bad)

    count = take("no nodes", draw(mix(st.integers(1, 4), st.just(0))))
    ids: list[Any] = []
    for index in range(count):
        good_id = st.sampled_from([f"n{index}", f"n{index}".ljust(MAX_ID_LENGTH, "x")])
        bad_id = BAD_IDS | st.sampled_from(["1n", "a b", "n-\x00", "é"])
        if ids and isinstance(ids[0], str):
            bad_id |= st.just(ids[0])  # a duplicate
        node_id = take(f"node {index} id", draw(mix(good_id, bad_id)))
        kind = draw(
            st.sampled_from(["step", "sleep", "wait_signal", "approval", "event_set", "scatter"])
        )
        kwargs: dict[str, Any] = {
            "after": take(
                f"node {index} after",
                draw(
                    mix(
                        st.none() | st.lists(st.sampled_from(ids), unique_by=repr)
                        if ids
                        else st.none(),
                        st.sampled_from([["ghost"], 5, [5]]),
                    )
                ),
            ),
            "when": take(
                f"node {index} when",
                draw(
                    mix(
                        st.sampled_from([None, True, False, "$.input.flag", "!$.input.flag"]),
                        st.sampled_from([5, 1.5, "flag", "$.nodes.ghost.output"]),
                    )
                ),
            ),
        }
        kwargs.update(draw(node_fields(kind, index, bad)))
        plan.nodes.append((kind, node_id, kwargs))
        ids.append(node_id)
    plan.output = take(
        "output",
        draw(
            mix(
                GOOD_JSON | deep([1, 99, 100]) | GOOD_PATHS,
                POISONED | deep([101, 5000]),
            )
        ),
    )
    return plan


@st.composite
def node_fields(draw: st.DrawFn, kind: str, index: int, bad: list[str]) -> dict[str, Any]:
    def take(label: str, drawn: Drawn) -> Any:
        if not drawn.ok:
            bad.append(f"node {index} {label}")
        return drawn.value

    signal_name = mix(
        GOOD_IDS.filter(lambda s: not s.startswith("ductor.")),
        BAD_IDS | st.just("ductor.approval:x"),
    )
    if kind == "sleep":
        return {"seconds": take("seconds", draw(SLEEP_S))}
    if kind in ("wait_signal", "approval", "event_set"):
        waits = {
            "timeout": take("timeout", draw(TIMEOUT)),
            "on_timeout": take(
                "on_timeout", draw(mix(st.sampled_from(["fail", "continue"]), st.just("explode")))
            ),
            "continue_on_failure": draw(st.booleans()),
        }
    if kind == "wait_signal":
        return {**waits, "signal": take("signal", draw(signal_name))}
    if kind == "approval":
        return {
            **waits,
            "on_reject": take(
                "on_reject", draw(mix(st.sampled_from(["fail", "continue"]), st.just(None)))
            ),
        }
    if kind == "event_set":
        events = draw(
            mix(st.lists(signal_name, min_size=1, max_size=3), st.sampled_from(["abc", [], 5]))
        )
        if not events.ok:
            take("events", events)
            return {**waits, "events": events.value, "mode": "all"}
        events = events.value
        names = [e.value for e in events]
        for position, event in enumerate(events):
            take(f"events[{position}]", event)
        if len(set(map(repr, names))) != len(names):
            bad.append(f"node {index} events (a duplicate)")
        mode = take(
            "mode",
            draw(
                mix(
                    st.sampled_from(["all", "any"]) | st.integers(1, len(names)),
                    st.sampled_from([0, len(names) + 1, "some", True, 1.5, None]),
                )
            ),
        )
        return {**waits, "events": names, "mode": mode}

    # step and scatter: they run attempts.
    fields: dict[str, Any] = {
        "step": take(
            "step", draw(mix(st.sampled_from([STEP, "prop.step"]), st.sampled_from(["nope", 5])))
        ),
        "timeout": take("timeout", draw(TIMEOUT)),
        "retry": take("retry", draw(st.none().map(lambda v: Drawn(v, True)) | retry_policies())),
        "continue_on_failure": draw(st.booleans()),
    }
    args = draw(
        mix(
            st.none() | st.dictionaries(NAMES_OF_ARGS, mix(GOOD_LITERAL | GOOD_PATHS, BAD_LITERAL)),
            st.dictionaries(
                st.sampled_from(["x\x00", "\ud800", "__ductor_batch__"]), GOOD_SCALARS, min_size=1
            )
            | st.sampled_from([5, ["a"]]),
        )
    )
    if args.ok and args.value is not None:  # a dict of drawn values
        args = Drawn(
            {k: v.value for k, v in args.value.items()}, all(v.ok for v in args.value.values())
        )
    fields["args"] = take("args", args)
    if kind == "step":
        return fields
    tolerance = draw(
        st.one_of(
            st.just({}),
            st.fixed_dictionaries(
                {
                    "tolerated_failures": mix(
                        st.integers(0, MAX_INT), BAD_INTS.filter(lambda v: v is not None and v != 0)
                    )
                }
            ),
            st.fixed_dictionaries(
                {
                    "tolerated_failure_ratio": mix(
                        st.floats(0, 1) | st.sampled_from([0, 1]),
                        st.sampled_from([1.5, -0.1, NAN, INF, 10**400, "0.5", True]),
                    )
                }
            ),
        )
    )
    for name, drawn in tolerance.items():
        fields[name] = take(name, drawn)
    if not draw(mix(st.none(), st.none())).ok:  # now and then both, which is refused
        fields["tolerated_failures"], fields["tolerated_failure_ratio"] = 1, 0.5
        bad.append(f"node {index} both tolerances")
    fields.update(
        over=take(
            "over",
            draw(mix(st.sampled_from(["$.input.items", "$.input"]), st.sampled_from(["items", 5]))),
        ),
        max_parallel=take("max_parallel", draw(mix(st.integers(1, MAX_INT), BAD_INTS))),
        batch_size=take(
            "batch_size",
            draw(
                mix(
                    st.integers(1, MAX_BATCH_SIZE),
                    st.sampled_from([0, -1, MAX_BATCH_SIZE + 1, True, 1.5, None]),
                )
            ),
        ),
        item_arg=take(
            "item_arg",
            draw(
                mix(
                    st.sampled_from(["item", "it", None]),
                    st.sampled_from(["a b", 5, "__ductor_batch__"]),
                )
            ),
        ),
    )
    return fields


def _prop_step(ctx: StepContext, **kwargs: Any) -> Any:
    return None


def build(plan: Plan, url: str) -> WorkflowSpec:
    """Decorate the step, build the workflow and register it, as a user would."""
    d = Ductor(Celery("prop", broker="memory://", set_as_current=False), database_url=url)
    options = dict(plan.step_options)
    if options["retry"] is not None:
        options["retry"] = RetryPolicy(**options["retry"])
    if options["concurrency"] is not None:
        options["concurrency"] = ConcurrencyLimit(**options["concurrency"])
    step = d.step(name="prop.step", **options)(_prop_step)
    wf = Workflow(plan.name, version=plan.version)
    for kind, node_id, raw in plan.nodes:
        kwargs = dict(raw)
        if kwargs.get("retry") is not None:
            kwargs["retry"] = RetryPolicy(**kwargs["retry"])
        if kwargs.get("step") is STEP:
            kwargs["step"] = step
        getattr(wf, kind)(node_id, **kwargs)
    wf.output(plan.output)
    return d.register(wf)


#: The numeric fields of a stored node and the range each must be in.
NODE_RANGES: dict[str, tuple[float, float]] = {
    "timeout": (1e-300, MAX_DURATION_S),
    "heartbeat_timeout": (1e-300, MAX_DURATION_S),
    "seconds": (0, MAX_DURATION_S),
    "max_parallel": (1, MAX_INT),
    "tolerated_failures": (0, MAX_INT),
    "tolerated_failure_ratio": (0, 1),
    "batch_size": (1, MAX_BATCH_SIZE),
}
RETRY_RANGES: dict[str, tuple[float, float]] = {
    "max_attempts": (1, MAX_ATTEMPTS),
    "initial_interval": (0, MAX_DURATION_S),
    "max_interval": (0, MAX_DURATION_S),
    "backoff": (1, MAX_BACKOFF),
}


def numbers_in(value: Any) -> Iterator[Any]:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack += list(item.keys()) + list(item.values())
        elif isinstance(item, list):
            stack += item
        elif isinstance(item, int | float) and not isinstance(item, bool):
            yield item


def assert_within_limits(spec: WorkflowSpec, plan: Plan) -> None:
    stored = spec.model_dump(mode="json")
    for number in numbers_in(stored):
        assert not isinstance(number, float) or math.isfinite(number), stored
    assert 1 <= stored["version"] <= MAX_INT
    assert id_verdict(stored["name"]) is None
    for node, raw, (_, _, written) in zip(stored["nodes"], spec.nodes, plan.nodes, strict=True):
        assert id_verdict(node["id"]) is None
        if "args" in written:  # what the user wrote, not one value changed
            assert same(node["args"], normalized(written["args"] or {})), (written["args"], node)
        for name, (low, high) in NODE_RANGES.items():
            if node.get(name) is not None:
                assert low <= node[name] <= high, (name, node[name])
        if node.get("mode") not in (None, "all", "any"):
            assert 1 <= node["mode"] <= len(node["events"])
        for name in ("signal", "step", "queue"):
            assert node.get(name) is None or id_verdict(node[name]) is None, (name, node)
        assert all(id_verdict(event) is None for event in node.get("events", ()))
        for name, (low, high) in RETRY_RANGES.items():
            if "retry" in node:
                assert low <= node["retry"][name] <= high, (name, node["retry"])
        # Literal templates are stored exactly: an argument set and a child input are
        # payloads (no NaN turned into null, no key turned into "None").
        for name in ("args", "input"):
            if name in node:
                assert check_json(node[name], name, 1 << 30).problem is None
                assert same(getattr(raw, name), node[name]), (name, getattr(raw, name))
    assert check_json(stored["output"], "output", 1 << 30).problem is None
    assert same(spec.output, stored["output"])
    assert same(stored["output"], normalized(plan.output)), (plan.output, stored["output"])
    reloaded = WorkflowSpec.model_validate(json.loads(json.dumps(stored, allow_nan=False)))
    assert reloaded.spec_hash == spec.spec_hash


@settings(SLOW, max_examples=300)
@given(plan=plans())
def test_a_definition_registers_or_is_refused_at_once_exactly_when_a_value_is_bad(
    plan: Plan, tmp_path_factory: pytest.TempPathFactory
) -> None:
    note(f"bad values: {plan.bad}")
    event(f"{min(len(plan.bad), 2)} bad values")
    url = f"sqlite:///{tmp_path_factory.getbasetemp()}/defs.sqlite3"
    started = time.monotonic()
    try:
        spec = build(plan, url)
    except DefinitionError as exc:
        note(f"refused: {exc}")
        assert plan.bad, f"a good definition was refused: {exc}"
        assert time.monotonic() - started < AT_ONCE_S
        return
    assert not plan.bad, f"accepted although {plan.bad} are bad"
    assert time.monotonic() - started < AT_ONCE_S
    assert_within_limits(spec, plan)


# -- b: the client door, on SQLite and PostgreSQL -------------------------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/door.sqlite3"
        upgrade(url)
        return url
    found: str = request.getfixturevalue("database_url")
    return found


class Door:
    """A Ductor with an open run (``wf-1``) and a terminated one (``done-1``), the wake-ups it
    sends, and the eec_ row counts."""

    def __init__(self, url: str) -> None:
        self.app = Celery(f"door{id(self)}", broker="memory://", set_as_current=False)
        self.app.conf.ductor_max_payload_bytes = MAX_BYTES
        self.d = Ductor(self.app, database_url=url)
        self.signed_zero = url.startswith("sqlite")  # jsonb has no negative zero
        self.step = self.d.step(name="door.echo")(_prop_step)
        self.definitions = itertools.count()
        wf = Workflow("w")
        wf.approval("review")
        wf.wait_signal("go", signal="go", after=["review"])
        self.d.register(wf)
        self.open = self.d.start("w", input={"n": 1}, workflow_id="wf-1")
        self.done = self.d.start("w", input={"n": 2}, workflow_id="done-1")
        self.d.terminate("done-1")
        run_tick(self.d.runtime, self.done.run_id)
        assert self.d.get("done-1").status == RunStatus.TERMINATED
        self.woken: list[str] = []
        self.d.client._wake = self.d.client._wake_started = self.woken.append
        engine = self.d.client.engine
        self.tables = sorted(
            t for t in sa.inspect(engine).get_table_names() if t.startswith("eec_")
        )
        assert {
            "eec_workflow_definition",
            "eec_workflow_run",
            "eec_workflow_signal",
            "eec_workflow_control",
        } <= set(self.tables)

    def counts(self) -> dict[str, int]:
        with self.d.client.engine.connect() as conn:
            return {
                t: conn.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one()
                for t in self.tables
            }

    def column(self, sql: str, **params: Any) -> set[Any]:
        with self.d.client.engine.connect() as conn:
            return set(conn.execute(sa.text(sql), params).scalars())

    def same(self, a: Any, b: Any) -> bool:
        return same(a, b, self.signed_zero)


@pytest.fixture
def door(db_url: str) -> Iterator[Door]:
    yield Door(db_url)


#: Targets: open (by workflow id and run id), finished, unknown, and bad ids. Run ids are
#: filled in per Door.
TARGETS = usually(
    st.sampled_from(["wf-1", "<open>", "done-1", "<done>", "nope", "x" * MAX_ID_LENGTH]),
    BAD_IDS,
)
#: Timeouts for a wait on a run that never finishes: small when valid.
SHORT_TIMEOUTS = st.sampled_from([0, 0.0, -0.0, 0.01, 0.05])
BAD_TIMEOUTS = st.sampled_from(
    [NAN, INF, -INF, -1, -0.001, 10**400, -(10**400), "5", True, False, b"1", [1]]
)
LONG_TIMEOUTS = st.sampled_from([1e20, 1e300, 10**30, MAX_DURATION_S, None, 2**64 + 1])
#: Workflow ids for start(): disjoint from the unknown targets above.
WORKFLOW_IDS = usually(
    st.none()
    | st.just("wf-1")
    | st.builds(lambda s: f"id-{s}", SAFE_TEXT)
    | st.just("i" * MAX_ID_LENGTH),
    BAD_IDS,
)
STATUSES = usually(
    st.none() | st.sampled_from([s.value for s in RunStatus]),
    st.sampled_from(["done", "", 5, b"x"]),
)
LIMITS = usually(
    st.integers(1, MAX_LIST_LIMIT) | st.sampled_from([1, MAX_LIST_LIMIT]),
    st.sampled_from([-1, 0, MAX_LIST_LIMIT + 1, 2**64, 10**400, True, 5.0, "5", None]),
)


@st.composite
def calls(draw: st.DrawFn) -> tuple[Any, ...]:
    kind = draw(
        st.sampled_from(["define", "start", "signal", "pause", "cancel", "get", "list", "wait"])
    )
    if kind == "define":
        return ("define", draw(usually(GOOD_LITERAL, BAD_LITERAL | BAD_OBJECTS)))
    if kind == "start":
        workflow = draw(usually(st.just("w"), st.just("nope") | BAD_IDS))
        return ("start", workflow, draw(ANY_PAYLOAD), draw(WORKFLOW_IDS))
    if kind == "signal":
        name = draw(
            usually(st.sampled_from(["go", "other"]) | GOOD_IDS, BAD_IDS | st.just("ductor.x"))
        )
        key = draw(usually(st.none() | st.sampled_from(["k1", "k2"]) | GOOD_IDS, BAD_IDS))
        return ("signal", draw(TARGETS), name, draw(ANY_PAYLOAD), key)
    if kind in ("pause", "cancel"):
        return (kind, draw(TARGETS), draw(REASONS))
    if kind == "get":
        return ("get", draw(TARGETS))
    if kind == "list":
        workflow = draw(usually(st.sampled_from([None, "w", "nope"]), BAD_IDS))
        return ("list", draw(STATUSES), workflow, draw(LIMITS))
    target = draw(TARGETS)
    if target in ("done-1", "<done>"):
        timeout = draw(usually(SHORT_TIMEOUTS | LONG_TIMEOUTS, BAD_TIMEOUTS))
    else:
        timeout = draw(usually(SHORT_TIMEOUTS, BAD_TIMEOUTS))
    return ("wait", target, timeout)


def expected(door: Door, call: tuple[Any, ...]) -> tuple[type[Exception], ...] | None:
    """What the limits (and the two runs' states) say the call must do: None to succeed, else
    the exceptions it may raise. Validation comes first, in argument order; each verdict is a
    function, asked only when the ones before it had nothing to say."""
    kind, *args = call

    def first(*verdicts: Callable[[], Any]) -> tuple[type[Exception], ...] | None:
        for verdict in verdicts:
            found = verdict()
            if found is not None:
                return found if isinstance(found, tuple) else (found,)
        return None

    def state(target: str, finished: Any, open_: Any = None) -> Any:
        if target in ("nope", "x" * MAX_ID_LENGTH):
            return RunNotFound
        if target in ("done-1", door.done.run_id):
            return finished
        return open_

    if kind == "define":  # register a step node with the literal as an argument, and start it
        return first(lambda: DefinitionError if not storable(args[0], MAX_JSON_DEPTH - 1) else None)
    if kind == "start":
        workflow, value, workflow_id = args
        return first(
            lambda: id_verdict(workflow),
            lambda: None if workflow_id is None else id_verdict(workflow_id),
            lambda: payload_verdict(value),
            lambda: WorkflowNotFound if workflow != "w" else None,
        )
    if kind == "signal":
        target, name, value, key = args
        return first(
            lambda: id_verdict(target),
            lambda: id_verdict(name),
            lambda: ValueError if name.startswith("ductor.") else None,
            lambda: None if key is None else id_verdict(key),
            lambda: payload_verdict(value),
            lambda: state(target, InvalidOperation),
        )
    if kind in ("pause", "cancel"):
        target, reason = args
        return first(
            lambda: id_verdict(target),
            lambda: text_verdict(reason),
            lambda: state(target, InvalidOperation),
        )
    if kind == "get":
        return first(lambda: id_verdict(args[0]), lambda: state(args[0], None))
    if kind == "list":
        status, workflow, limit = args
        return first(
            lambda: TypeError if isinstance(limit, bool) or not isinstance(limit, int) else None,
            lambda: ValueError if not 1 <= limit <= MAX_LIST_LIMIT else None,
            lambda: None if workflow is None else id_verdict(workflow),
            lambda: None if status is None else None if isinstance(status, str) else TypeError,
            lambda: None if status in (None, *(s.value for s in RunStatus)) else ValueError,
        )
    target, timeout = args
    # The open run never finishes (no workers): a wait on it runs out of time.
    return first(
        lambda: id_verdict(target),
        lambda: timeout_verdict(timeout),
        lambda: state(target, None, TimeoutError),
    )


def perform(door: Door, call: tuple[Any, ...]) -> Any:
    kind, *args = call
    d = door.d
    if kind == "define":
        wf = Workflow(f"lit{next(door.definitions)}")
        wf.step("s", door.step, args={"a": args[0]})
        spec = d.register(wf)
        return spec, d.start(spec.name)
    if kind == "start":
        return d.start(args[0], input=args[1], workflow_id=args[2])
    if kind == "signal":
        return d.signal(args[0], args[1], args[2], idempotency_key=args[3])
    if kind == "pause":
        return d.pause(args[0], reason=args[1])
    if kind == "cancel":
        return d.cancel(args[0], reason=args[1])
    if kind == "get":
        return d.get(args[0])
    if kind == "list":
        return d.list_runs(status=args[0], workflow=args[1], limit=args[2])
    return d.wait(args[0], timeout=args[1])


def check_accepted(
    door: Door, call: tuple[Any, ...], result: Any, before: dict[str, int], runs: set[str]
) -> None:
    """An accepted call wrote what it says, exactly, and nothing else."""
    kind, *args = call
    after = door.counts()
    if kind in ("get", "list", "wait"):
        assert after == before and door.woken == []  # reads never write
    if kind == "define":  # the definition is stored, and reads back, exactly
        spec, handle = result
        assert after["eec_workflow_definition"] == before["eec_workflow_definition"] + 1
        assert after["eec_workflow_run"] == before["eec_workflow_run"] + 1
        assert door.woken == [handle.run_id]
        stored = load_definition(door.d.client.engine, spec.spec_hash)
        assert stored is not None and stored.spec_hash == spec.spec_hash
        expected_args = {"a": normalized(args[0])}
        assert door.same(stored.nodes[0].args, expected_args), (args[0], stored.nodes[0].args)
        assert door.same(spec.nodes[0].args, expected_args)  # in memory as stored
        return
    if kind == "start":
        workflow, value, workflow_id = args
        view = door.d.get(result.run_id)
        if result.run_id in runs:  # an open run with that workflow id: reused, nothing written
            assert workflow_id is not None and view.workflow_id == workflow_id
            assert after == before and door.woken == []
            return
        assert after["eec_workflow_run"] == before["eec_workflow_run"] + 1
        assert door.woken == [result.run_id]
        assert view.workflow_id == (workflow_id or result.run_id)
        assert door.same(view.input, normalized(value)), (value, view.input)
    elif kind == "signal":
        stored = external.signal_payloads(door.d.client.engine, [result])
        if after["eec_workflow_signal"] == before["eec_workflow_signal"]:
            assert args[3] is not None  # only a repeated idempotency key writes nothing
            assert after == before and door.woken == []
        else:
            assert after["eec_workflow_signal"] == before["eec_workflow_signal"] + 1
            assert door.same(stored[result], normalized(args[2])), (args[2], stored[result])
            assert door.woken == [door.open.run_id]
    elif kind in ("pause", "cancel"):
        assert after["eec_workflow_control"] == before["eec_workflow_control"] + 1
        reasons = door.column(
            "SELECT reason FROM eec_workflow_control WHERE id = (SELECT max(id) FROM "
            "eec_workflow_control)"
        )
        assert reasons == {args[1]}
        # Applied before the call returned, by this process: nothing to wake.
        assert door.woken == []
        expected_status = RunStatus.PAUSED if kind == "pause" else RunStatus.CANCELLED
        assert door.d.get(door.open.run_id).status == expected_status
        # Open again for the next call (its rows are not this call's).
        (door.d.resume if kind == "pause" else door.d.redrive)(door.open.run_id)
    elif kind == "get":
        assert result.run_id in (door.open.run_id, door.done.run_id)
    elif kind == "list":
        status, workflow, limit = args
        assert len(result) <= limit
        assert all(status is None or v.status == status for v in result)
        assert all(workflow is None or v.workflow == workflow for v in result)
    else:
        assert result.status == RunStatus.TERMINATED


def _resolve(door: Door, call: tuple[Any, ...]) -> tuple[Any, ...]:
    placeholders = {"<open>": door.open.run_id, "<done>": door.done.run_id}
    return tuple(placeholders.get(a, a) if isinstance(a, str) else a for a in call)


@settings(SLOW, max_examples=60)
@given(data=st.data())
def test_each_client_call_succeeds_or_is_refused_at_once_and_refusal_writes_nothing(
    door: Door, data: st.DataObject
) -> None:
    for call in data.draw(st.lists(calls(), min_size=1, max_size=4)):
        call = _resolve(door, call)
        allowed = expected(door, call)
        note(f"{call[0]}{tuple(show(a) for a in call[1:])}: expecting {allowed}")
        event(f"{call[0]}: {'accepted' if allowed is None else allowed[0].__name__}")
        before = door.counts()
        runs = door.column("SELECT run_id FROM eec_workflow_run")
        door.woken.clear()
        started = time.monotonic()
        try:
            result = perform(door, call)
        except (DuctorError, TypeError, ValueError, TimeoutError) as exc:
            assert time.monotonic() - started < AT_ONCE_S
            assert allowed is not None, f"refused a good call: {exc!r}"
            assert type(exc) in allowed, f"{exc!r} is not one of {allowed}"
            assert door.counts() == before and door.woken == []  # nothing half-written
            continue
        assert time.monotonic() - started < AT_ONCE_S
        assert allowed is None, f"accepted although it should raise {allowed}"
        check_accepted(door, call, result, before, runs)


# -- c: no accepted run is left stuck -------------------------------------------------------


class Shape(NamedTuple):
    fails: int  # times the step raises before it succeeds
    retry: dict[str, Any]
    sleep_s: float
    wait_s: float
    on_timeout: str
    send: bool  # whether the signal is sent (right after start, before its node is reached)
    payload: Any


SHAPES = st.builds(
    Shape,
    fails=st.integers(0, 2),
    retry=st.fixed_dictionaries(
        {
            "max_attempts": st.integers(1, 4),
            "initial_interval": st.sampled_from([0, 0.0, 0.05, 0.1]),
            "backoff": st.sampled_from([1, 1.5, 2.0]),
            "max_interval": st.sampled_from([0.0, 0.1, 0.2]),
        }
    ),
    sleep_s=st.sampled_from([0, 0.0, -0.0, 0.05, 0.1, 0.3]),
    wait_s=st.sampled_from([0.05, 0.1, 0.3, 1]),
    on_timeout=st.sampled_from(["fail", "continue"]),
    send=st.booleans(),
    payload=GOOD_JSON | deep([1, 99]),  # the run output {"go": payload} is one level deeper
)
#: Wiggle room over a run's own timers: the sweeper's period and the in-process workers.
SLACK_S = 10.0


def test_no_accepted_run_is_left_stuck(tmp_path: Path) -> None:
    app = Celery("stuck", broker="memory://", set_as_current=False)
    app.conf.ductor_sweep_interval = 0.05
    app.conf.broker_transport_options = {"polling_interval": 0.01}
    d = Ductor(app, database_url=f"sqlite:///{tmp_path}/stuck.sqlite3")
    d.migrate()

    @d.step(name="stuck.flaky", timeout=30)
    def flaky(ctx: StepContext, fails: int) -> int:
        if ctx.attempt <= fails:
            raise RuntimeError(f"attempt {ctx.attempt} fails on purpose")
        return ctx.attempt

    names = (f"stuck{n}" for n in itertools.count())

    @settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(shape=SHAPES)
    def finishes_within_its_timers(shape: Shape) -> None:
        name = next(names)
        wf = Workflow(name)
        wf.step("flaky", flaky, args={"fails": "$.input.fails"}, retry=RetryPolicy(**shape.retry))
        wf.sleep("nap", seconds=shape.sleep_s, after=["flaky"])
        wf.wait_signal(
            "go", signal="go", timeout=shape.wait_s, on_timeout=shape.on_timeout, after=["nap"]
        )
        wf.output({"go": "$.nodes.go.output"})
        d.register(wf)
        policy = RetryPolicy(**shape.retry)
        retries = min(shape.fails, policy.max_attempts - 1)
        budget = (
            sum(
                min(policy.initial_interval * policy.backoff**k, policy.max_interval)
                for k in range(retries)
            )
            + shape.sleep_s
            + shape.wait_s
            + SLACK_S
        )
        started = time.monotonic()
        handle = d.start(name, input={"fails": shape.fails})
        if shape.send:
            try:
                d.signal(handle.run_id, "go", shape.payload)
            except InvalidOperation:
                # A step out of attempts at once fails the run, and the local workers may get
                # there before this thread sends the signal (a fresh-clone CI run, loaded): the
                # signal is then refused as to any closed run. Only a run bound to fail may.
                assert shape.fails >= policy.max_attempts, shape
                assert d.get(handle.run_id).status == RunStatus.FAILED
        try:
            view = d.wait(handle.run_id, timeout=budget)
        except TimeoutError:
            stuck = d.get(handle.run_id)
            pytest.fail(
                f"run stuck in {stuck.status} after {budget:.1f}s: "
                f"{ {n: v.status.value for n, v in stuck.nodes.items()} }"
            )
        elapsed = time.monotonic() - started
        note(f"{view.status} in {elapsed:.2f}s (timers {budget - SLACK_S:.2f}s): {view.error}")
        if shape.fails >= policy.max_attempts:
            assert view.status == RunStatus.FAILED
            assert view.nodes["flaky"].attempts == policy.max_attempts
        elif shape.send:
            assert view.status == RunStatus.SUCCEEDED, view.error
            assert same(view.output["go"], normalized(shape.payload)), (shape.payload, view.output)
        elif shape.on_timeout == "continue":
            assert view.status == RunStatus.SUCCEEDED, view.error
            assert view.output == {"go": {"timed_out": True}}
        else:
            assert view.status == RunStatus.FAILED
            assert view.nodes["go"].status == "failed"

    with d.local_workers(concurrency=2):
        finishes_within_its_timers()


# -- regressions: bugs the properties above found -------------------------------------------


def test_wait_timeout_of_an_int_too_large_for_a_float_is_a_value_error_not_overflow_error() -> None:
    with pytest.raises(ValueError, match="use None to wait forever"):
        check_timeout(10**400)
    with pytest.raises(ValueError, match="an integer of"):
        check_timeout(10**5000)  # the message names it without printing 5000 digits
    assert check_timeout(2**64 + 1) == float(2**64 + 1)


@pytest.mark.parametrize(
    "make",
    [
        lambda: Workflow("w").sleep("nap", seconds=10**400),
        lambda: Workflow("w").wait_signal("go", signal="go", timeout=10**400),
        lambda: Workflow("w").step("s", "s", timeout=10**400),
        lambda: RetryPolicy(initial_interval=10**400),
        lambda: RetryPolicy(max_interval=10**400),
        lambda: RetryPolicy(backoff=10**400),
    ],
    ids=["sleep", "wait_signal", "step-timeout", "initial_interval", "max_interval", "backoff"],
)
def test_a_duration_of_an_int_too_large_for_a_float_is_a_definition_error_not_overflow_error(
    make: Callable[[], Any],
) -> None:
    with pytest.raises(DefinitionError, match="at most|between"):
        built = make()
        if isinstance(built, Workflow):
            built.build()


@pytest.mark.parametrize(
    "make",
    [
        lambda: Workflow("w", version=10**5000),
        lambda: ConcurrencyLimit("k", 10**5000),
        lambda: RetryPolicy(max_attempts=10**5000),
        lambda: Workflow("w").scatter("s", "s", over="$.input", max_parallel=10**5000),
        lambda: Workflow("w").scatter("s", "s", over="$.input", tolerated_failure_ratio=10**5000),
        lambda: Workflow("w").event_set("e", events=["a"], mode=10**5000),
        lambda: Workflow("w").step(10**5000, "s"),
    ],
    ids=["version", "limit", "max_attempts", "max_parallel", "ratio", "mode", "node-id"],
)
def test_a_number_of_more_digits_than_python_prints_is_a_definition_error_not_value_error(
    make: Callable[[], Any],
) -> None:
    with pytest.raises(DefinitionError) as info:
        built = make()
        if isinstance(built, Workflow):
            built.build()
    assert "0000000000" not in str(info.value)  # named, not printed


@pytest.mark.parametrize(
    ("args", "output", "needle"),
    [
        ({"x": NAN}, None, "NaN or Infinity) at $.x"),
        ({"x": [1, INF]}, None, "NaN or Infinity) at $.x[1]"),
        ({"x": {INF: 1}}, None, "key inf"),
        (None, NAN, "output is not JSON-serializable"),
    ],
    ids=["nan-arg", "inf-in-list", "inf-key", "nan-output"],
)
def test_a_literal_nan_or_infinity_in_a_definition_is_refused_not_stored_as_null(
    args: Any, output: Any, needle: str
) -> None:
    wf = Workflow("w").step("a", "s", args=args).output(output)
    with pytest.raises(DefinitionError) as info:
        wf.build()
    assert needle in str(info.value) and "workflow 'w'" in str(info.value)


@pytest.mark.parametrize(
    ("args", "output", "needle"),
    [
        ({"x": "a\x00b"}, None, "NUL"),  # PostgreSQL: DataError at start()
        ({"x\x00": 1}, None, "NUL"),
        ({"x": "\ud800"}, None, "lone surrogate"),  # PostgreSQL: DataError at start()
        ({"x": 10**5000}, None, "4300 digits"),  # was a ValueError from pydantic
        ({"x": object()}, None, "type object"),  # was a PydanticSerializationError
        ({"x": nested(MAX_JSON_DEPTH)}, None, "nested deeper than 100"),  # the set is 101 deep
        (None, nested(5000), "nested deeper than 100"),  # was a RecursionError
    ],
    ids=["nul", "nul-name", "surrogate", "huge-int", "object", "args-101-deep", "output-5000"],
)
def test_a_literal_no_database_stores_exactly_is_refused_at_register(
    args: Any, output: Any, needle: str
) -> None:
    wf = Workflow("w").step("a", "s", args=args).output(output)
    with pytest.raises(DefinitionError) as info:
        wf.build()
    assert needle in str(info.value)
    assert Workflow("w").step("a", "s", args={"x": nested(MAX_JSON_DEPTH - 1)}).build()
    assert Workflow("w").step("a", "s").output(nested(MAX_JSON_DEPTH)).build()


def test_scatter_args_that_are_no_mapping_is_a_definition_error_not_type_error() -> None:
    wf = Workflow("w").scatter("s", "s", over="$.input", args=5)  # type: ignore[arg-type]
    with pytest.raises(DefinitionError, match="args must be a mapping"):
        wf.build()


def test_a_tuple_in_a_definition_literal_is_held_as_the_list_it_is_stored_as() -> None:
    spec = Workflow("w").step("a", "s", args={"x": (1, (2,))}).output({"o": ()}).build()
    assert same(spec.nodes[0].args, {"x": [1, [2]]}) and same(spec.output, {"o": []})


def test_a_spec_with_a_negative_zero_hashes_the_same_once_read_back(db_url: str) -> None:
    """PostgreSQL's jsonb gives -0.0 back as 0.0: the spec read back must keep its hash."""
    d = Ductor(Celery("zero", broker="memory://", set_as_current=False), database_url=db_url)
    step = d.step(name="zero.echo")(_prop_step)
    spec = d.register(Workflow("zero").step("a", step, args={"x": -0.0, "y": [0.0, -0.0]}))
    d.start("zero")
    stored = load_definition(d.client.engine, spec.spec_hash)
    assert stored is not None and stored.spec_hash == spec.spec_hash
    assert stored.nodes[0].args == {"x": 0.0, "y": [0.0, 0.0]}


@pytest.mark.parametrize("limit", ["0", "-1", "1001", str(2**64)])
def test_cli_runs_limit_out_of_range_is_one_line_and_exit_1(tmp_path: Path, limit: str) -> None:
    """It was click's IntRange: its usage text on several lines, and exit 2."""
    app = Celery("cli", broker="memory://", set_as_current=False)
    Ductor(app, database_url=f"sqlite:///{tmp_path}/cli.sqlite3").migrate()
    result = CliRunner().invoke(
        ductor_cli, ["runs", "--limit", limit], obj=SimpleNamespace(app=app)
    )
    assert result.exit_code == 1, result.output
    assert result.stderr == f"error: limit must be between 1 and {MAX_LIST_LIMIT}, got {limit}\n"
    ok = CliRunner().invoke(ductor_cli, ["runs", "--limit", "1000"], obj=SimpleNamespace(app=app))
    assert ok.exit_code == 0, ok.output
