"""``RecordingDispatcher``: the coordinator's dispatcher port as a list a test reads."""

from __future__ import annotations

from ..coordinator.port import OutboxRow
from ..engine.kinds import DispatchKind
from .store import InMemoryStore


class RecordingDispatcher:
    """Keeps every row it is asked to send, in order. Given a store, it then deletes them
    from its outbox, as the production dispatcher's janitor does once they are sent."""

    def __init__(self, store: InMemoryStore | None = None) -> None:
        self.sent: list[OutboxRow] = []
        self._store = store

    def send(self, rows: list[OutboxRow]) -> None:
        self.sent.extend(rows)
        if self._store is not None:
            self._store.delete_outbox([r.id for r in rows])

    def take(self) -> list[OutboxRow]:
        """The rows sent since the last ``take``."""
        taken, self.sent = self.sent, []
        return taken

    def step_tokens(self) -> list[str]:
        """The attempt tokens of the step messages sent so far."""
        return [r.payload["token"] for r in self.sent if r.kind == DispatchKind.STEP]
