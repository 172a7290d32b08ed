"""``store.db.retry_deadline``: inside it, ``with_retry`` gives up on a database that keeps
failing at the context's end, whatever longer deadline its caller asked for; nested contexts
never extend it; outside, the caller's deadline holds."""

from __future__ import annotations

import time

import pytest
from sqlalchemy.exc import OperationalError

from ductor_celery.errors import StoreUnavailable
from ductor_celery.store.db import retry_deadline, with_retry


def _down() -> None:
    raise OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused"))


def test_a_request_deadline_cuts_every_retry_short() -> None:
    began = time.monotonic()
    with retry_deadline(0.3), pytest.raises(StoreUnavailable, match="connection refused"):
        with_retry(_down, what="read", deadline_s=120.0)
    assert time.monotonic() - began < 2.0
    # One end for the whole context: a second call inside it gives up at once.
    with retry_deadline(0.3):
        time.sleep(0.35)
        began = time.monotonic()
        with pytest.raises(StoreUnavailable):
            with_retry(_down, what="write", deadline_s=120.0)
        assert time.monotonic() - began < 0.5


def test_a_nested_deadline_never_extends_the_outer_one() -> None:
    began = time.monotonic()
    with retry_deadline(0.3), retry_deadline(60.0), pytest.raises(StoreUnavailable):
        with_retry(_down, what="read", deadline_s=120.0)
    assert time.monotonic() - began < 2.0


def test_without_one_the_callers_deadline_holds() -> None:
    began = time.monotonic()
    with pytest.raises(StoreUnavailable):
        with_retry(_down, what="read", deadline_s=0.3, first_delay=0.05)
    assert 0.3 <= time.monotonic() - began < 2.0
