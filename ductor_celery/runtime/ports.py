"""What the step and tick code need from the process they run in: ``WorkerPort``.

``runtime.Runtime`` builds the Celery tasks and calls down into ``steps``, ``tick_task``,
``inline`` and ``sweeper``; they take a ``WorkerPort``, not the ``Runtime``, so none of them
imports ``runtime.py`` back (tests/unit/test_runtime_layers.py keeps it so). ``Runtime``
satisfies the protocol structurally: nothing wraps it, and a step pays no extra call for it.

A test or a harness may hand these functions anything with the same members.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection, Engine

    from ..definition.spec import WorkflowSpec
    from ..settings import Settings
    from .dispatch import Dispatcher
    from .step_context import Step


class WorkerPort(Protocol):
    """The narrow face of a worker process's runtime (read-only members: a plain attribute
    satisfies each)."""

    @property
    def app(self) -> Any:
        """The Celery app (its task events, its current task)."""

    @property
    def settings(self) -> Settings:
        """The process's ductor settings."""

    @property
    def dispatcher(self) -> Dispatcher:
        """Sends step and tick messages (runtime/dispatch.py)."""

    @property
    def failpoint(self) -> Callable[[str], None]:
        """Fault tests: called at named points of a tick (runtime/failpoints.py)."""

    def engine(self) -> Engine:
        """The SQLAlchemy engine of the process's database (ready to use)."""

    def spec_for(self, spec_hash: str, conn: Connection | None = None) -> WorkflowSpec:
        """A run's pinned definition by its hash, read on ``conn`` if given."""

    def wake(self, run_id: str) -> None:
        """Send the run's wake-up to the coordinator queue."""

    def step_named(self, name: str) -> Step | None:
        """The step registered under a task name in this process, or None."""
