"""The coordinator: the tick loop (``Coordinator``) behind narrow store and dispatcher ports.

Knows no database and no broker: ``store.tick_store.SqlTickStore`` and the runtime's
dispatcher plug it into PostgreSQL/SQLite and Celery, ``fakes`` into dicts and a list.
"""

from .loop import (
    COMPUTED_TICKS,
    MAX_CONFLICT_RETRIES,
    SETTLED_TICKS,
    Coordinator,
    TickOutcome,
    TickResult,
    TickStats,
)
from .port import (
    Dispatcher,
    Keeper,
    Loaded,
    LoadedRun,
    OutboxRow,
    OutcomeNotCarried,
    RunBusy,
    TickClaim,
    TickStore,
    TickTransaction,
    VersionConflict,
    WorkflowIdTaken,
)

__all__ = [
    "COMPUTED_TICKS",
    "MAX_CONFLICT_RETRIES",
    "SETTLED_TICKS",
    "Coordinator",
    "Dispatcher",
    "Keeper",
    "Loaded",
    "LoadedRun",
    "OutboxRow",
    "OutcomeNotCarried",
    "RunBusy",
    "TickClaim",
    "TickOutcome",
    "TickResult",
    "TickStats",
    "TickStore",
    "TickTransaction",
    "VersionConflict",
    "WorkflowIdTaken",
]
