"""Placing an order starts its run in the order's own transaction: commit -> the run and its
wake-up, rollback -> nothing at all; ductor's settings come from Django's (CELERY_DUCTOR_*)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.conf import settings
from django.db import connections, transaction
from django.test import Client
from orders.models import Order
from orders.services import OutOfStock, place_order
from shop_site.celery import ductor

from ductor_celery import RunStatus, WrongDatabase
from ductor_celery.settings import normalize_url


@pytest.fixture
def woken(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The wake-ups ductor sends (recorded instead of published): a new run's goes to the step
    workers (its first tick), any other to the coordinator."""
    sent: list[str] = []
    monkeypatch.setattr(ductor.runtime.dispatcher, "first_tick", sent.append)
    monkeypatch.setattr(ductor.runtime.dispatcher, "wake", sent.append)
    return sent


def test_ductor_reads_its_settings_from_django_the_celery_way() -> None:
    assert ductor.settings.database_url == normalize_url(settings.CELERY_DUCTOR_DATABASE_URL)
    assert ductor.settings.default_step_timeout == 60.0
    assert ductor.app.conf.broker_url == settings.CELERY_BROKER_URL


def test_commit_makes_the_order_and_its_run_then_sends_the_wake_up(woken: list[str]) -> None:
    with transaction.atomic():
        order = place_order("ada", ["mug", "lamp"], 1250)
        # Still inside the caller's transaction: nothing sent yet.
        assert woken == []
    assert woken == [order.run_id]
    view = ductor.get(f"order-{order.pk}")
    assert view.run_id == order.run_id
    assert view.status == RunStatus.PENDING
    assert view.input == {"order_id": order.pk, "items": ["mug", "lamp"], "total": 1250}


def test_rollback_leaves_no_order_no_run_and_no_wake_up(woken: list[str]) -> None:
    before = Order.objects.count()
    runs_before = len(ductor.list_runs(limit=1000))
    with pytest.raises(OutOfStock, match="unicorn"):
        place_order("bob", ["mug", "unicorn"], 99)
    assert Order.objects.count() == before
    assert len(ductor.list_runs(limit=1000)) == runs_before
    assert woken == []


def test_a_django_database_that_is_not_ductors_is_refused_with_nothing_written(
    tmp_path: Any, woken: list[str]
) -> None:
    other = {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(tmp_path / "elsewhere.sqlite3"),
    }
    connections.settings["elsewhere"] = connections.configure_settings({"default": other})[
        "default"
    ]
    try:
        with transaction.atomic(using="elsewhere"):
            with pytest.raises(WrongDatabase, match="ductor's database"):
                ductor.start("order", input={}, using="elsewhere")
    finally:
        connections["elsewhere"].close()
        del connections.settings["elsewhere"]
    assert woken == []


def test_the_view_places_an_order_and_workers_fulfil_it() -> None:
    with ductor.local_workers():
        response = Client().post(
            "/orders/",
            json.dumps({"customer": "cy", "items": ["book"], "total": 30}),
            content_type="application/json",
        )
        assert response.status_code == 201, response.content
        body = response.json()
        view = ductor.wait(body["run_id"], timeout=60)
    assert view.status == RunStatus.SUCCEEDED, view.error
    assert view.output == {
        "charge": {"charge_id": view.output["charge"]["charge_id"], "amount": 30}
    }
    assert Order.objects.get(pk=body["order"]).status == "confirmed"

    refused = Client().post(
        "/orders/",
        json.dumps({"customer": "di", "items": ["unicorn"], "total": 5}),
        content_type="application/json",
    )
    assert refused.status_code == 409
    assert not Order.objects.filter(customer="di").exists()
