"""Nodes a run state names instead of holding: ``eec_run_state`` gives them back

The one-statement commit leaves a step node that succeeded at its first attempt out of the
run row's state and names it in the state's ``done`` list (its attempt row holds all of it),
and a node that never started in its ``unstarted`` list (store/done_nodes.py). This function
gives the state back whole, as every reader selects it: each ``done`` node as its attempt row
``<run>:<node>:1`` says, each ``unstarted`` one as ``{"status": "pending"}``, in the keys and
forms ``NodeState.to_json`` writes (times as UTC ISO 8601 texts).

Such a state holds the nodes it does hold under ``open`` and has ``"nodes": null``: a process
of a version before 0.3.18 (a rolling upgrade's) fails on it instead of taking the named
nodes for pending ones. PostgreSQL only (SQLite's commit never writes it). No table changes.
The downgrade writes every state back whole first, and refuses if a ``done`` node's attempt
row is gone.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-06 10:40:00
"""

from __future__ import annotations

from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

#: As it is at this revision (a migration must not change with the code).
_ISO = """to_char({0} AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"')"""

_CREATE = f"""
CREATE OR REPLACE FUNCTION eec_run_state(stored jsonb, of_run text) RETURNS jsonb
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN NOT stored ? 'open' THEN stored ELSE (
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
    ) END
$$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_CREATE)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    # A done node whose attempt row is gone cannot be written back: refuse, rather than leave
    # a state that code from before 0.3.18 would read with that node pending.
    op.execute(
        """
DO $$ BEGIN
    IF EXISTS (SELECT 1 FROM eec_workflow_run
               WHERE state ? 'open' AND eec_run_state(state, run_id) ? 'done') THEN
        RAISE EXCEPTION 'a run state names a succeeded step whose attempt row is gone: '
            'its state cannot be written back whole (see docs/done-nodes.md)';
    END IF;
END $$"""
    )
    op.execute(
        "UPDATE eec_workflow_run SET state = eec_run_state(state, run_id) WHERE state ? 'open'"
    )
    op.execute("DROP FUNCTION eec_run_state(jsonb, text)")
