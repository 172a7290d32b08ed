"""Issue 15, items 1 and 2 through the real store and tick, on the embedded SQLite as on
PostgreSQL: typed values round-trip through inputs, arguments, outputs, context patches and
signal payloads; annotated parameters are converted; secrets are resolved by the worker only,
and never stored."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from pydantic import BaseModel

from ductor_celery import Ductor, NodeStatus, RunStatus, StepContext, Workflow

SECRET = "sk_live_7Hq2-never-stored"


class Line(BaseModel):
    sku: str
    qty: int


class Order(BaseModel):
    id: uuid.UUID
    total: Decimal
    placed: datetime
    lines: list[Line]


@dataclasses.dataclass(frozen=True)
class Receipt:
    order_id: uuid.UUID
    charged: Decimal
    at: datetime


ORDER = Order(
    id=uuid.UUID(int=42),
    total=Decimal("19.90"),
    placed=datetime(2024, 3, 1, 9, 30, 15, 123456, tzinfo=UTC),
    lines=[Line(sku="a", qty=1), Line(sku="b", qty=3)],
)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/typed.sqlite3"
    url: str = request.getfixturevalue("database_url")
    return url


def _ductor(db_url: str, **conf: Any) -> Ductor:
    app = Celery(f"typed{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(conf)
    d = Ductor(app, database_url=db_url)
    if db_url.startswith("sqlite"):
        d.migrate()
    return d


def test_typed_values_round_trip_through_a_run(db_url: str) -> None:
    d = _ductor(db_url)
    seen: dict[str, Any] = {}

    @d.step(name="typed.charge")
    def charge(ctx: StepContext, order: Order, when: datetime, amount: Decimal) -> Receipt:
        seen.update(order=order, when=when, amount=amount, input=ctx.input)
        ctx.patch({"charged_at": when, "ref": uuid.UUID(int=7)})
        return Receipt(order.id, amount, when)

    @d.step(name="typed.confirm")
    def confirm(ctx: StepContext, receipt: Any, paid: Any) -> dict[str, Any]:
        seen.update(receipt=receipt, paid=paid, context=dict(ctx.context))
        return {"day": date(2024, 3, 2), "receipt": receipt}

    wf = Workflow("typed")
    wf.step(
        "charge",
        charge,
        args={"order": "$.input.order", "when": "$.input.when", "amount": "$.input.order.total"},
    )
    wf.wait_signal("paid", signal="paid", after=["charge"])
    wf.step(
        "confirm",
        confirm,
        after=["paid"],
        args={"receipt": "$.nodes.charge.output", "paid": "$.nodes.paid.output"},
    )
    wf.output({"confirm": "$.nodes.confirm.output", "order": "$.input.order"})
    d.register(wf)

    when = datetime(2024, 3, 1, 10, 0, tzinfo=UTC)
    with d.local_workers():
        handle = d.start("typed", input={"order": ORDER, "when": when.isoformat()})
        d.signal(handle.run_id, "paid", {"amount": Decimal("19.90"), "at": when})
        view = d.wait(handle.run_id, timeout=30)

    assert view.status == RunStatus.SUCCEEDED, view.error
    receipt = Receipt(ORDER.id, Decimal("19.90"), when)
    assert seen["order"] == ORDER and isinstance(seen["order"], Order)
    assert seen["when"] == when and seen["amount"] == Decimal("19.90")  # converted by pydantic
    assert seen["input"]["order"] == ORDER
    assert seen["receipt"] == receipt  # a dataclass output, as the next step's argument
    assert seen["paid"] == {"amount": Decimal("19.90"), "at": when}  # a signal payload
    assert seen["context"] == {"charged_at": when, "ref": uuid.UUID(int=7)}
    assert view.input == {"order": ORDER, "when": when.isoformat()}
    assert view.context == {"charged_at": when, "ref": uuid.UUID(int=7)}
    assert view.nodes["charge"].output == receipt
    assert view.output == {"confirm": {"day": date(2024, 3, 2), "receipt": receipt}, "order": ORDER}


def test_an_argument_that_does_not_convert_fails_without_retry_naming_it(db_url: str) -> None:
    d = _ductor(db_url)
    calls: list[Any] = []

    @d.step(name="typed.strict")
    def strict(ctx: StepContext, order: Order) -> None:
        calls.append(order)

    wf = Workflow("strict")
    wf.step("strict", strict, args={"order": "$.input"})
    d.register(wf)
    with d.local_workers():
        view = d.wait(d.start("strict", input={"id": "not-a-uuid"}).run_id, timeout=30)
    assert view.status == RunStatus.FAILED
    node = view.nodes["strict"]
    assert node.attempts == 1 and calls == []
    assert node.error["type"] == "InvalidArgument"
    assert "step 'typed.strict' parameter 'order'" in node.error["message"]
    assert "not-a-uuid" not in node.error["message"]


def _every_row(db_url: str) -> str:
    """Every row of every eec_ table, as text."""
    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    try:
        tables = [t for t in sa.inspect(engine).get_table_names() if t.startswith("eec_")]
        with engine.connect() as conn:
            return "\n".join(
                repr(tuple(row))
                for t in tables
                for row in conn.execute(sa.text(f"SELECT * FROM {t}"))
            )
    finally:
        engine.dispose()


def test_a_secret_is_resolved_in_the_worker_and_never_stored(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DUCTOR_SECRET_STRIPE", SECRET)
    d = _ductor(db_url)
    seen: dict[str, Any] = {}

    @d.step(name="typed.pay")
    def pay(ctx: StepContext, api_key: str, note: str) -> dict[str, Any]:
        seen.update(api_key=api_key, note=note, again=ctx.secret("stripe"))
        ctx.heartbeat({"using": api_key})
        ctx.patch({"echo": api_key})
        return {"echo": f"key={api_key}", "note": note}

    @d.step(name="typed.leak")
    def leak(ctx: StepContext, api_key: str) -> None:
        raise RuntimeError(f"the gateway refused {api_key}")

    wf = Workflow("pay")
    wf.step("pay", pay, args={"api_key": "$.secret.stripe", "note": "$.input.note"})
    wf.step("leak", leak, after=["pay"], args={"api_key": "$.secret.stripe"})
    d.register(wf)
    with d.local_workers():
        # Data that looks like a reference is data: the worker fills only the template's slots.
        view = d.wait(d.start("pay", input={"note": "$.secret.stripe"}).run_id, timeout=60)

    assert seen == {"api_key": SECRET, "note": "$.secret.stripe", "again": SECRET}
    assert view.nodes["pay"].output == {"echo": "key=***", "note": "$.secret.stripe"}
    assert view.context == {"echo": "***"}
    error = view.nodes["leak"].error
    assert error["message"] == "the gateway refused ***" and "***" in error["traceback"]
    rows = _every_row(db_url)
    assert "$.secret.stripe" in rows  # the attempt's arguments hold the reference
    assert SECRET not in rows


def test_a_missing_secret_fails_without_retry_naming_it(db_url: str) -> None:
    d = _ductor(db_url, ductor_secret_provider=f"{__name__}:only_known")
    calls: list[str] = []

    @d.step(name="typed.needs")
    def needs(ctx: StepContext, token: str) -> None:
        calls.append(token)

    wf = Workflow("needs")
    wf.step("needs", needs, args={"token": "$.secret.unknown_one"})
    d.register(wf)
    with d.local_workers():
        view = d.wait(d.start("needs").run_id, timeout=30)
    node = view.nodes["needs"]
    assert view.status == RunStatus.FAILED and node.status == NodeStatus.FAILED
    assert node.attempts == 1 and calls == []
    assert node.error["type"] == "SecretNotFound"
    assert "'unknown_one'" in node.error["message"]


def only_known(name: str) -> str:
    return {"known": "v"}[name]


@pytest.mark.parametrize("batch_size", [1, 3])
def test_typed_items_scatter_and_gather_exactly(db_url: str, batch_size: int) -> None:
    d = _ductor(db_url)

    @d.step(name="typed.double")
    def double(ctx: StepContext, item: Decimal, at: datetime) -> dict[str, Any]:
        assert isinstance(item, Decimal) and isinstance(at, datetime)
        return {"twice": item * 2, "at": at, "id": uuid.UUID(int=abs(int(item * 100)))}

    wf = Workflow("typed_scatter")
    wf.scatter(
        "double",
        double,
        over="$.input.items",
        item_arg="item",
        args={"at": "$.input.at"},
        batch_size=batch_size,
    )
    wf.output("$.nodes.double.output")
    d.register(wf)
    items = [Decimal("0.10"), Decimal("1.25"), Decimal("-3"), Decimal("7.5"), Decimal("1E+2")]
    at = datetime(2024, 1, 1, tzinfo=UTC)
    with d.local_workers():
        view = d.wait(d.start("typed_scatter", input={"items": items, "at": at}).run_id, 30)
    assert view.status == RunStatus.SUCCEEDED, view.error
    assert view.output == [
        {"twice": i * 2, "at": at, "id": uuid.UUID(int=abs(int(i * 100)))} for i in items
    ]
    assert [type(o["twice"]) for o in view.output] == [Decimal] * len(items)
