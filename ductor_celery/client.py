"""The client: start runs, read them, wait for them. Inserts rows and sends wake-ups only.

It never imports ``runtime/``: the facade hands it a ``wake`` function.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy.engine import Engine

from . import limits, tracing
from .call_checks import (
    check_audit_filter,
    check_control,
    check_deadline,
    check_id,
    check_list_filter,
    check_payload,
    check_start_time,
    check_start_window,
    check_target,
    check_text,
    check_timeout,
    check_version,
)
from .coordinator import TickOutcome
from .definition.blobrefs import with_placeholders
from .definition.retry import priority_problem
from .definition.spec import ApprovalNodeSpec, WorkflowSpec, approval_signal
from .engine.compensation import is_compensation
from .engine.deadline import deadline_after
from .engine.kinds import (
    REDRIVE_FROM_NODE_ALLOWED,
    AuditAction,
    ControlKind,
    rejection_of,
)
from .engine.outputs import output_ref, resolve_outputs
from .engine.status import TERMINAL_RUN_STATUSES, NodeStatus, RunStatus
from .engine.tags import checked_tags
from .errors import (
    InvalidOperation,
    NodeNotFound,
    RunNotFound,
    VersionNotFound,
    WorkflowNotFound,
)
from .settings import Settings
from .store import audit, blobs, clock, external, finishes, inputs, joined, runs, start_requests
from .store.db import db_now, get_engine, with_retry
from .store.outputs import EngineOutputs
from .store.runs import RunRow
from .store.start_requests import Requested, RequestKey
from .views import (
    AuditEntry,
    AuditPage,
    NodeView,
    RunHandle,
    RunPage,
    RunView,
    compensation_views,
)

log = logging.getLogger("ductor_celery.client")


def _who(by: str | None) -> audit.Who:
    """Who asks (``by=``, checked as an id) and from where (the calling layer's source)."""
    if by is not None:
        check_id(by, "by")
    return audit.Who(actor=by, source=audit.current_source())


#: Ticks a control call runs at most to reach its control: one per control queued before it.
MAX_CONTROL_TICKS = 20

T = TypeVar("T")


def decision_key(run_id: str, node: str, started: str) -> str:
    """The idempotency key of one decision on one waiting episode, within the column's
    MAX_ID_LENGTH (a long node id would overflow it: then a digest of it)."""
    key = f"ductor:decision:{run_id}:{node}:{started}"
    if len(key) <= limits.MAX_ID_LENGTH:
        return key
    return f"ductor:decision:{hashlib.sha256(key.encode()).hexdigest()}"


class Client:
    def __init__(
        self,
        settings: Settings,
        *,
        wake: Callable[[str], None],
        find_spec: Callable[[str], WorkflowSpec | None],
        wake_started: Callable[[str], None] | None = None,
        remember_spec: Callable[[WorkflowSpec], None] | None = None,
        get_engine: Callable[[], Engine] | None = None,
        spec_by_hash: Callable[[str], WorkflowSpec] | None = None,
        find_version: Callable[[str, int], WorkflowSpec | None] | None = None,
        registered_versions: Callable[[str], list[int]] | None = None,
        tick_here: Callable[[str], object] | None = None,
    ) -> None:
        self.settings = settings
        #: Runs one tick of a run in this process, as the coordinator would (the tick code under
        #: the run's lock): how a control is applied before the call that asks for it returns.
        self._tick_here = tick_here
        self._find_version = find_version
        self._registered_versions = registered_versions
        self._spec_by_hash = spec_by_hash
        self._wake = wake
        #: A run just started: its first tick may run on a step worker (``Runtime.wake_started``).
        self._wake_started = wake_started or wake
        self._find_spec = find_spec
        self._remember_spec = remember_spec
        self._get_engine = get_engine

    @property
    def engine(self) -> Engine:
        engine = (
            self._get_engine()
            if self._get_engine is not None
            else get_engine(self.settings.database_url, prepare=self.settings.database_prepare)
        )
        blobs.configure(engine, self.settings.offload_bytes)
        return engine

    # -- writes -----------------------------------------------------------------------------

    def start(
        self,
        workflow: str,
        input: Any = None,
        workflow_id: str | None = None,
        *,
        delay: float | None = None,
        start_at: datetime | None = None,
        deadline: float | None = None,
        connection: Any = None,
        using: str | None = None,
        version: int | None = None,
        by: str | None = None,
        priority: int | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> RunHandle:
        """Insert a pending run and wake it. ``version``: that registered version of the
        workflow (default: the newest). ``delay``/``start_at``: it stays pending until
        then (a timer row wakes it). ``deadline``: seconds from the run's start (the
        workflow's ``deadline`` when not given) after which it ends ``timed_out``.
        ``connection=`` (a SQLAlchemy Connection or Session) or ``using=`` (a Django database
        alias): inserted in that transaction, woken once it commits (store/joined.py).
        ``tags``: up to 20 ``{key: value}`` strings of 1..100 characters (docs/tags.md),
        written with the run; ValueError naming a bad one."""
        handle, _ = self._start(
            workflow,
            input,
            workflow_id,
            delay=delay,
            start_at=start_at,
            deadline=deadline,
            connection=connection,
            using=using,
            version=version,
            by=by,
            priority=priority,
            tags=tags,
        )
        return handle

    def start_request(
        self,
        request: RequestKey | None,
        workflow: str,
        input: Any = None,
        workflow_id: str | None = None,
        **options: Any,
    ) -> tuple[RunHandle, bool]:
        """``start`` (``options``: its keyword arguments but ``connection`` and ``using``),
        at most once per ``request`` (an HTTP start's idempotency key, a webhook's delivery:
        store/start_requests.py): the run and the request's row commit together. Returns
        (handle, created): a request made before returns the run it started, finished or
        not, and starts nothing; so does an open run of the workflow id (the request then
        counts as that run's). ``request=None``: a plain start that says whether it
        created the run."""
        for joined_only in ("connection", "using"):
            if options.get(joined_only) is not None:
                raise ValueError(f"start_request() takes no {joined_only}=")
        return self._start(workflow, input, workflow_id, request=request, **options)

    def _start(
        self,
        workflow: str,
        input: Any,
        workflow_id: str | None,
        *,
        delay: float | None = None,
        start_at: datetime | None = None,
        deadline: float | None = None,
        connection: Any = None,
        using: str | None = None,
        version: int | None = None,
        by: str | None = None,
        request: RequestKey | None = None,
        priority: int | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> tuple[RunHandle, bool]:
        # Every argument is checked before the first query: a bad id must not reach a
        # VARCHAR(200) column (PostgreSQL raises a DataError; SQLite would store it).
        check_id(workflow, "workflow")
        if workflow_id is not None:
            check_id(workflow_id, "workflow_id")
        check_start_time(delay, start_at)
        if version is not None:
            check_version(version)
        check_deadline(deadline)
        if priority is not None:
            problem = priority_problem(priority)
            if problem is not None:
                raise ValueError(problem)
        run_tags = checked_tags(tags)
        who = _who(by)
        value = check_payload(
            input, f"input of workflow {workflow!r}", self.settings.max_payload_bytes
        )
        if request is not None:
            # A repeat: one read, nothing else (its run may have finished long ago).
            earlier = self._read(start_requests.find, self.engine, request)
            if earlier is not None:
                return RunHandle(run_id=earlier.run_id, workflow_id=earlier.workflow_id), False
        spec = self.find_definition(workflow, version)
        if self._remember_spec is not None:
            self._remember_spec(spec)
        run_id = uuid.uuid4().hex
        if connection is not None or using is not None:
            caller = joined.join(
                connection,
                using,
                get_engine(self.settings.database_url, prepare=self.settings.database_prepare),
            )
            # A delay reads the database's clock; without one, touch nothing outside the
            # caller's transaction (on SQLite another connection would wait for its lock).
            fire_at, due_now = (
                (None, True)
                if delay is None and start_at is None
                else self._start_time(self.engine, delay, start_at)
            )
            return self._start_joined(
                caller,
                spec,
                run_id,
                workflow_id or run_id,
                value,
                fire_at,
                due_now,
                self._deadline_at(spec, deadline, fire_at),
                who,
                priority,
                run_tags,
            )
        engine = self.engine
        # The times first: a start_at too far ahead is refused before anything is written.
        start_at, due_now = self._start_time(engine, delay, start_at)
        deadline_at = self._deadline_at(spec, deadline, start_at)
        for needed in self._with_children(spec):
            # The run's own definition is remembered once stored (its insert's foreign key
            # checks it); those its children pin are looked up every time.
            save = functools.partial(runs.save_definition, engine, needed, remember=needed is spec)
            with_retry(save, what="save definition")
        traceparent = tracing.start_run(run_id, spec.name)
        found, created = with_retry(
            lambda: runs.insert_run_requested(
                engine,
                run_id=run_id,
                workflow_id=workflow_id or run_id,
                spec=spec,
                input=value,
                trace_context=traceparent,
                start_at=start_at,
                deadline_at=deadline_at,
                who=who,
                request=request,
                priority=priority,
                tags=run_tags,
            ),
            what="insert run",
        )
        if created and due_now:  # a delayed run is woken by its timer row when it is due
            self._safe_wake(found.run_id, started=True)
        # Not created: the run a concurrent repeat of the request started, or the open run of
        # the workflow id (recorded as the request's in the transaction that found it).
        return RunHandle(run_id=found.run_id, workflow_id=found.workflow_id), created

    def _start_joined(
        self,
        caller: joined.Joined,
        spec: WorkflowSpec,
        run_id: str,
        workflow_id: str,
        value: Any,
        start_at: datetime | None,
        due_now: bool,
        deadline_at: datetime | None = None,
        who: audit.Who | None = None,
        priority: int | None = None,
        tags: dict[str, str] | None = None,
    ) -> tuple[RunHandle, bool]:
        """The run's rows in the caller's transaction (not retried here: a transaction is the
        caller's to retry); the wake-up once it commits (a delayed run: its timer's)."""
        actual, created = joined.insert_run_on(
            caller,
            run_id=run_id,
            workflow_id=workflow_id,
            spec=spec,
            definitions=self._with_children(spec),
            input=value,
            trace_context=tracing.start_run(run_id, spec.name),
            start_at=start_at,
            deadline_at=deadline_at,
            who=who,
            priority=priority,
            tags=tags,
            offload_bytes=self.settings.offload_bytes,
        )
        if created and due_now:
            caller.on_commit(
                lambda: self._safe_wake(actual, started=True),
                visible=lambda: self._read(runs.find_run, self.engine, actual) is not None,
            )
        return RunHandle(run_id=actual, workflow_id=workflow_id), created

    def _start_time(
        self, engine: Engine, delay: float | None, start_at: datetime | None
    ) -> tuple[datetime | None, bool]:
        """A delayed start's time in UTC (from the database's clock, the one the sweeper fires
        timers by), and whether it is due already (then the run is woken at once)."""
        if delay is None and start_at is None:
            return None, True
        now = self._read(db_now, engine)
        if start_at is not None:
            when = start_at.astimezone(UTC)  # SQLite keeps a datetime's wall time only
            check_start_window(when, now)
        else:
            assert delay is not None
            when = now + timedelta(seconds=delay)
        return when, when <= now

    def _deadline_at(
        self, spec: WorkflowSpec, deadline: float | None, start_at: datetime | None
    ) -> datetime | None:
        """When the run times out: ``deadline`` (else the workflow's) seconds after its start,
        its delayed start time or now, on the database's clock (the one ticks compare with)."""
        seconds = deadline if deadline is not None else spec.deadline
        if seconds is None:
            return None
        began = start_at if start_at is not None else self._read(db_now, self.engine)
        return deadline_after(began.astimezone(UTC), seconds)

    def _definition(self, spec_hash: str) -> WorkflowSpec:
        if self._spec_by_hash is not None:
            return self._spec_by_hash(spec_hash)
        spec = self._read(runs.load_definition, self.engine, spec_hash)
        if spec is None:
            raise WorkflowNotFound(f"no workflow definition {spec_hash} is stored")
        return spec

    def _with_children(self, spec: WorkflowSpec) -> list[WorkflowSpec]:
        """The spec and every definition its child runs pin, transitively: the coordinator
        starts children from stored definitions."""
        found: dict[str, WorkflowSpec] = {spec.spec_hash: spec}
        todo = [spec]
        while todo:
            current = todo.pop()
            for node in current.nodes:
                if not hasattr(node, "workflow"):
                    continue
                pinned = getattr(node, "workflow_hash", None)
                if pinned is None:
                    # Not registered when the parent was: the newest definition of the name.
                    try:
                        child = self.find_definition(node.workflow)
                    except WorkflowNotFound:
                        raise WorkflowNotFound(
                            f"workflow {current.name!r}, node {node.id!r} starts workflow "
                            f"{node.workflow!r}, which is not registered"
                        ) from None
                elif pinned in found:
                    continue
                elif self._spec_by_hash is None:
                    raise WorkflowNotFound(f"no definition {pinned} for node {node.id!r}")
                else:
                    child = self._spec_by_hash(pinned)
                if child.spec_hash in found:
                    continue
                found[child.spec_hash] = child
                todo.append(child)
        return list(found.values())

    def _text_limit(self) -> tuple[int, str]:
        """A reason or comment is kept inline (control rows, transitions, audit entries), so
        it is held to the offload threshold too: the smaller limit, and its setting's name."""
        s = self.settings
        if s.offload_bytes < s.max_payload_bytes:
            return s.offload_bytes, "ductor_offload_bytes"
        return s.max_payload_bytes, "ductor_max_payload_bytes"

    def _read(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A read that rides out a dropped connection (a PostgreSQL restart) like writes do."""
        return with_retry(
            lambda: fn(*args, **kwargs), what=f"read ({fn.__name__})", deadline_s=60.0
        )

    def _safe_wake(self, run_id: str, *, started: bool = False) -> None:
        # The row is committed; if the broker is down the sweeper picks the run up instead.
        try:
            (self._wake_started if started else self._wake)(run_id)
        except Exception as exc:  # noqa: BLE001
            log.warning("could not wake run %s (the sweeper will): %s", run_id, exc)

    # -- external input and controls ---------------------------------------------------------

    def signal(
        self,
        target: str,
        name: str,
        payload: Any = None,
        idempotency_key: str | None = None,
        by: str | None = None,
    ) -> int:
        """Accept a signal for the run (kept until a node consumes it). Returns its id."""
        found, _ = self._signal(target, name, payload, idempotency_key, by)
        assert found.signal_id is not None  # a signal without a request always has its row
        return found.signal_id

    def signal_request(
        self,
        request: RequestKey,
        target: str,
        name: str,
        payload: Any = None,
        by: str | None = None,
    ) -> tuple[Requested, bool]:
        """``signal``, at most once per ``request`` (a signal webhook's delivery,
        store/start_requests.py): the signal and the request's row commit together. Returns
        (what the request did, created): a request made before returns its signal and run,
        whether or not that run has finished since, and sends nothing."""
        return self._signal(target, name, payload, None, by, request)

    def _signal(
        self,
        target: str,
        name: str,
        payload: Any,
        idempotency_key: str | None,
        by: str | None,
        request: RequestKey | None = None,
    ) -> tuple[Requested, bool]:
        check_target(target)
        who = _who(by)
        check_id(name, "signal name")
        if name.startswith("ductor."):
            raise ValueError(
                f"invalid signal name {name!r} (names starting 'ductor.' are reserved)"
            )
        if idempotency_key is not None:
            # "" is refused, not read as "no key": the caller meant a key.
            check_id(idempotency_key, "idempotency_key")
        value = check_payload(
            payload, f"payload of signal {name!r}", self.settings.max_payload_bytes
        )
        if request is not None:
            earlier = self._read(start_requests.find, self.engine, request)
            if earlier is not None:  # a repeat: its run may have finished, or been pruned
                return earlier, False
        row = self._row(target)
        # insert_signal decides under the workflow's lock: a repeated key is accepted and
        # ignored (even once the run has finished), a continued run hands the signal to its
        # successor, any other finished run refuses it with InvalidOperation.
        # Without a key of the user's, one of ours: retrying an insert whose commit answer was
        # lost must not accept the signal twice.
        key = idempotency_key or f"ductor:{uuid.uuid4().hex}"
        signal_id, created, target_run = with_retry(
            lambda: external.insert_signal(
                self.engine,
                run_id=row.run_id,
                workflow_id=row.workflow_id,
                name=name,
                payload=value,
                idempotency_key=key,
                who=who,
                request=request,
            ),
            what="insert signal",
        )
        # Without a key of the caller's, a repeat found here is our own retried insert (or a
        # concurrent delivery): a wake-up more is a no-op tick, one less could leave it unseen.
        if created or idempotency_key is None:
            self._safe_wake(target_run)
        done = Requested(run_id=target_run, workflow_id=row.workflow_id, signal_id=signal_id)
        return done, created

    def decide(
        self, target: str, node: str, *, approved: bool, by: str | None, comment: str | None
    ) -> None:
        """approve / reject: only a waiting approval node, and only once."""
        verb = "approve" if approved else "reject"
        check_target(target)
        check_id(node, "node")
        who = _who(by)
        check_text(comment, "comment", *self._text_limit())
        row = self._open_row(target, f"{verb} {node!r}")
        spec = self._read(runs.load_definition, self.engine, row.spec_hash)
        node_spec = spec.graph.nodes.get(node) if spec is not None else None
        if not isinstance(node_spec, ApprovalNodeSpec):
            raise InvalidOperation(f"run {row.run_id}: {node!r} is not an approval node")
        ns = row.state.nodes.get(node)
        status = ns.status.value if ns is not None else "pending"
        if status != NodeStatus.WAITING:
            raise InvalidOperation(
                f"cannot {verb} {node!r}: the node is {status}, not waiting for a decision"
            )
        if self._read(
            external.pending_signal_named, self.engine, row.run_id, approval_signal(node)
        ):
            raise InvalidOperation(f"cannot {verb} {node!r}: a decision is already on its way")
        decision = {
            "approved": approved,
            "by": by,
            "comment": comment,
            "at": clock.now(self.engine).isoformat(),
        }
        check_payload(decision, f"{verb} of {node!r}", self.settings.max_payload_bytes)
        # One decision per waiting episode, as a database fact: a concurrent second decision
        # hits the same key and is refused, while our own retried insert finds itself.
        started = ns.started_at.isoformat() if ns is not None and ns.started_at else ""
        signal_id, created, target_run = with_retry(
            lambda: external.insert_signal(
                self.engine,
                run_id=row.run_id,
                workflow_id=row.workflow_id,
                name=approval_signal(node),
                payload=decision,
                idempotency_key=decision_key(row.run_id, node, started),
                who=who,
                action=AuditAction.APPROVE if approved else AuditAction.REJECT,
                node=node,
            ),
            what="insert decision",
        )
        if not created:
            stored = self._read(external.signal_payloads, self.engine, [signal_id])
            if stored.get(signal_id) != decision:
                raise InvalidOperation(f"cannot {verb} {node!r}: it was decided already")
        self._safe_wake(target_run)

    def control(
        self,
        target: str,
        kind: ControlKind,
        *,
        reason: str | None = None,
        input: Any = None,
        has_input: bool = False,
        requested_by: str | None = None,
        node: str | None = None,
        spec_hash: str | None = None,
    ) -> None:
        """An operator control: checked against the run's state, inserted (with who asked and
        from where), then applied before this returns (``_apply_control``). ``node``: a
        redrive's from-node; ``spec_hash``: a continue-as-new's target definition
        (``continue_as_new``)."""
        kind = ControlKind(kind)  # a caller's plain string too ("pause"); ValueError if unknown
        check_target(target)
        check_text(reason, "reason", *self._text_limit())
        if requested_by is not None:
            check_id(requested_by, "by")
        if node is not None:
            if kind != ControlKind.REDRIVE:
                raise ValueError(f"from_node is for redrive, not {kind}")
            check_id(node, "from_node")
        if has_input:
            what = f"{kind.replace('_', '-')} input"
            input = check_payload(input, what, self.settings.max_payload_bytes)
        row = self._row(target)
        if node is not None:
            self._check_redrive_from(row, node)
        else:
            check_control(row.run_id, row.status, kind)
        if kind == ControlKind.REDRIVE:
            other = self._read(runs.open_run_id, self.engine, row.workflow_id)
            if other is not None:
                raise InvalidOperation(
                    f"cannot redrive run {row.run_id}: run {other} of workflow id "
                    f"{row.workflow_id!r} is open"
                )
        control_id = with_retry(
            lambda: external.insert_control(
                self.engine,
                run_id=row.run_id,
                kind=kind,
                reason=reason,
                requested_by=requested_by,
                input=input,
                has_input=has_input,
                node=node,
                spec_hash=spec_hash,
                source=audit.current_source().value,
            ),
            what=f"insert {kind}",
        )
        self._apply_control(row.run_id, control_id, kind)

    def _apply_control(self, run_id: str, control_id: int, kind: ControlKind) -> None:
        """Apply the control before returning: tick the run here until the control is handled
        (a tick drains one control, oldest first; each waits for the run's lock, held only for
        another tick's few milliseconds). Refused by the run's state when the tick came to it
        (the run moved on since the check above): ``InvalidOperation``, nothing changed.

        Without a tick function (a client made by hand), or when ticking here fails (the
        database went away between the insert and the tick), the control stays queued and
        the run is woken: the coordinator, or the sweeper's scan of unhandled controls, applies
        it. The control row is durable either way."""
        handled, result = False, None
        if self._tick_here is not None:
            try:
                for _ in range(MAX_CONTROL_TICKS):
                    if self._tick_here(run_id) == TickOutcome.BUSY:
                        break  # another tick held the run for seconds: stalled (store/load.py)
                    handled, result = self._read(external.control_outcome, self.engine, control_id)
                    if handled:
                        break
            except Exception as exc:  # noqa: BLE001 - left to the coordinator, said in the log
                log.warning("control %s of run %s left to the coordinator: %s", kind, run_id, exc)
        if not handled:
            self._safe_wake(run_id)
            return
        refused = rejection_of(result)
        if refused is not None:
            raise InvalidOperation(f"cannot {kind.replace('_', '-')} run {run_id}: {refused}")

    def _check_redrive_from(self, row: RunRow, node: str) -> None:
        """A redrive from a node: any finished run but a continued one, and a node its
        definition has (the tick checks both again, against the state it applies it to)."""
        if row.status not in REDRIVE_FROM_NODE_ALLOWED:
            allowed = ", ".join(sorted(s.value for s in REDRIVE_FROM_NODE_ALLOWED))
            raise InvalidOperation(
                f"cannot redrive run {row.run_id} from {node!r}: it is {row.status.value} "
                f"(allowed when {allowed})"
            )
        spec = self._definition(row.spec_hash)
        if node not in spec.graph.nodes:
            known = ", ".join(spec.graph.order)
            raise NodeNotFound(
                f"cannot redrive run {row.run_id} from {node!r}: workflow {spec.name!r} "
                f"version {spec.version} has no such node (its nodes: {known})"
            )

    def _open_row(self, target: str, what: str) -> RunRow:
        row = self._row(target)
        while row.status == RunStatus.CONTINUED and row.continued_to:
            row = self._row(row.continued_to)  # external input goes to the newest run
        if row.status in TERMINAL_RUN_STATUSES:
            raise InvalidOperation(f"cannot {what}: run {row.run_id} is {row.status.value}")
        return row

    # -- reads ------------------------------------------------------------------------------

    def _row(self, target: str) -> RunRow:
        check_target(target)
        row = self._read(runs.find_run, self.engine, target)
        if row is None:
            raise RunNotFound(f"no run with run id or workflow id {target!r}")
        return row

    def audit(
        self,
        target: str | None = None,
        *,
        actor: str | None = None,
        action: str | None = None,
        since: datetime | str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> AuditPage:
        """Audit entries newest first (``target``: a run id, or a workflow id: every run of
        it). Bad arguments: ``TypeError``/``ValueError`` naming them, as ``list_runs``."""
        where, before = check_audit_filter(actor, action, since, limit, cursor)
        if target is not None:
            check_target(target)
            ids = self._read(runs.run_ids_of, self.engine, target)
            if not ids:
                raise RunNotFound(f"no run with run id or workflow id {target!r}")
            where = dataclasses.replace(where, run_ids=tuple(ids), workflow_id=target)
        rows, last = self._read(audit.entries, self.engine, where, limit=limit, before_id=before)
        return AuditPage(
            entries=[AuditEntry(**{**r, "detail": r["detail"] or {}}) for r in rows],
            next_cursor=None if last is None else f"a{last}",
        )

    def get(self, target: str) -> RunView:
        check_target(target)
        return self._view(self._row(target))

    def list_runs(
        self,
        status: str | None = None,
        workflow: str | None = None,
        limit: int = 50,
        since: datetime | str | None = None,
        until: datetime | str | None = None,
        cursor: str | None = None,
        workflow_id: str | None = None,
        tags: Mapping[str, str] | None = None,
        *,
        large_values: bool = True,
    ) -> RunPage:
        """Runs newest first, one page of at most ``limit``: ``since`` (inclusive) and
        ``until`` (exclusive) bound ``created_at``; ``cursor`` is a page's ``next_cursor``;
        ``tags``: only runs that have every one of these tags (docs/tags.md).

        ``large_values=False`` (the console's list, ``GET /api/runs``, ``ductor runs``): a
        large value is shown as ``"large value (N bytes)"`` and never read, so a page costs
        no blob reads and a dangling reference in one run cannot break the list."""
        where, after = check_list_filter(status, workflow, limit, since, until, cursor, workflow_id)
        wanted = checked_tags(tags, "tags filter")
        if wanted:
            where = dataclasses.replace(where, tags=tuple(wanted.items()))
        rows, key = self._read(runs.list_runs, self.engine, limit=limit, where=where, after=after)
        return RunPage(
            runs=[self._view(r, large_values=large_values) for r in rows],
            next_cursor=runs.encode_cursor(key) if key is not None else None,
        )

    def _view(self, row: RunRow, *, large_values: bool = True) -> RunView:
        refs = {node_id: output_ref(ns) for node_id, ns in row.state.nodes.items()}
        source = EngineOutputs(
            self.engine,
            lambda: self._definition(row.spec_hash),
            lambda fn, what: with_retry(fn, what=f"read ({what})", deadline_s=60.0),
        )
        outputs = resolve_outputs(refs, source)
        # Large values are read back here (docs/large-values.md): one connection, opened only
        # when a value holds a reference.
        held = {f"the output of node {n!r}": v for n, v in outputs.items()}
        held["the run's input"] = self._read(
            inputs.input_for_view, self.engine, row.state, row.input
        )
        held["the run's output"] = row.output
        if large_values:
            values = self._read(blobs.resolved_many, self.engine, held)
        else:
            values = {what: with_placeholders(v) for what, v in held.items()}
        read = {n: values[f"the output of node {n!r}"] for n in outputs}
        nodes = {
            node_id: NodeView(
                status=ns.status,
                attempts=ns.generation,
                output=read.get(node_id),
                error=ns.error if ns.status != NodeStatus.SUCCEEDED else None,
                started_at=ns.started_at,
                finished_at=ns.finished_at,
            )
            for node_id, ns in row.state.nodes.items()
            if not is_compensation(node_id)
        }
        return RunView(
            run_id=row.run_id,
            workflow_id=row.workflow_id,
            workflow=row.workflow,
            version=row.version,
            status=row.status,
            input=values["the run's input"],
            context=row.state.context,
            output=values["the run's output"],
            error=row.error,
            nodes=nodes,
            parent_run_id=row.parent_run_id,
            continued_from=row.continued_from,
            continued_to=row.continued_to,
            created_at=row.created_at,
            finished_at=row.finished_at,
            start_at=row.state.start_at,
            deadline_at=row.state.deadline_at,
            tags=row.state.tags,
            compensations=compensation_views(row.state, read),
        )

    def definition_of(self, target: str) -> WorkflowSpec:
        """The spec a run is pinned to."""
        row = self._row(target)
        spec = self._read(runs.load_definition, self.engine, row.spec_hash)
        if spec is None:  # the run's FK makes this impossible short of manual deletes
            raise RunNotFound(f"run {row.run_id}: its definition {row.spec_hash} is missing")
        return spec

    def history(self, target: str, limit: int = 200) -> tuple[list[Any], list[Any]]:
        """(attempt rows, transition rows) of a run, for ``ductor show``."""
        row = self._row(target)
        return self._read(runs.attempts_of, self.engine, row.run_id), runs.transitions_of(
            self.engine, row.run_id, limit
        )

    def find_definition(self, name: str, version: int | None = None) -> WorkflowSpec:
        """The definition to start: ``version`` of ``name`` (registered in this process, or
        stored by a process that started it), or the newest one."""
        if version is not None:
            return self._version(name, version)
        spec = self._find_spec(name) or self._read(runs.latest_definition, self.engine, name)
        if spec is None:
            raise WorkflowNotFound(f"no workflow named {name!r} is registered")
        return spec

    def _version(self, name: str, version: int) -> WorkflowSpec:
        found = self._find_version(name, version) if self._find_version is not None else None
        if found is None:
            found = self._read(runs.definition_of_version, self.engine, name, version)
        if found is not None:
            return found
        known = set(self._registered_versions(name)) if self._registered_versions else set()
        known |= set(self._read(runs.stored_versions, self.engine, name))
        if not known:
            raise WorkflowNotFound(f"no workflow named {name!r} is registered")
        raise VersionNotFound(
            f"workflow {name!r} has no version {version} (registered: "
            f"{', '.join(str(v) for v in sorted(known))})"
        )

    def continue_as_new(
        self,
        target: str,
        *,
        input: Any = None,
        has_input: bool = False,
        version: Any = None,
        requested_by: str | None = None,
    ) -> None:
        """Queue a continue-as-new; ``version``: ``"latest"`` (the newest definition) or a
        registered version number moves the successor to that definition."""
        if version is not None and version != "latest":
            check_version(version, also="'latest'")
        spec_hash = None
        if version is not None:
            check_target(target)
            row = self._row(target)
            check_control(row.run_id, row.status, ControlKind.CONTINUE_AS_NEW)
            spec = self.find_definition(row.workflow, None if version == "latest" else version)
            if spec.spec_hash != row.spec_hash:
                # Stored before the control: the successor row pins it (a foreign key).
                self._save_definitions(spec)
                spec_hash = spec.spec_hash
        self.control(
            target,
            ControlKind.CONTINUE_AS_NEW,
            input=input,
            has_input=has_input,
            spec_hash=spec_hash,
            requested_by=requested_by,
        )

    def _save_definitions(self, spec: WorkflowSpec) -> None:
        if self._remember_spec is not None:
            self._remember_spec(spec)
        for needed in self._with_children(spec):
            with_retry(
                functools.partial(runs.save_definition, self.engine, needed),
                what="save definition",
            )

    def wait(self, target: str, timeout: float | None = None) -> RunView:
        """Block until the run is terminal: told by the commit that finishes it on PostgreSQL
        (``store/finishes.py``), polling on SQLite."""
        check_target(target)
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        run_id: str | None = None
        with finishes.listener(self.engine, self.settings.listen_url) as listener:
            while True:
                # Read after the listener started, so a finish just before it is not missed.
                # The first read finds the run (a workflow id: its newest run); later ones
                # read that run again, whatever runs its workflow id starts meanwhile.
                row, done = self._poll(target, run_id)
                if done:
                    return self._view(row)
                run_id = run_id or row.run_id
                self._check_deadline(target, deadline, timeout)
                remaining = 3600.0 if deadline is None else deadline - time.monotonic()
                listener.wait_for(row.run_id, max(0.0, remaining))

    def _poll(self, target: str, run_id: str | None) -> tuple[RunRow, bool]:
        """The run as it is now (``run_id``, or the one ``target`` names), and whether it is
        finished: terminal, and not about to be reopened by a redrive nobody has applied yet
        (both in one read, so in one snapshot: ``runs.find_run_for_wait``)."""
        check_target(target)
        found = self._read(runs.find_run_for_wait, self.engine, run_id or target)
        if found is None:
            raise RunNotFound(f"no run with run id or workflow id {target!r}")
        row, redrive_pending = found
        row = self._follow(target, row)
        return row, row.status in TERMINAL_RUN_STATUSES and not redrive_pending

    def _follow(self, target: str, row: RunRow) -> RunRow:
        """On a workflow id, a continued run hands over to its successor."""
        while row.status == RunStatus.CONTINUED and row.continued_to and target == row.workflow_id:
            row = self._row(row.continued_to)
        return row

    @staticmethod
    def _check_deadline(target: str, deadline: float | None, timeout: float | None) -> None:
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"run {target!r} did not finish within {timeout}s")
