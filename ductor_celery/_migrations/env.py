"""Alembic environment for ductor's own tables.

ductor keeps its version in ``eec_alembic_version`` so it never collides with the user's own
Alembic history in the same database, and only ever compares ``eec_`` tables.
"""

from __future__ import annotations

from typing import Any

from alembic import context
from sqlalchemy import create_engine

from ductor_celery.store.migrate import VERSION_TABLE, include_object
from ductor_celery.store.schema import metadata


def run_migrations() -> None:
    config = context.config
    connection = config.attributes.get("connection")
    if connection is None:
        engine = create_engine(config.get_main_option("sqlalchemy.url") or "")
        with engine.connect() as conn:
            _run(conn)
        engine.dispose()
    else:
        _run(connection)


def _run(connection: Any) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        include_object=include_object,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


run_migrations()
