"""The per-process caches of immutable values (attempt outputs, finished gathers, run inputs)
are kept per database: tokens and run ids are unique within one database only. A copy of a
database (a template, a restored backup, a test's fresh database) holds the same ids, and from
there on each copy can give them other values; a process that talks to both must read each
copy's own (a cache per process once fed one database's output to a run of the other)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from ductor_celery.store.db import get_engine
from ductor_celery.store.outputs import attempt_outputs

TOKEN = "run-copied:a:1:1"


def _attempt(url: str, output: Any) -> None:
    with get_engine(url).begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO eec_workflow_step_attempt (token, run_id, node, generation, attempt,"
                " step, args, timeout, finished_at, outcome, output) VALUES (:t, 'run-copied',"
                " 'a', 1, 1, 's', '{}', 30, now(), 'succeeded', CAST(:o AS jsonb))"
            ),
            {"t": TOKEN, "o": output},
        )


def test_two_databases_with_the_same_token_each_give_their_own_output(
    database_url: str, pg_server: Any, template_db: str
) -> None:
    other = pg_server.url("copy_of_" + database_url.rsplit("/", 1)[1])
    pg_server.create_database(other.rsplit("/", 1)[1], template=template_db)
    _attempt(database_url, '{"from": "first"}')
    _attempt(other, '{"from": "second"}')
    for _ in range(2):  # the second round is served from the caches
        with get_engine(database_url).connect() as conn:
            assert attempt_outputs(conn, [TOKEN]) == {TOKEN: {"from": "first"}}
        with get_engine(other).connect() as conn:
            assert attempt_outputs(conn, [TOKEN]) == {TOKEN: {"from": "second"}}
