"""``eec_run_state`` in PL/pgSQL: its plan kept by the connection, not made at every call

Migration 0020 wrote ``eec_run_state`` in ``LANGUAGE sql``. PostgreSQL cannot inline that
function (its body has a subquery), so each statement that calls it parses, analyses and
plans the body again (``fmgr_sql``): in a quick chain, 18% of the server's CPU (``perf``,
``benchmarks/chain_cost.py --pg-perf``), though the body runs about once a run. A PL/pgSQL
function parses its query once per connection and keeps it prepared (PostgreSQL's plan cache
then reuses a generic plan or makes custom ones, as it does for any prepared statement); a
state that names no
nodes (no ``open`` key, as every state SQLite and code before 0.3.18 wrote) is returned by a
plain expression, with no query at all.

The same function: the same result for every input (``tests/integration/test_done_nodes.py``
compares the two), ``STABLE`` and ``PARALLEL SAFE`` as before. PostgreSQL only. No table
changes; the downgrade puts the ``LANGUAGE sql`` body of 0020 back.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-06 16:20:00
"""

from __future__ import annotations

from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

#: As they are at this revision (a migration must not change with the code).
_ISO = """to_char({0} AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"')"""

#: The whole state of a state that names nodes (0020's body, after its ``CASE``).
_NAMED = f"""
        SELECT (stored - 'open' - 'done' - 'unstarted')
            || jsonb_build_object('nodes', COALESCE(stored -> 'open', '{{}}'::jsonb)
                || COALESCE((
                    SELECT jsonb_object_agg(u, '{{"status": "pending"}}'::jsonb)
                    FROM unnest(string_to_array(stored ->> 'unstarted', ',')) AS u
                ), '{{}}'::jsonb)
                || COALESCE(jsonb_object_agg(d, jsonb_build_object(
                    'status', 'succeeded', 'generation', 1, 'attempt', 1,
                    'started_at', {_ISO.format("a.created_at")},
                    'finished_at', {_ISO.format("a.finished_at")},
                    'output_token', a.token)) FILTER (WHERE a.token IS NOT NULL),
                    '{{}}'::jsonb))
            -- A name whose attempt row is gone stays in "done", which no reader accepts
            -- (RunState.from_json refuses it): a lost node is an error, never a pending one.
            || CASE WHEN bool_or(a.token IS NULL) THEN jsonb_build_object(
                        'done', string_agg(d, ',') FILTER (WHERE a.token IS NULL))
                    ELSE '{{}}'::jsonb END
        FROM unnest(string_to_array(COALESCE(stored ->> 'done', ''), ',')) AS d
        LEFT JOIN eec_workflow_step_attempt a
            ON a.token = of_run || ':' || d || ':' || '1' AND a.finished_at IS NOT NULL
"""

_PLPGSQL = f"""
CREATE OR REPLACE FUNCTION eec_run_state(stored jsonb, of_run text) RETURNS jsonb
LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
-- The arguments, whatever columns the tables may gain (PL/pgSQL would otherwise refuse a
-- name that is both).
#variable_conflict use_variable
BEGIN
    IF stored IS NULL OR NOT stored ? 'open' THEN
        RETURN stored;
    END IF;
    RETURN ({_NAMED});
END $$
"""

_SQL = f"""
CREATE OR REPLACE FUNCTION eec_run_state(stored jsonb, of_run text) RETURNS jsonb
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN NOT stored ? 'open' THEN stored ELSE ({_NAMED}) END
$$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_PLPGSQL)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_SQL)
