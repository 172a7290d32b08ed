"""The dialect object (store/dialect.py): the only place in store/ that tells the databases
apart, the statements it sends on each, and the statements it does not send on SQLite."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

import ductor_celery.store
from ductor_celery.store.dialect import POSTGRES, SQLITE, dialect_named, dialect_of
from ductor_celery.store.schema import rate_bucket, workflow_run

STORE = Path(ductor_celery.store.__file__).resolve().parent

#: A test of the database's name, in any of the forms the store used before the dialect object.
NAME_TEST = re.compile(r"is_postgres\(|dialect\.name|pg_insert if|else sqlite_insert")

#: Where a name test stays, and why.
ALLOWED = {
    # The dialect objects themselves: the one place that maps a name to its ways.
    "dialect.py",
    # A caller's own connection (start(connection=...)) may be to any database, one ductor does
    # not run on among them: its name is read to refuse it by name (WrongDatabase).
    "joined.py:        self.dialect_name = conn.dialect.name",
}


def name_tests() -> list[str]:
    found = []
    for path in sorted(STORE.glob("*.py")):
        for line in path.read_text().splitlines():
            if NAME_TEST.search(line):
                found.append(f"{path.name}:{line}")
    return found


def test_only_the_dialect_module_tells_the_databases_apart() -> None:
    found = name_tests()
    assert any(f.startswith("dialect.py:") for f in found), "the pattern finds the lookup itself"
    stray = [f for f in found if f.split(":", 1)[0] not in ALLOWED and f not in ALLOWED]
    assert stray == [], "ask dialect_of(...) instead:\n" + "\n".join(stray)


def test_the_lookup_is_by_name_and_refuses_other_databases() -> None:
    assert dialect_of(sa.create_engine("sqlite://")) is SQLITE
    assert dialect_of(sa.create_engine("postgresql+psycopg://u@h/d")) is POSTGRES
    assert dialect_named("mysql") is None
    other: Any = SimpleNamespace(dialect=SimpleNamespace(name="mysql"))
    with pytest.raises(ValueError, match="PostgreSQL or SQLite, not 'mysql'"):
        dialect_of(other)


class Recording:
    """A connection that records what it is asked to run (and answers ``True``)."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def execute(self, statement: Any, *_: Any) -> Any:
        self.sent.append(str(statement.compile(dialect=postgresql.dialect())))
        return SimpleNamespace(scalar_one=lambda: True)


def test_postgres_key_locks_are_transaction_scoped_advisory_locks() -> None:
    conn: Any = Recording()
    POSTGRES.advisory_lock(conn, 7, "k")
    assert POSTGRES.try_advisory_lock(conn, 7, "k") is True
    POSTGRES.notify(conn, "ductor_run_finished", "r1")
    # The statements the store sent before the dialect object, unchanged.
    before = [
        sa.select(sa.func.pg_advisory_xact_lock(7, sa.func.hashtext("k"))),
        sa.select(sa.func.pg_try_advisory_xact_lock(7, sa.func.hashtext("k"))),
        sa.select(sa.func.pg_notify("ductor_run_finished", "r1")),
    ]
    assert conn.sent == [str(s.compile(dialect=postgresql.dialect())) for s in before]
    assert conn.sent[0].startswith("SELECT pg_advisory_xact_lock(")


def test_sqlite_sends_nothing_for_locks_and_notifications() -> None:
    # BEGIN IMMEDIATE serializes SQLite's writers: a lock would be a statement for nothing.
    conn: Any = Recording()
    SQLITE.advisory_lock(conn, 7, "k")
    assert SQLITE.try_advisory_lock(conn, 7, "k") is True
    SQLITE.notify(conn, "ductor_run_finished", "r1")
    assert conn.sent == []


@pytest.mark.parametrize(
    ("options", "clause"),
    [
        ({}, "FOR UPDATE"),
        ({"skip_locked": True}, "FOR UPDATE SKIP LOCKED"),
        ({"of": workflow_run, "skip_locked": True}, "FOR UPDATE OF eec_workflow_run SKIP LOCKED"),
        ({"read": True, "key_share": True}, "FOR KEY SHARE"),
    ],
)
def test_row_locks_on_postgres_and_none_on_sqlite(options: dict[str, Any], clause: str) -> None:
    query = sa.select(workflow_run.c.run_id)
    locked = POSTGRES.lock_rows(query, **options)
    assert str(locked.compile(dialect=postgresql.dialect())).endswith(clause)
    assert SQLITE.lock_rows(query, **options) is query


def test_each_insert_is_its_databases_own() -> None:
    for dialect, compiler in ((POSTGRES, postgresql.dialect()), (SQLITE, sqlite.dialect())):
        statement = dialect.insert(rate_bucket).values(key="k", tat=sa.func.now())
        text = str(statement.on_conflict_do_nothing().compile(dialect=compiler))
        assert text.endswith("ON CONFLICT DO NOTHING"), text


def test_times_compare_as_stored() -> None:
    column = workflow_run.c.created_at
    assert POSTGRES.sortable_time(column) is column
    compiled = str(SQLITE.sortable_time(column).compile(dialect=sqlite.dialect()))
    assert compiled.startswith("strftime(")
