"""An outcome carried by the eager tick (written by the tick's commit through psycopg's own
cursor: ``attempts.CARRIED_SET``, in the one-statement commit or in ``finish_carried``) leaves
exactly the row ``attempts.finish`` and a later tick leave (SQLAlchemy's JSON type), value for
value, and the run the same state: nobody can tell them apart (PostgreSQL: carried outcomes
are a PostgreSQL path; docs/one-statement-step.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from ductor_celery import Ductor, RetryPolicy, Workflow
from ductor_celery.coordinator import OutcomeNotCarried
from ductor_celery.engine import AttemptResult
from ductor_celery.engine.status import AttemptOutcome
from ductor_celery.runtime.tick_task import run_tick
from ductor_celery.store import attempts
from ductor_celery.store.db import ValuesRefused
from ductor_celery.store.schema import step_attempt

_COLUMNS = (
    "outcome",
    "retryable",
    "output IS NULL",
    "output::text",
    "error IS NULL",
    "error::text",
    "patch IS NULL",
    "patch::text",
    "tags IS NULL",
    "tags::text",
    "finished_at IS NOT NULL",
    "folded",
)


@pytest.fixture
def ductor(database_url: str, tmp_path: Path) -> Any:
    app = Celery(f"fit{tmp_path.name}", set_as_current=False)
    app.conf.broker_url = "memory://"
    d = Ductor(app, database_url=database_url)
    d.runtime.dispatcher.send = lambda rows: None  # type: ignore[method-assign,assignment]
    d.runtime.dispatcher.wake = lambda run_id: None  # type: ignore[method-assign]
    d.runtime.dispatcher.first_tick = lambda run_id: None  # type: ignore[method-assign]
    d.step(name="fit.noop")(lambda ctx: None)
    wf = Workflow("fit")
    wf.step("a", "fit.noop", retry=RetryPolicy(max_attempts=2, initial_interval=0.0))
    wf.output({"a": "$.nodes.a.output", "context": "$.context"})
    d.register(wf)
    return d


def _open_attempt(d: Ductor) -> str:
    run_id = d.start("fit").run_id
    run_tick(d.runtime, run_id)
    return _claimed(d, run_id)


def _claimed(d: Ductor, run_id: str) -> str:
    with d.runtime.engine().connect() as conn:
        token = conn.execute(
            sa.select(step_attempt.c.token).where(step_attempt.c.run_id == run_id)
        ).scalar_one()
    assert attempts.claim(d.runtime.engine(), token, "w") is not None
    return str(token)


def _run_of(token: str) -> str:
    return token.rsplit(":", 2)[0]


def _carried(token: str, values: dict[str, Any]) -> AttemptResult:
    return AttemptResult(token=token, node="a", **values)


def _row(d: Ductor, token: str) -> tuple[Any, ...]:
    with d.runtime.engine().connect() as conn:
        return tuple(
            conn.execute(
                sa.text(
                    f"SELECT {', '.join(_COLUMNS)} FROM eec_workflow_step_attempt WHERE token = :t"
                ),
                {"t": token},
            ).one()
        )


@pytest.mark.parametrize(
    "values",
    [
        {"outcome": AttemptOutcome.SUCCEEDED, "output": None},
        {"outcome": AttemptOutcome.SUCCEEDED, "output": {"n": 1, "big": 1e16, "text": "é\u2028"}},
        {"outcome": AttemptOutcome.SUCCEEDED, "output": [1, "two", None], "patch": {"k": [1]}},
        {"outcome": AttemptOutcome.SUCCEEDED, "output": "x", "tags": [["k", "v"], ["a", "b"]]},
        {
            "outcome": AttemptOutcome.FAILED,
            "error": {"type": "E", "message": "m"},
            "retryable": False,
        },
        {"outcome": AttemptOutcome.CANCELLED, "error": {"type": "StepCancelled", "message": ""}},
    ],
)
@pytest.mark.parametrize("leased", [False, True], ids=["on psycopg's cursor", "SQLAlchemy's"])
def test_the_carried_outcome_and_finish_then_a_tick_leave_the_same_rows_and_run(
    ductor: Ductor, values: dict[str, Any], leased: bool
) -> None:
    """``finish`` writes an unleased outcome on psycopg's cursor, a leased one through
    SQLAlchemy (here an attempt without a lease after all): both as a carried outcome."""
    by_finish, carried = _open_attempt(ductor), _open_attempt(ductor)
    written, _ = attempts.finish(ductor.runtime.engine(), by_finish, leased=leased, **values)
    assert written
    assert run_tick(ductor.runtime, _run_of(by_finish)) == "committed"
    outcome = run_tick(
        ductor.runtime, _run_of(carried), eager=True, carried=_carried(carried, values)
    )
    assert outcome == "committed"
    assert _row(ductor, carried) == _row(ductor, by_finish)
    one, other = ductor.get(_run_of(by_finish)), ductor.get(_run_of(carried))
    assert (one.status, one.output, one.error) == (other.status, other.output, other.error)


@pytest.mark.parametrize(
    "output",
    [
        {"n": 1, "big": 1e16, "tiny": 1e-300, "text": "é\u2028\U0001f600", "t": (1, 2), 5: None},
        [{"id": i, "price": i * 1.25, "name": f"item-{i}"} for i in range(40)],
        "a plain string",
    ],
    ids=["exotic", "40 items", "string"],
)
def test_a_checked_output_is_written_from_its_checks_text_as_finish_writes_it(
    ductor: Ductor, output: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step worker's checked output carries its check's JSON text
    (``AttemptResult.output_text``): the commit's parameter is that text, never the output
    encoded again, and the row is the one ``finish`` writes from the value."""
    from ductor_celery.runtime.step_errors import checked_payload

    checked = checked_payload(output, "r", 1 << 30)
    assert checked.problem is None and checked.text is not None
    values = {"outcome": AttemptOutcome.SUCCEEDED, "output": checked.value}
    by_finish, carried = _open_attempt(ductor), _open_attempt(ductor)
    assert attempts.finish(ductor.runtime.engine(), by_finish, **values)[0]
    assert run_tick(ductor.runtime, _run_of(by_finish)) == "committed"
    encoded: list[Any] = []
    real = attempts.dumps_json
    monkeypatch.setattr(attempts, "dumps_json", lambda v: encoded.append(v) or real(v))
    result = AttemptResult(
        token=carried, node="a", checked=True, output_text=checked.text, **values
    )
    assert run_tick(ductor.runtime, _run_of(carried), eager=True, carried=result) == "committed"
    assert encoded and not any(v is checked.value for v in encoded)
    assert _row(ductor, carried) == _row(ductor, by_finish)
    assert ductor.get(_run_of(carried)).output == ductor.get(_run_of(by_finish)).output


def test_a_retry_commits_through_the_ordinary_commit_and_still_carries_the_outcome(
    ductor: Ductor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure the node retries at once is a commit the one statement does not take (the
    retry copies the failed attempt's arguments): ``finish_carried`` writes the outcome."""
    token = _open_attempt(ductor)
    calls: list[str] = []
    real = attempts.finish_carried

    def spy(conn: Any, carried: AttemptResult) -> bool:
        calls.append(carried.token)
        return real(conn, carried)

    monkeypatch.setattr(attempts, "finish_carried", spy)
    failed = {"outcome": AttemptOutcome.FAILED, "error": {"type": "E", "message": "m"}}
    outcome = run_tick(ductor.runtime, _run_of(token), eager=True, carried=_carried(token, failed))
    assert (outcome, calls) == ("committed", [token])
    assert _row(ductor, token)[0] == "failed"
    assert _row(ductor, token)[-1] is True  # folded
    with ductor.runtime.engine().connect() as conn:
        open_now = conn.execute(
            sa.select(step_attempt.c.token).where(
                step_attempt.c.run_id == _run_of(token), step_attempt.c.finished_at.is_(None)
            )
        ).scalars()
        assert [t for t in open_now if t != token], "the retry's attempt is inserted"


def test_finish_carried_writes_the_row_finish_writes(ductor: Ductor) -> None:
    values = {"outcome": AttemptOutcome.SUCCEEDED, "output": {"n": 1}, "tags": [["k", "v"]]}
    by_finish, carried = _open_attempt(ductor), _open_attempt(ductor)
    attempts.finish(ductor.runtime.engine(), by_finish, **values)
    with ductor.runtime.engine().begin() as conn:
        assert attempts.finish_carried(conn, _carried(carried, values))
    assert _row(ductor, carried)[:-1] == _row(ductor, by_finish)[:-1]
    assert _row(ductor, carried)[-1] is True


def test_an_attempt_finished_already_or_leased_is_not_written(ductor: Ductor) -> None:
    token = _open_attempt(ductor)
    one = _carried(token, {"outcome": AttemptOutcome.SUCCEEDED, "output": 1})
    with ductor.runtime.engine().begin() as conn:
        assert attempts.finish_carried(conn, one)
    with ductor.runtime.engine().begin() as conn:
        assert not attempts.finish_carried(conn, _carried(token, {"outcome": "failed"}))
    assert _row(ductor, token)[:4] == ("succeeded", True, False, "1")
    leased = _open_attempt(ductor)
    with ductor.runtime.engine().begin() as conn:
        conn.execute(
            sa.update(step_attempt).where(step_attempt.c.token == leased).values(lease_key="k")
        )
    succeeded = _carried(leased, {"outcome": AttemptOutcome.SUCCEEDED})
    with pytest.raises(OutcomeNotCarried):
        run_tick(ductor.runtime, _run_of(leased), eager=True, carried=succeeded)
    assert _row(ductor, leased)[0] is None


def test_a_checked_success_is_carried_as_it_is_anything_else_through_json() -> None:
    """``steps._carried``: a success whose values are the JSON checks' own (``Outcome.checked``)
    goes to the tick as it is, marked checked; a redacted or failed outcome is read back
    through JSON, unmarked, so the tick's guard checks it and shares nothing with it."""
    from ductor_celery.runtime.outcome import Outcome
    from ductor_celery.runtime.steps import _carried
    from ductor_celery.store.attempts import ClaimedAttempt

    claimed = ClaimedAttempt(
        token="r:a:1",
        run_id="r",
        workflow_id="r",
        node="a",
        branch=None,
        generation=0,
        attempt=1,
        step="s",
        args={},
        context={},
    )
    output = {"n": [1, 2]}
    checked = _carried(claimed, Outcome(AttemptOutcome.SUCCEEDED, output=output, checked=True))
    assert checked.checked and checked.output is output
    redacted = _carried(claimed, Outcome(AttemptOutcome.SUCCEEDED, output=output))
    assert not redacted.checked
    assert redacted.output == output and redacted.output is not output
    error = {"type": "X", "message": "m"}
    failed = _carried(claimed, Outcome(AttemptOutcome.FAILED, error=error, checked=True))
    assert not failed.checked and failed.error == error and failed.error is not error


def test_a_success_redacted_after_its_checks_is_carried_unchecked(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that used a secret has its values redacted after the JSON checks: what is
    carried is read back through JSON and checked again by the tick; a plain step's checked
    values go as they are. Both runs succeed with the values as stored."""
    from ductor_celery.engine.kinds import DispatchKind
    from ductor_celery.runtime import steps

    secret = "s3cret-value-for-the-test"
    app = Celery(f"red{tmp_path.name}", set_as_current=False)
    app.conf.update(broker_url="memory://", ductor_secret_provider={"k": secret}.__getitem__)
    d = Ductor(app, database_url=database_url)
    sent: list[Any] = []
    d.runtime.dispatcher.send = sent.extend  # type: ignore[method-assign,assignment]
    d.runtime.dispatcher.wake = lambda run_id: None  # type: ignore[method-assign]
    d.runtime.dispatcher.first_tick = lambda run_id: None  # type: ignore[method-assign]
    d.step(name="red.plain")(lambda ctx: {"said": "hello"})
    d.step(name="red.secret")(lambda ctx: {"said": ctx.secret("k")})
    for name in ("plain", "secret"):
        wf = Workflow(f"red_{name}")
        wf.step("a", f"red.{name}")
        wf.output("$.nodes.a.output")
        d.register(wf)
    carried: list[AttemptResult] = []
    original = steps._carried
    monkeypatch.setattr(steps, "_carried", lambda *a: carried.append(original(*a)) or carried[-1])
    outputs = []
    for name in ("plain", "secret"):
        run_id = d.start(f"red_{name}").run_id
        sent.clear()
        assert run_tick(d.runtime, run_id) == "committed"
        (token,) = [r.payload["token"] for r in sent if r.kind == DispatchKind.STEP]
        step = d.runtime.step_named(f"red.{name}")
        assert step is not None
        steps.execute_attempt(d.runtime, step, token, hostname="h", queue="q", carrier=token)
        view = d.get(run_id)
        assert view.status == "succeeded"
        outputs.append(view.output)
    plain, redacted = carried
    assert plain.checked and plain.output == {"said": "hello"}
    assert plain.output_text == '{"said": "hello"}'  # its check's text, carried with it
    assert not redacted.checked and redacted.output == {"said": "***"}
    assert redacted.output_text is None  # the check's text holds the secret: never carried
    assert outputs == [{"said": "hello"}, {"said": "***"}]


@pytest.mark.parametrize(
    ("output", "cause"),
    [
        ({"text": "a\u0000b"}, "UntranslatableCharacter"),  # PostgreSQL's jsonb refuses it
        ({"n": float("nan")}, "InvalidTextRepresentation"),  # so does its json
        ({"s": {1, 2}}, "ValueNotEncodable"),  # the JSON encoder refuses it
    ],
)
@pytest.mark.parametrize("leased", [False, True], ids=["on psycopg's cursor", "SQLAlchemy's"])
def test_an_outcome_whose_values_are_refused_is_values_refused_and_writes_nothing(
    ductor: Any, output: Any, cause: str, leased: bool
) -> None:
    """Values the JSON encoder or PostgreSQL refuses are ``ValuesRefused`` naming why (the
    worker then writes a failure without them), on either of ``finish``'s paths, and the
    attempt stays open."""
    token = _open_attempt(ductor)
    engine = ductor.runtime.engine()
    with pytest.raises(ValuesRefused) as refused:
        attempts.finish(
            engine, token, outcome=AttemptOutcome.SUCCEEDED, output=output, leased=leased
        )
    assert refused.value.cause.startswith(cause), refused.value.cause
    assert _row(ductor, token)[0] is None, "still open: nothing written"
    written, _ = attempts.finish(engine, token, outcome=AttemptOutcome.SUCCEEDED, output={"ok": 1})
    assert written


def test_a_chain_passes_an_output_on_from_its_texts_and_stores_it_exactly(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step whose arguments are the step before's output, run inline: the output is written
    from its check's text, the next attempt's arguments from theirs
    (``NewAttempt.args_text``), and the inline claim reads them from it; none of them encodes
    the value again, and every row holds the value exactly (a float of a positive exponent,
    text outside ASCII, an int key)."""
    from ductor_celery.engine.kinds import DispatchKind
    from ductor_celery.runtime import inline, steps
    from ductor_celery.store import pg_commit

    value = {"big": 1e16, "text": "é\u2028\U0001f600", 5: [1.5, None], "n": -0.0}
    stored = {"big": 1e16, "text": "é\u2028\U0001f600", "5": [1.5, None], "n": -0.0}
    app = Celery(f"pass{tmp_path.name}", set_as_current=False)
    app.conf.update(broker_url="memory://")
    d = Ductor(app, database_url=database_url)
    sent: list[Any] = []
    d.runtime.dispatcher.send = sent.extend  # type: ignore[method-assign,assignment]
    d.runtime.dispatcher.wake = lambda run_id: None  # type: ignore[method-assign]
    d.runtime.dispatcher.first_tick = lambda run_id: None  # type: ignore[method-assign]
    seen: list[Any] = []
    d.step(name="pass.make")(lambda ctx: value)
    d.step(name="pass.take")(lambda ctx, prev: seen.append(prev) or prev)
    wf = Workflow("pass_on")
    wf.step("a", "pass.make")
    wf.step("b", "pass.take", after=["a"], args={"prev": "$.nodes.a.output"})
    wf.output("$.nodes.b.output")
    d.register(wf)
    encoded: list[Any] = []
    for module in (attempts, pg_commit, inline):
        real = module.dumps_json
        monkeypatch.setattr(module, "dumps_json", lambda v, real=real: encoded.append(v) or real(v))
    run_id = d.start("pass_on").run_id
    assert run_tick(d.runtime, run_id) == "committed"
    (token,) = [r.payload["token"] for r in sent if r.kind == DispatchKind.STEP]
    step = d.runtime.step_named("pass.make")
    assert step is not None
    queue = d.runtime.settings.steps_queue  # the chain runs "b" inline: the same queue
    steps.execute_attempt(d.runtime, step, token, hostname="h", queue=queue, carrier=token)
    view = d.get(run_id)
    assert view.status == "succeeded"
    assert seen == [stored] and view.output == stored

    def holds_the_value(v: Any) -> bool:
        inside = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        return v == stored or any(holds_the_value(x) for x in inside)

    # Once only: as the run's output, by the commit that finishes the run (its own value,
    # resolved from the nodes' outputs). Not as either outcome, nor as b's arguments.
    assert encoded and [v for v in encoded if holds_the_value(v)] == [view.output]
    # As PostgreSQL stores what dumps_json makes of the value: every number as written
    # there (1e16 as 10000000000000000.0, never read back as an int).
    from ductor_celery.store.schema import dumps_json

    with d.runtime.engine().connect() as conn:
        expected = conn.execute(
            sa.text("SELECT CAST(:v AS jsonb)::text"), {"v": dumps_json(stored)}
        )
        want = expected.scalar_one()
        rows = conn.execute(
            sa.text(
                "SELECT node, output::text, args::text, (args->'prev')::text "
                "FROM eec_workflow_step_attempt WHERE run_id = :r ORDER BY node"
            ),
            {"r": run_id},
        ).all()
    assert [tuple(r) for r in rows] == [("a", want, "{}", None), ("b", want, rows[1][2], want)]
    assert "10000000000000000.0" in want
