"""The runs a bulk control acts on: by workflow, status and creation time, oldest first."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from ..engine.status import RunStatus
from .schema import workflow_run


def matching_run_ids(
    engine: Engine,
    *,
    workflow: str | None,
    statuses: Iterable[RunStatus],
    since: datetime | None,
    limit: int | None,
) -> list[str]:
    query = sa.select(workflow_run.c.run_id).where(
        workflow_run.c.status.in_([s.value for s in statuses])
    )
    if workflow is not None:
        query = query.where(workflow_run.c.workflow == workflow)
    if since is not None:
        query = query.where(workflow_run.c.created_at >= since)
    query = query.order_by(workflow_run.c.created_at, workflow_run.c.run_id)
    if limit is not None:
        query = query.limit(limit)
    with engine.connect() as conn:
        return list(conn.execute(query).scalars())
