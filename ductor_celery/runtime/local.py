"""``ductor.local_workers()``: the production tasks and tick, consumed by threads in this process.

One Celery WorkController (the same class ``celery worker`` runs) consumes both ductor queues
with a thread pool, against the configured broker or Celery's in-memory transport. There is no
eager mode and no second engine: only where the consumers live changes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from celery.worker import WorkController
from celery.worker import state as worker_state

if TYPE_CHECKING:
    from .ports import WorkerPort

log = logging.getLogger("ductor_celery.local")

#: The longest the consumer loop waits for a message before it looks whether to stop.
DRAIN_CYCLE_S = 0.1


class _LocalWorkController(WorkController):  # type: ignore[misc]
    """A WorkController that tells us when its consumer is ready."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.ready = threading.Event()
        super().__init__(*args, **kwargs)

    def on_consumer_ready(self, consumer: Any) -> None:
        # Celery's blocking loop (the in-memory transport's) waits up to 2 s per cycle for a
        # message and checks for shutdown only between cycles, then runs one more cycle on the
        # way out: leaving local_workers() cost about 4 s. Cycles of a tenth of a second cost
        # nothing the transport's own 10 ms polling does not, and make leaving prompt.
        connection = getattr(consumer, "connection", None)
        if connection is not None:
            drain = connection.drain_events

            def drain_briefly(timeout: float | None = None, **kwargs: Any) -> Any:
                return drain(
                    timeout=DRAIN_CYCLE_S if timeout is None else min(timeout, DRAIN_CYCLE_S),
                    **kwargs,
                )

            connection.drain_events = drain_briefly
        self.ready.set()


@contextmanager
def local_workers(rt: WorkerPort, concurrency: int = 4, timeout: float = 30.0) -> Iterator[Any]:
    app = rt.app
    # Pool threads resolve tasks through the current app, which is thread-local with a
    # process-wide default: make ours the default, as `celery -A app worker` does.
    app.finalize()
    app.set_default()
    worker = _LocalWorkController(
        app=app,
        hostname=f"ductor-local-{threading.get_ident()}@localhost",
        pool="threads",
        concurrency=max(2, concurrency + 1),  # one slot is effectively the coordinator's
        queues=[rt.settings.coord_queue, rt.settings.steps_queue],
        loglevel=logging.WARNING,
        without_heartbeat=True,
        without_mingle=True,
        without_gossip=True,
        ready_callback=None,
    )

    def run() -> None:
        app.set_current()
        worker.start()

    thread = threading.Thread(target=run, name="ductor-local-workers", daemon=True)
    thread.start()
    if not worker.ready.wait(timeout):
        raise RuntimeError(f"local workers did not start within {timeout}s")
    try:
        yield worker
    finally:
        # The consumer loop checks this flag; it is how Celery's own embedded worker stops.
        worker_state.should_terminate = 0
        thread.join(timeout)
        worker_state.should_terminate = None
        if thread.is_alive():
            log.warning("local workers still running after %.0fs", timeout)
