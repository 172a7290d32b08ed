"""Alembic environment for ductor's own tables.

ductor keeps its version in ``eec_alembic_version`` so it never collides with the user's own
Alembic history in the same database, and only ever compares ``eec_`` tables.

Two ways in, one schema:

* ``ductor migrate`` (``ductor_celery.store.migrate.upgrade``) hands over an open connection
  in ``config.attributes["connection"]``;
* ``alembic upgrade head`` from a checkout (``alembic.ini`` at the repository root) connects by
  itself, to the first of: ``-x url=...``, ``sqlalchemy.url`` in the configuration,
  ``DUCTOR_DATABASE_URL``, the embedded SQLite default (the same order as ``ductor migrate``).

This directory has no ``__init__.py`` on purpose: a top-level ``alembic`` package would shadow
the Alembic library. The wheel carries these files as ``ductor_celery/_alembic/`` (setup.py).
"""

from __future__ import annotations

import os
from logging.config import fileConfig
from typing import Any

from alembic import context

from ductor_celery.settings import EMBEDDED_DATABASE_URL, normalize_url
from ductor_celery.store.db import dispose_all, get_engine
from ductor_celery.store.migrate import VERSION_TABLE, include_object
from ductor_celery.store.schema import metadata


def run_migrations() -> None:
    config = context.config
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    if config.config_file_name is not None:
        fileConfig(config.config_file_name, disable_existing_loggers=False)
    url = (
        context.get_x_argument(as_dictionary=True).get("url")
        or config.get_main_option("sqlalchemy.url")
        or os.environ.get("DUCTOR_DATABASE_URL")
        or EMBEDDED_DATABASE_URL
    )
    # The engine ductor itself uses (SQLite: WAL, BEGIN IMMEDIATE), in one transaction, as
    # ``ductor migrate`` does.
    try:
        with get_engine(normalize_url(url)).begin() as conn:
            _run(conn)
    finally:
        dispose_all()


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
