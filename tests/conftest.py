"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from servers import PostgresServer, RedisServer

# --- server fixtures ------------------------------------------------------------------------
# One private PostgreSQL and one Redis server per pytest session (see tests/servers.py): both
# on 127.0.0.1, on free ports, with data in temp dirs. They start lazily, on first use, so tests
# that need no server pay nothing. Tests may restart() or kill() them; keep the fixture objects
# (not URLs cached at import time) as the source of truth. Per-test databases and workers build
# on these and live below this block.


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    """The session's PostgreSQL server; ``pg_server.url(dbname)`` gives a SQLAlchemy URL."""
    with PostgresServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """The session's Redis server; ``redis_server.url(db)`` gives a ``redis://`` URL."""
    with RedisServer() as server:
        yield server


# --- end server fixtures --------------------------------------------------------------------
