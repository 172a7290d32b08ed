"""Fakes that ship: the coordinator's store and dispatcher ports in memory.

Like httpx's ``MockTransport``, procrastinate's ``InMemoryConnector`` and dramatiq's
``StubBroker``: a test drives runs through the production tick loop with no database and no
broker::

    from ductor_celery.coordinator import Coordinator
    from ductor_celery.fakes import InMemoryStore, RecordingDispatcher

    store = InMemoryStore()
    sent = RecordingDispatcher(store)
    coordinator = Coordinator(store, sent)
    run_id = store.start(wf.build(), input={"x": 1})
    coordinator.tick(run_id)                 # starts the first steps
    for token in sent.step_tokens():          # play the step workers
        store.claim(token)
        store.finish(token, output=...)
    coordinator.tick(run_id)

Pure Python: nothing here imports SQLAlchemy or Celery. Concurrency leases are not modelled
(a tick that would take one raises ``NotModelled``).
"""

from .commit import NotModelled
from .dispatch import RecordingDispatcher
from .store import EPOCH, InMemoryStore, InMemoryTransaction
from .tables import AttemptRow, ControlRow, RunRow, SignalRow, TransitionRow

__all__ = [
    "EPOCH",
    "AttemptRow",
    "ControlRow",
    "InMemoryStore",
    "InMemoryTransaction",
    "NotModelled",
    "RecordingDispatcher",
    "RunRow",
    "SignalRow",
    "TransitionRow",
]
