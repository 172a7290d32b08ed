"""A run started inside the caller's own transaction: ``start(..., connection=)`` / ``using=``.

The run's row (and its definitions) are written on the caller's connection, in the caller's
transaction, so they commit or roll back with the caller's own rows. Its first wake-up is sent
only once that transaction has committed; a rollback leaves no run and sends nothing.

- a SQLAlchemy ``Session``: statements on ``session.connection()``; the wake-up from the
  session's ``after_commit`` event.
- a SQLAlchemy ``Connection``: statements on it. Core has no after-commit event (``commit``
  fires just *before* the DBAPI commit), so at that moment a helper thread waits for the
  transaction to end and wakes the run only if its row is visible then.
- a Django alias (``using=``): our Core statements compiled for that database and run through
  Django's cursor; the wake-up from ``transaction.on_commit(..., using=)``.

A connection to another database than ductor's is refused before anything is written
(``WrongDatabase``): the run would commit where no coordinator looks, or roll back with
nothing. The identity compared is the database itself (PostgreSQL: its name and the server's
start time; SQLite: the file), not the URL's spelling.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable
from datetime import datetime
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from ..definition.spec import WorkflowSpec
from ..errors import WrongDatabase
from . import blobs, runs
from . import tags as run_tags
from .audit import Who
from .dialect import dialect_named, dialect_of
from .schema import dumps_json

log = logging.getLogger("ductor_celery.client")

#: How long a helper thread waits for a SQLAlchemy connection's transaction to end.
COMMIT_WAIT_S = 60.0


class Joined(Protocol):
    """The caller's transaction, as the start path uses it."""

    #: "postgresql" or "sqlite".
    dialect_name: str
    #: Raised by a statement that breaks a unique key (a concurrent insert won).
    integrity_errors: tuple[type[BaseException], ...]

    def execute(self, statement: Any) -> list[Any]:
        """Run a Core statement in the caller's transaction; its rows (if it returns any)."""

    def savepoint(self) -> contextlib.AbstractContextManager[Any]:
        """A nested transaction: a broken unique key rolls back to it, not the caller's."""

    def on_commit(self, fn: Callable[[], None], visible: Callable[[], bool]) -> None:
        """Call ``fn`` once the caller's transaction has committed (``visible``: whether what
        we wrote is committed, for the hook that cannot tell on its own)."""


class _SqlAlchemyJoined:
    integrity_errors: tuple[type[BaseException], ...] = (IntegrityError,)

    def __init__(self, conn: Connection, session: Any = None) -> None:
        self.conn = conn
        self.session = session
        self.dialect_name = conn.dialect.name

    def execute(self, statement: Any) -> list[Any]:
        result = self.conn.execute(statement)
        return list(result.all()) if result.returns_rows else []

    def savepoint(self) -> contextlib.AbstractContextManager[Any]:
        if self.session is not None:
            return self.session.begin_nested()  # type: ignore[no-any-return]
        return self.conn.begin_nested()

    def on_commit(self, fn: Callable[[], None], visible: Callable[[], bool]) -> None:
        if self.session is not None:
            _after_session_commit(self.session, fn)
        else:
            _after_connection_commit(self.conn, fn, visible)


#: Hooks waiting for the end of a caller's transaction, per Session / Connection object. One
#: pair of event listeners per object, however many runs it starts (listeners cannot be
#: removed while their event is being dispatched, and must not pile up).
Hook = tuple[Callable[[], None], Callable[[], bool]]
_pending: weakref.WeakKeyDictionary[Any, list[Hook]] = weakref.WeakKeyDictionary()


def _hooks_of(target: Any, listen: Callable[[], None]) -> list[Hook]:
    hooks = _pending.get(target)
    if hooks is None:
        hooks = _pending[target] = []
        listen()
    return hooks


def _take(target: Any) -> list[Hook]:
    hooks = _pending.get(target)
    if not hooks:
        return []
    taken = list(hooks)
    hooks.clear()
    return taken


def _after_session_commit(session: Any, fn: Callable[[], None]) -> None:
    """The session's ``after_commit`` fires after the DBAPI commit; the end of its outermost
    transaction any other way (rollback, close) drops the hook first."""

    def listen() -> None:
        event.listen(session, "after_commit", _session_committed)
        event.listen(session, "after_transaction_end", _session_transaction_ended)

    _hooks_of(session, listen).append((fn, _always))


def _always() -> bool:
    return True


def _session_committed(session: Any) -> None:
    for fn, _ in _take(session):
        _call(fn)


def _session_transaction_ended(session: Any, transaction: Any) -> None:
    # Only the outermost transaction's end decides (a savepoint's does not). After a commit
    # the hooks were taken already (after_commit fires first).
    if getattr(transaction, "parent", None) is None:
        _take(session)


def _after_connection_commit(
    conn: Connection, fn: Callable[[], None], visible: Callable[[], bool]
) -> None:
    """Core has no after-commit event: ``commit`` fires just before the DBAPI commit. At that
    moment a helper thread starts, waits for the transaction to end, and calls ``fn`` only if
    our rows are visible then (a commit that failed leaves none). A rollback drops the hook."""

    def listen() -> None:
        event.listen(conn, "commit", _connection_committing)
        event.listen(conn, "rollback", _take)

    _hooks_of(conn, listen).append((fn, visible))


def _connection_committing(conn: Connection) -> None:
    hooks = _take(conn)
    if hooks:
        threading.Thread(
            target=_when_ended, args=(conn.get_transaction(), hooks), daemon=True
        ).start()


def _call(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - a wake-up is a hint; the sweeper has pending runs
        log.warning("wake-up after the caller's commit not sent (the sweeper will): %s", exc)


def _when_ended(transaction: Any, hooks: list[Hook]) -> None:
    deadline = time.monotonic() + COMMIT_WAIT_S
    delay = 0.0002
    while transaction is not None and transaction.is_active and time.monotonic() < deadline:
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    for fn, visible in hooks:
        try:
            seen = visible()
        except Exception as exc:  # noqa: BLE001
            log.warning("could not tell whether the caller's commit landed: %s", exc)
            seen = True  # a wake-up for nothing is a no-op tick
        if seen:
            _call(fn)


class _DjangoJoined:
    """Django's connection for an alias: our Core statements, compiled for that database,
    run through Django's own cursor (so in Django's transaction, and in its query log)."""

    def __init__(self, alias: str, ductor_engine: Engine) -> None:
        from django.db import IntegrityError as DjangoIntegrityError
        from django.db import connections

        self.alias = alias
        self.connection = connections[alias]
        self.dialect_name = _django_dialect(self.connection.vendor)
        ours = dialect_of(ductor_engine).name
        if self.dialect_name != ours:
            raise WrongDatabase(
                f"Django database {alias!r} is {self.connection.vendor}, ductor's database "
                f"is {ours}: start() must write to ductor's database"
            )
        # Our statements in the pyformat style Django's cursors take on every backend.
        dialect_class: Any = type(ductor_engine.dialect)
        self._dialect = dialect_class(paramstyle="pyformat")
        self.integrity_errors: tuple[type[BaseException], ...] = (DjangoIntegrityError,)

    def execute(self, statement: Any) -> list[Any]:
        compiled = statement.compile(dialect=self._dialect)
        params = compiled.construct_params()
        for bind, name in compiled.bind_names.items():
            if isinstance(bind.type, sa.JSON):
                # As ductor's own engine writes JSON (store/schema.dumps_json), whatever
                # serializer Django's connection has.
                params[name] = dumps_json(params.get(name))
        with self.connection.cursor() as cursor:
            cursor.execute(compiled.string, params)
            return list(cursor.fetchall()) if cursor.description else []

    def savepoint(self) -> contextlib.AbstractContextManager[Any]:
        from django.db import transaction

        atomic: contextlib.AbstractContextManager[Any] = transaction.atomic(using=self.alias)
        return atomic

    def on_commit(self, fn: Callable[[], None], visible: Callable[[], bool]) -> None:
        from django.db import transaction

        transaction.on_commit(fn, using=self.alias)


def _django_dialect(vendor: str) -> str:
    return {"postgresql": "postgresql", "sqlite": "sqlite"}.get(vendor, vendor)


def join(connection: Any, using: str | None, ductor_engine: Engine) -> Joined:
    """The caller's transaction, checked to be on ductor's database (``WrongDatabase``)."""
    if connection is not None and using is not None:
        raise ValueError("start() takes connection= or using=, not both")
    if using is not None:
        if not isinstance(using, str) or not using:
            raise TypeError(f"using must be a Django database alias, got {using!r}")
        joined: Joined = _DjangoJoined(using, ductor_engine)
    elif isinstance(connection, Connection):
        joined = _SqlAlchemyJoined(connection)
    elif _is_session(connection):
        joined = _SqlAlchemyJoined(connection.connection(), session=connection)
    else:
        raise TypeError(
            "connection must be a SQLAlchemy Connection or Session, got "
            f"{type(connection).__name__}"
        )
    ours = dialect_of(ductor_engine).name
    if joined.dialect_name != ours:
        raise WrongDatabase(
            f"the connection is to a {joined.dialect_name} database, ductor's is "
            f"{ours}: start() must write to ductor's database"
        )
    _check_same_database(joined, ductor_engine)
    return joined


def _is_session(value: Any) -> bool:
    try:
        from sqlalchemy.orm import Session
    except ImportError:  # pragma: no cover - the ORM ships with SQLAlchemy
        return False
    return isinstance(value, Session)


#: Ductor's own database identity, per engine (PostgreSQL: read again once on a mismatch, as
#: a server restart changes its start time).
_identities: weakref.WeakKeyDictionary[Engine, tuple[Any, ...]] = weakref.WeakKeyDictionary()


def _check_same_database(joined: Joined, ductor_engine: Engine) -> None:
    theirs = database_identity(joined.execute, joined.dialect_name)
    ours = _identities.get(ductor_engine)
    if ours != theirs:
        ours = _identities[ductor_engine] = _engine_identity(ductor_engine)
    if ours != theirs:
        raise WrongDatabase(
            f"the connection is to another database ({_describe(theirs)}) than ductor's "
            f"({_describe(ours)}): start() must write to ductor's database"
        )


def _engine_identity(engine: Engine) -> tuple[Any, ...]:
    return dialect_of(engine).engine_identity(engine)


def database_identity(execute: Callable[[Any], list[Any]], dialect_name: str) -> tuple[Any, ...]:
    """What tells one database from another, read on the connection itself (a database ductor
    does not run on is told by its name alone: it is not ductor's anyway)."""
    dialect = dialect_named(dialect_name)
    return (dialect_name,) if dialect is None else dialect.identity(execute)


def _describe(identity: tuple[Any, ...] | None) -> str:
    if not identity:
        return "unknown"
    if identity[0] == "postgresql":
        return f"PostgreSQL database {identity[1]!r}"
    return f"{identity[0]} {identity[1] if len(identity) > 1 else ''}".strip()


# -- the start path ------------------------------------------------------------------------------


def insert_run_on(
    joined: Joined,
    *,
    run_id: str,
    workflow_id: str,
    spec: WorkflowSpec,
    definitions: list[WorkflowSpec],
    input: Any,
    trace_context: str | None = None,
    start_at: datetime | None = None,
    deadline_at: datetime | None = None,
    who: Who | None = None,
    priority: int | None = None,
    tags: dict[str, str] | None = None,
    offload_bytes: int = blobs.DEFAULT_THRESHOLD,
) -> tuple[str, bool]:
    """``runs.insert_run`` in the caller's transaction: the definitions the run pins, then the
    run. Returns (run_id, created); an open run of the same workflow id wins (a savepoint keeps
    the broken unique key from aborting the caller's transaction)."""
    for needed in definitions:
        if joined.execute(runs.definition_exists(needed.spec_hash)):
            continue
        with contextlib.suppress(*joined.integrity_errors), joined.savepoint():
            joined.execute(runs.definition_insert(needed))
    statement = runs.run_insert(
        run_id=run_id,
        workflow_id=workflow_id,
        spec=spec,
        input=input,
        trace_context=trace_context,
        start_at=start_at,
        deadline_at=deadline_at,
        priority=priority,
        tags=tags,
    )
    tag_rows = run_tags.tags_insert(run_id, tags or {})
    try:
        with joined.savepoint():
            if start_at is not None:  # a delayed run: its timer row wakes it (never an ETA)
                joined.execute(runs.timer_insert(run_id, start_at))
            stored = blobs.offloaded(joined, run_id, input, offload_bytes)
            joined.execute(statement if stored is input else statement.values(input=stored))
            if tag_rows is not None:
                joined.execute(tag_rows)
            if who is not None:
                joined.execute(runs.start_entry(who, run_id, workflow_id, spec))
    except joined.integrity_errors:
        existing = joined.execute(runs.open_run_of(workflow_id))
        if not existing:
            raise
        return existing[0][0], False
    return run_id, True
