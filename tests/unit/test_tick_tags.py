"""Run tags on the pure tick (engine/tags.py, docs/tags.md): the rules a tag obeys, a
succeeded attempt's tags applied (and only the changes sent to the index), a failed one's
dropped, the 20-tag limit never exceeded and never failing the attempt, the state's tags
surviving the stored form, and a continue-as-new successor keeping them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from ductor_celery.definition import RetryPolicy, Workflow
from ductor_celery.engine import AttemptResult, ControlIn, EngineConfig, RunState, TickInputs
from ductor_celery.engine import compute_tick as pure_tick
from ductor_celery.engine.inputs import TickPayload
from ductor_celery.engine.status import NodeStatus, RunStatus
from ductor_celery.engine.tags import MAX_TAGS, checked_tags, tag_problem, tags_problem

T0 = datetime(2026, 1, 1, tzinfo=UTC)
CFG = EngineConfig(resend_unclaimed_after=30.0)
SPEC = (
    Workflow("t")
    .step("a", "s", retry=RetryPolicy(max_attempts=2, initial_interval=1.0))
    .wait_signal("hold", signal="go", after=["a"])
    .build()
)
# Valid tag text: no NUL, no surrogates (tag_problem refuses both; a dropped tag is tested below).
texts = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    min_size=1,
    max_size=100,
)


def _tick(
    state: RunState,
    seconds: float,
    results: tuple[AttemptResult, ...] = (),
    control: ControlIn | None = None,
) -> TickPayload:
    roundtripped = RunState.from_json(state.to_json())  # as the store reloads it
    inputs = TickInputs(run_id="r", results=results, control=control, config=CFG, input={})
    return pure_tick(SPEC, roundtripped, inputs, T0 + timedelta(seconds=seconds))


def _started(tags: dict[str, str]) -> RunState:
    return _tick(RunState.initial(list(SPEC.graph.order), tags=tags), 0).state


def _ok(tags: object, token: str = "r:a:1") -> AttemptResult:
    """A succeeded result carrying ``tags`` exactly as the attempt row would hold them."""
    return AttemptResult(token=token, node="a", outcome="succeeded", output=1, tags=tags)  # type: ignore[arg-type]


def _set(tags: dict[str, str]) -> list[list[str]]:
    """As a worker sends them (``ctx.tags_value``): ``[[key, value], ...]`` in the order set."""
    return [[k, v] for k, v in tags.items()]


def test_the_rules_name_the_problem() -> None:
    assert tag_problem("k", "v") is None
    assert tag_problem("k" * 100, "v" * 100) is None
    assert tag_problem("k", "v" * 101) == (
        "tag value of 'k' must be 1..100 characters, it is 101 characters long"
    )
    assert tag_problem("", "v") == "tag key '' must be 1..100 characters, it is 0 characters long"
    assert tag_problem(1, "v") == "tag key must be a string, got int"
    assert tag_problem("k", None) == "tag value of 'k' must be a string, got NoneType"
    assert tags_problem({f"k{i}": "v" for i in range(20)}) is None
    assert tags_problem({f"k{i}": "v" for i in range(21)}) == (
        "tags: at most 20 tags per run, got 21"
    )
    assert tags_problem("k=v") == "tags must be a mapping of strings to strings, got str"
    assert checked_tags(None) == {}


def test_a_succeeded_attempts_tags_are_applied_and_only_changes_go_to_the_index() -> None:
    state = _started({"customer": "c-1", "region": "eu"})
    p = _tick(state, 1, (_ok(_set({"region": "eu", "risk": "high", "customer": "c-2"})),))
    assert p.state.nodes["a"].status == NodeStatus.SUCCEEDED
    assert p.state.tags == {"customer": "c-2", "region": "eu", "risk": "high"}
    assert p.tags_set == {"risk": "high", "customer": "c-2"}  # region did not change
    assert RunState.from_json(p.state.to_json()).tags == p.state.tags


def test_a_failed_attempts_tags_are_dropped() -> None:
    state = _started({"customer": "c-1"})
    failed = AttemptResult(
        token="r:a:1",
        node="a",
        outcome="failed",
        error={"type": "E", "message": "no"},
        tags=[["risk", "high"]],
    )
    p = _tick(state, 1, (failed,))
    assert p.state.nodes["a"].status == NodeStatus.RUNNING  # retried
    assert p.state.tags == {"customer": "c-1"} and p.tags_set == {}


def test_a_malformed_tags_value_is_dropped_and_said_so_never_raised() -> None:
    state = _started({})
    for malformed in (["risk", "high"], {"risk": "high"}, [["risk", "high", "x"]]):
        p = _tick(state, 1, (_ok(malformed),))
        assert p.state.nodes["a"].status == NodeStatus.SUCCEEDED
        assert p.state.tags == {} and p.tags_set == {}
        assert any("tags dropped: not key-value pairs" in t.reason for t in p.transitions)
    p = _tick(state, 1, (_ok(_set({"k": "v" * 101, "ok": "yes"})),))
    assert p.state.tags == {"ok": "yes"}
    assert any("tag 'k' dropped: tag value of 'k'" in t.reason for t in p.transitions)
    p = _tick(state, 1, (_ok(_set({"nul": "a\x00b", "ok": "yes"})),))
    assert p.state.tags == {"ok": "yes"}
    assert any(
        "tag 'nul' dropped: tag value of 'nul' must not contain NUL" in t.reason
        for t in p.transitions
    )


@settings(max_examples=150, deadline=None)
@given(
    start=st.dictionaries(texts, texts, max_size=MAX_TAGS),
    step=st.dictionaries(texts, texts, max_size=MAX_TAGS),
)
def test_the_run_never_holds_more_than_twenty_tags_and_the_attempt_always_succeeds(
    start: dict[str, str], step: dict[str, str]
) -> None:
    state = _started(start)
    p = _tick(state, 1, (_ok(_set(step)),))
    assert p.state.nodes["a"].status == NodeStatus.SUCCEEDED
    assert len(p.state.tags) <= MAX_TAGS
    # Keys the run had are updated; new keys fill the room left, in the order they were set.
    room = MAX_TAGS - len(start)
    new_keys = [k for k in step if k not in start]
    expected = {**start, **{k: step[k] for k in step if k in start}}
    expected.update({k: step[k] for k in new_keys[:room]})
    assert p.state.tags == expected
    dropped = [t for t in p.transitions if "dropped" in t.reason]
    assert len(dropped) == max(0, len(new_keys) - room)
    # The index gets exactly what changed: together with the start's rows, the state.
    assert {**start, **p.tags_set} == p.state.tags


def test_a_continue_as_new_successor_keeps_the_tags() -> None:
    state = _tick(_started({"customer": "c-1"}), 1, (_ok(_set({"risk": "high"})),)).state
    assert state.nodes["hold"].status == NodeStatus.WAITING
    for control in (
        ControlIn(id=1, kind="continue_as_new"),
        ControlIn(id=2, kind="continue_as_new", input={"fresh": True}, has_input=True),
    ):
        p = _tick(state, 2, control=control)
        assert p.state.status == RunStatus.CONTINUED
        assert p.successor is not None
        assert p.successor.state.tags == {"customer": "c-1", "risk": "high"}
