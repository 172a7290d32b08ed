"""``store.db.is_transient``: which errors ``with_retry`` runs a transaction again for.
SQLAlchemy's wrapped operational errors, and psycopg's own from the statements that go to its
cursor directly (the tick's run-row read and commit); never a refused value or a bug."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy.exc import IntegrityError, OperationalError

from ductor_celery.store.db import is_transient, with_retry


@pytest.mark.parametrize(
    "error",
    [
        OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused")),
        psycopg.OperationalError("consuming input failed: server closed the connection"),
        psycopg.errors.DeadlockDetected("deadlock detected"),
        psycopg.errors.SerializationFailure("could not serialize access"),
        psycopg.errors.ReadOnlySqlTransaction("cannot execute UPDATE in a read-only transaction"),
        psycopg.errors.IdleInTransactionSessionTimeout("terminating connection due to idle"),
    ],
)
def test_connection_losses_and_lost_races_are_retried(error: BaseException) -> None:
    assert is_transient(error)


@pytest.mark.parametrize(
    "error",
    [
        psycopg.DataError("unsupported Unicode escape sequence"),
        psycopg.errors.UniqueViolation("duplicate key"),
        IntegrityError("INSERT", {}, ValueError("duplicate")),
        ValueError("a bug"),
    ],
)
def test_refused_values_and_bugs_are_not(error: BaseException) -> None:
    assert not is_transient(error)


def test_a_raw_psycopg_connection_loss_is_retried_until_it_works() -> None:
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return "done"

    assert with_retry(flaky, what="tick", deadline_s=30.0) == "done"
    assert len(calls) == 3
