"""runtime/lost_outcomes.py: a step worker writes again the outcomes a database failover lost
(asynchronous replication: the commit was acknowledged by a primary that died before its
standby had it). The database side is faked here: which server answers, how many outages
this process saw, which attempts are still open and whose claim they carry."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from ductor_celery.runtime import lost_outcomes as lo


class FakeDatabase:
    """Answers the keeper under test, which looks from the test's own thread (``watch=False``).
    A keeper an earlier test left in this process still looks from its own thread every
    ``CHECK_EVERY_S``: it is answered by the real functions, so it neither counts as a lookup
    here nor sees this fake server."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._test_thread = threading.get_ident()
        real_identity, real_outages = lo.server_identity, lo.outages
        real_open_claims = lo.attempts.open_claims
        self.identity = "10.0.0.1 5432 t0"
        self.down = False
        self.outages = 0
        #: token -> claimed_by, for attempts still open
        self.open: dict[str, str | None] = {}
        self.lookups = 0
        monkeypatch.setattr(lo, "server_identity", self._ours(self._identity, real_identity))
        monkeypatch.setattr(lo, "outages", self._ours(lambda: self.outages, real_outages))
        monkeypatch.setattr(
            lo.attempts, "open_claims", self._ours(self._open_claims, real_open_claims)
        )

    def _ours(self, fake: Any, real: Any) -> Any:
        def answer(*args: Any) -> Any:
            return (fake if threading.get_ident() == self._test_thread else real)(*args)

        return answer

    def _identity(self, engine: Any) -> str:
        if self.down:
            raise ConnectionError("database away")
        return self.identity

    def _open_claims(self, engine: Any, tokens: list[str]) -> dict[str, str | None]:
        self.lookups += 1
        return {t: self.open[t] for t in tokens if t in self.open}


@pytest.fixture
def db(monkeypatch: pytest.MonkeyPatch) -> FakeDatabase:
    return FakeDatabase(monkeypatch)


class Writes:
    def __init__(self) -> None:
        self.done: list[str] = []
        self.fail = False

    def __call__(self, token: str) -> Any:
        def write() -> str:
            if self.fail:
                raise ConnectionError("still away")
            self.done.append(token)
            return "succeeded"

        return write


def _keeper() -> lo.LostOutcomes:
    return lo.LostOutcomes(lambda: "engine", watch=False)


def test_nothing_is_looked_up_while_the_same_server_answers(db: FakeDatabase) -> None:
    keeper, writes = _keeper(), Writes()
    keeper.keep("a", "run", "me:1", 10, writes("a"), since=0)
    db.open["a"] = "me:1"  # (as if; it is not looked at)
    assert keeper.check() == 0
    assert keeper.check() == 0
    assert db.lookups == 0 and writes.done == []


def test_after_a_failover_the_lost_outcomes_are_written_again(db: FakeDatabase) -> None:
    keeper, writes = _keeper(), Writes()
    for token, claimer in [("lost", "me:1"), ("lost-claim", "me:2"), ("safe", "me:3"),
                           ("taken", "me:4"), ("never-there", "me:5")]:  # fmt: skip
        keeper.keep(token, "run", claimer, 10, writes(token), since=0)
    assert keeper.check() == 0  # the server before
    db.identity = "10.0.0.2 5432 t1"  # the standby, promoted
    db.open = {"lost": "me:1", "lost-claim": None, "taken": "other:9"}
    assert keeper.check() == 2
    assert sorted(writes.done) == ["lost", "lost-claim"]
    # Written: not again at the next change.
    db.identity = "10.0.0.1 5432 t2"
    keeper.check()
    assert sorted(writes.done) == ["lost", "lost-claim"]


def test_an_outage_this_process_saw_counts_even_on_the_same_server(db: FakeDatabase) -> None:
    keeper, writes = _keeper(), Writes()
    keeper.keep("a", "run", "me:1", 10, writes("a"), since=0)
    db.open["a"] = "me:1"
    assert keeper.check() == 0
    db.outages += 1  # e.g. a pooler hid the failover; the process lost a connection
    assert keeper.check() == 1


def test_the_first_look_after_an_outage_during_the_write_checks(db: FakeDatabase) -> None:
    """The write began before an outage and returned after it (retried): the thread may
    have seen the new server already, so the keep itself asks for a look."""
    keeper, writes = _keeper(), Writes()
    db.outages = 3
    keeper.keep("a", "run", "me:1", 10, writes("a"), since=2)
    db.open["a"] = "me:1"
    assert keeper.check() == 1


def test_an_outcome_never_written_is_written_once_the_database_is_back(db: FakeDatabase) -> None:
    keeper, writes = _keeper(), Writes()
    db.down = True
    keeper.keep("a", "run", "me:1", 10, writes("a"), since=0, written=False)
    db.open["a"] = "me:1"
    assert keeper.check() == 0  # still away: nothing done, nothing forgotten
    db.down = False
    assert keeper.check() == 1
    assert writes.done == ["a"]


def test_a_failed_rewrite_is_tried_again_at_the_next_look(db: FakeDatabase) -> None:
    keeper, writes = _keeper(), Writes()
    keeper.keep("a", "run", "me:1", 10, writes("a"), since=0)
    keeper.check()
    db.identity, db.open = "new", {"a": "me:1"}
    writes.fail = True
    with pytest.raises(ConnectionError):
        keeper.check()
    writes.fail = False
    assert keeper.check() == 1


def test_what_is_kept_is_bounded(db: FakeDatabase, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lo, "MAX_ENTRIES", 3)
    monkeypatch.setattr(lo, "MAX_BYTES", 100)
    keeper, writes = _keeper(), Writes()
    keeper.keep("huge", "run", "me", 101, writes("huge"), since=0)
    assert len(keeper) == 0
    for i in range(5):
        keeper.keep(f"t{i}", "run", "me", 10, writes(f"t{i}"), since=0)
    assert len(keeper) == 3
    keeper.keep("big", "run", "me", 90, writes("big"), since=0)
    assert len(keeper) == 2  # the two oldest went to make room (10 + 90 bytes left)
    clock = [lo.time.monotonic()]
    monkeypatch.setattr(lo.time, "monotonic", lambda: clock[0])
    keeper.keep("fresh", "run", "me", 5, writes("fresh"), since=0)
    clock[0] += lo.RETAIN_S + 1
    db.identity = "new"
    assert keeper.check() == 0 and len(keeper) == 0


def test_sqlite_keeps_nothing(tmp_path: Any) -> None:
    from ductor_celery.store.db import forget_engine

    url = f"sqlite:///{tmp_path}/k.sqlite3"
    try:
        assert lo.lost_outcomes(url, prepare=True) is None
    finally:
        forget_engine(url)


def test_a_disposed_engine_ends_the_looking(db: FakeDatabase) -> None:
    """An app whose engine was disposed of (a test's throwaway database, a shutdown): its
    keeper forgets everything rather than open connections again for nobody."""
    engine: list[Any] = ["engine"]
    keeper, writes = lo.LostOutcomes(lambda: engine[0], watch=False), Writes()
    keeper.keep("a", "run", "me:1", 10, writes("a"), since=0)
    engine[0] = None
    db.identity, db.open = "new", {"a": "me:1"}
    assert keeper.check() == 0
    assert len(keeper) == 0 and writes.done == []


def test_the_thread_ends_when_nothing_is_kept(
    db: FakeDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lo, "CHECK_EVERY_S", 0.01)
    monkeypatch.setattr(lo, "RETAIN_S", 0.05)
    keeper = lo.LostOutcomes(lambda: "engine")
    keeper.keep("a", "run", "me:1", 10, Writes()("a"), since=0)
    thread = keeper._thread
    assert thread is not None
    thread.join(5)
    assert not thread.is_alive() and keeper._thread is None and len(keeper) == 0
