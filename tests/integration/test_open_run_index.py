"""The partial unique index on open runs' workflow ids: the migrations created it with the
predicate ``store/schema.py`` now makes from ``OPEN_RUN_STATUSES``, so the one definition of
"open" and the database agree without a migration. (Alembic's compare_metadata does not compare
index predicates: these tests do.)"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from ductor_celery.store.db import get_engine
from ductor_celery.store.migrate import upgrade
from ductor_celery.store.schema import OPEN_STATUSES_SQL, metadata

INDEX = "eec_workflow_run_open_workflow_id"


def _sqlite_index_sql(url: str) -> str:
    with get_engine(url).connect() as conn:
        return str(
            conn.exec_driver_sql(
                "SELECT sql FROM sqlite_master WHERE type = 'index' AND name = ?", (INDEX,)
            ).scalar_one()
        )


def test_the_migrated_sqlite_index_has_the_open_statuses_predicate(tmp_path: Any) -> None:
    migrated = f"sqlite:///{tmp_path}/migrated.sqlite3"
    upgrade(migrated)
    declared = f"sqlite:///{tmp_path}/declared.sqlite3"
    metadata.create_all(get_engine(declared))
    assert _sqlite_index_sql(migrated).endswith(f" WHERE {OPEN_STATUSES_SQL}")
    assert _sqlite_index_sql(migrated) == _sqlite_index_sql(declared)


def _pg_index_def(url: str) -> str:
    with get_engine(url).connect() as conn:
        return str(
            conn.execute(
                sa.text("SELECT indexdef FROM pg_indexes WHERE indexname = :name"),
                {"name": INDEX},
            ).scalar_one()
        )


def test_the_migrated_postgres_index_equals_the_declared_one(
    pg_server: Any, database_url: str
) -> None:
    # database_url is a copy of the migrated template; this one has only the declared schema.
    pg_server.create_database("open_index_declared")
    declared = pg_server.url("open_index_declared")
    metadata.create_all(get_engine(declared))
    migrated_def = _pg_index_def(database_url)
    assert migrated_def == _pg_index_def(declared)
    for status in ("pending", "running", "paused"):
        assert f"'{status}'" in migrated_def
