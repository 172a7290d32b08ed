"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from servers import PgBouncer, PostgresServer, RedisServer

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


@pytest.fixture(scope="session")
def pgbouncer(pg_server: PostgresServer) -> Iterator[PgBouncer]:
    """A PgBouncer in transaction pooling mode in front of the session's PostgreSQL;
    ``pgbouncer.url(dbname)`` reaches any of its databases through the pooler."""
    with PgBouncer(pg_server) as server:
        yield server


# --- end server fixtures --------------------------------------------------------------------


# --- databases, clients and workers ---------------------------------------------------------

import itertools  # noqa: E402
import os  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import sqlalchemy as sa  # noqa: E402
from cluster import TESTS_DIR, Cluster  # noqa: E402

_redis_dbs = itertools.count(1)
LEDGER_DDL = (
    "CREATE TABLE e2e_ledger (run_id text, node text, attempt int, at timestamptz DEFAULT now())"
)


@pytest.fixture(scope="session")
def template_db(pg_server: PostgresServer) -> str:
    """A database migrated to head (plus the e2e ledger table) that tests copy."""
    from ductor_celery.store.db import dispose_all
    from ductor_celery.store.migrate import upgrade

    pg_server.create_database("ductor_template")
    url = pg_server.url("ductor_template")
    upgrade(url)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text(LEDGER_DDL))
    engine.dispose()
    dispose_all()
    return "ductor_template"


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite database file migrated to head once per session, for tests to copy into a
    path of their own (``shutil.copyfile``): the very file ``upgrade()`` makes, without
    replaying every migration for each of a file's hundreds of tests."""
    from ductor_celery.store.db import forget_engine
    from ductor_celery.store.migrate import upgrade

    path = tmp_path_factory.mktemp("sqlite-template") / "template.sqlite3"
    url = f"sqlite:///{path}"
    upgrade(url)
    forget_engine(url)  # its last connection closed: the WAL checkpointed into the file
    leftovers = [p.name for p in path.parent.iterdir() if p != path]
    assert not leftovers, leftovers  # the file alone is the whole database
    return path


def _fresh_db(pg_server: PostgresServer, template: str) -> str:
    name = f"t_{uuid.uuid4().hex[:12]}"
    pg_server.create_database(name, template=template)
    return pg_server.url(name)


@pytest.fixture
def database_url(pg_server: PostgresServer, template_db: str) -> Iterator[str]:
    """A fresh, migrated database for one test. Its pooled connections are closed after the
    test: kept for the whole session, a thousand tests' pools would exhaust the server."""
    from ductor_celery.store.db import forget_engine

    url = _fresh_db(pg_server, template_db)
    yield url
    forget_engine(url)


def _broker(request: pytest.FixtureRequest, redis_server: RedisServer) -> str:
    """A broker URL of its own for one cluster: a Redis db, or with DUCTOR_TEST_BROKER=rabbitmq
    a new vhost on the session's RabbitMQ node (see the RabbitMQ block at the end)."""
    if e2e_broker() == "rabbitmq":
        server = request.getfixturevalue("rabbitmq_server")
        return str(server.url(server.new_vhost()))
    return redis_server.url(next(_redis_dbs) % 16)


@pytest.fixture
def cluster_factory(
    request: pytest.FixtureRequest,
    pg_server: PostgresServer,
    redis_server: RedisServer,
    template_db: str,
    tmp_path: Path,
) -> Iterator[Any]:
    """Make Clusters (a fresh database + broker + worker processes); stopped at teardown.
    ``broker``: this broker URL instead of the session's (``DUCTOR_TEST_BROKER``)."""
    made: list[Cluster] = []

    def make(
        app: str = "e2e_app", cwd: Path | None = None, broker: str | None = None, **env: str
    ) -> Cluster:
        cluster = Cluster(
            _fresh_db(pg_server, template_db),
            broker or _broker(request, redis_server),
            tmp_path,
            app=app,
            cwd=cwd or TESTS_DIR,
            **env,
        )
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.discard()


@pytest.fixture(scope="module")
def shared_cluster(
    request: pytest.FixtureRequest,
    pg_server: PostgresServer,
    redis_server: RedisServer,
    template_db: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Cluster]:
    """One running step worker and coordinator shared by a module's well-behaved tests."""
    cluster = Cluster(
        _fresh_db(pg_server, template_db),
        _broker(request, redis_server),
        tmp_path_factory.mktemp("cluster"),
    )
    try:
        cluster.start_steps(concurrency=2)
        cluster.start_coordinator()
        yield cluster
    finally:
        cluster.discard()


@pytest.fixture
def client_for(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The e2e app's Ductor, pointed at a cluster's database and broker, in this process."""
    import importlib
    import sys

    def make(cluster: Cluster) -> Any:
        # The cluster's own settings too: the client registers the definitions, so a step
        # timeout set for the workers (E2E_ECHO_TIMEOUT...) must be the client's as well.
        for key, value in cluster.env.items():
            if key.startswith("E2E_"):
                monkeypatch.setenv(key, value)
        monkeypatch.setenv("DUCTOR_DATABASE_URL", cluster.database_url)
        monkeypatch.setenv("E2E_BROKER_URL", cluster.broker_url)
        sys.modules.pop("e2e_app", None)
        module = importlib.import_module("e2e_app")
        return module.ductor

    yield make
    sys.modules.pop("e2e_app", None)


# --- RabbitMQ: DUCTOR_TEST_BROKER=rabbitmq and the broker-core marker ------------------------
# The e2e tier runs over Redis; DUCTOR_TEST_BROKER=rabbitmq makes every cluster (cluster_factory,
# shared_cluster) use a vhost of its own on one private RabbitMQ node instead. scripts/test runs
# the tests marked ``broker_core`` (a chosen core: workflows, faults, external input, fan-out,
# eager ticks, forged messages) a second time that way, after the whole suite over Redis.

from brokers import e2e_broker  # noqa: E402
from servers import RabbitMQServer  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    e2e_broker()  # a typo in DUCTOR_TEST_BROKER stops the session at once
    config.addinivalue_line(
        "markers",
        "broker_core: the e2e core that scripts/test runs again over RabbitMQ "
        "(DUCTOR_TEST_BROKER=rabbitmq)",
    )


@pytest.fixture(scope="session")
def rabbitmq_server() -> Iterator[RabbitMQServer]:
    """The session's RabbitMQ node; ``rabbitmq_server.url(rabbitmq_server.new_vhost())`` is an
    ``amqp://`` URL of a vhost no one else uses."""
    with RabbitMQServer() as server:
        yield server


# --- end RabbitMQ -----------------------------------------------------------------------------


# --- the order files start in under xdist ------------------------------------------------------
# scripts/test runs files on two processes (``--dist loadfile --no-loadscope-reorder``): each
# takes the next file in collection order when it is almost done with its current one. Files
# start longest first, so that the last minutes are many short files on both processes rather
# than one long e2e file on one while the other has finished. The longest, in test-seconds of a
# CI run (the rest keep their order, e2e first: a file missing here is slower only if it is long).
LONGEST_FIRST = (
    "e2e/test_pools.py",
    "e2e/test_fleet_chaos.py",
    "e2e/test_faults.py",
    "integration/test_controls_property.py",
    "e2e/test_eager_ticks.py",
    "integration/test_tags_explain.py",
    "e2e/test_cli.py",
    "e2e/test_chaos.py",
    "integration/test_bad_client_input.py",
    "e2e/test_rabbitmq_e2e.py",
    "e2e/test_web_console.py",
    "integration/test_large_values_review.py",
    "e2e/test_failover_e2e.py",
    "e2e/test_cancel_terminate.py",
    "integration/test_large_values.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # one process: the usual order
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item: pytest.Item) -> int:
        try:
            relative = item.path.relative_to(TESTS_DIR).as_posix()
        except ValueError:  # a file outside tests/
            return len(rank)
        return rank.get(relative, len(rank))

    items.sort(key=key)  # stable: a file's tests, and the other files, keep their order


def _quick_bound() -> float:
    from ductor_celery.runtime import inline

    return inline.HOLD_IF_QUICKER_S


#: The package's own bound of a quick step, read before any test runs: importing
#: ``e2e_app`` in this process with ``E2E_HOLD_QUICKER`` set (a test of a cluster that holds
#: branches however busy the machine is) sets it for the whole process.
_QUICK_BOUND = _quick_bound()


@pytest.fixture(autouse=True)
def _step_timings_of_a_new_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """runtime/inline.py remembers how long each step last ran in the process (whether a
    run's first tick bundles, whether its first step's events go out at once): every test
    starts with none, as a new worker process does, whatever ran before it here, and with
    the package's bound of a quick step."""
    from ductor_celery.runtime import inline

    monkeypatch.setattr(inline, "_last_ran_by_step", {})
    monkeypatch.setattr(inline, "HOLD_IF_QUICKER_S", _QUICK_BOUND)
