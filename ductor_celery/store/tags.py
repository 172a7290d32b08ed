"""Run tags in ``eec_run_tag`` (docs/tags.md): the rows a start or a tick writes, the filter
``list_runs`` adds. Prune deletes them with the run (store/retention.py).

The run state holds the same pairs (``RunState.tags``); every writer here runs in the
transaction that writes the state, so the index and the state never disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .dialect import dialect_of
from .schema import run_tag, workflow_run


def tags_insert(run_id: str, tags: Mapping[str, str]) -> sa.Insert | None:
    """The rows of a new run's tags (a start, a continue-as-new successor); None for none."""
    if not tags:
        return None
    return sa.insert(run_tag).values(
        [{"run_id": run_id, "key": k, "value": v} for k, v in tags.items()]
    )


def upsert_on(conn: Connection, run_id: str, tags: Mapping[str, str]) -> None:
    """Set these tags of a run (a tick's ``tags_set``): a key it has gets the new value."""
    if not tags:
        return
    insert = dialect_of(conn).insert
    statement = insert(run_tag).values(
        [{"run_id": run_id, "key": k, "value": v} for k, v in tags.items()]
    )
    conn.execute(
        statement.on_conflict_do_update(
            index_elements=[run_tag.c.run_id, run_tag.c.key],
            set_={"value": statement.excluded.value},
        )
    )


def matching(query: Any, tags: Mapping[str, str]) -> Any:
    """``query`` (over ``eec_workflow_run``) narrowed to runs that have every one of ``tags``.

    One ``run_id IN (SELECT run_id ... WHERE key = :k AND value = :v)`` per tag: each is a
    range scan of ``eec_run_tag_key_value`` that yields the run ids from the index alone.
    """
    for key, value in tags.items():
        query = query.where(
            workflow_run.c.run_id.in_(
                sa.select(run_tag.c.run_id).where(run_tag.c.key == key, run_tag.c.value == value)
            )
        )
    return query
