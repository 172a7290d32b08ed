"""The facade: ``Ductor(app)`` wires the client and the Celery runtime together."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any, overload

from . import retention
from .client import Client
from .declared import declare_annotations, register_type
from .definition.builder import Workflow
from .definition.checks import check_step_options, not_a_function
from .definition.checks import step_name as checked_step_name
from .definition.retry import ConcurrencyLimit, RateLimit, RetryPolicy
from .definition.spec import WorkflowSpec
from .definition.webhooks import Webhook, Webhooks
from .definition.webhooks import webhook as check_webhook
from .engine.kinds import ControlKind
from .errors import DefinitionError
from .runtime.runtime import Runtime
from .runtime.step_context import Step
from .schedules import DEFAULT_CATCHUP_WINDOW_S, Schedules
from .settings import Settings
from .store import migrate
from .views import AuditPage, RunHandle, RunPage, RunView, ScheduleView

log = logging.getLogger("ductor_celery")


class Ductor:
    """Durable workflows on a Celery app: ``ductor = Ductor(app)``."""

    def __init__(self, app: Any, database_url: str | None = None) -> None:
        self.app = app
        self.settings = Settings.from_conf(app.conf, database_url)
        self._steps: dict[str, Step] = {}
        #: The newest registered version of each workflow (what start() runs by default).
        self._workflows: dict[str, WorkflowSpec] = {}
        #: Every registered version: start(version=) and continue_as_new(version=) pick one.
        self._versions: dict[tuple[str, int], WorkflowSpec] = {}
        self._runtime = Runtime(app, self.settings)
        self.client = Client(
            self.settings,
            wake=self._runtime.wake,
            wake_started=self._runtime.wake_started,
            find_spec=self._workflows.get,
            remember_spec=self._runtime.remember_spec,
            get_engine=self._runtime.engine,
            spec_by_hash=self._runtime.spec_for,
            find_version=lambda name, version: self._versions.get((name, version)),
            registered_versions=lambda name: [v for n, v in self._versions if n == name],
            tick_here=self._runtime.tick_here,
        )
        self.schedules = Schedules(self.client)
        #: The hooks ``webhook()`` registered: the console serves each at ``/hooks/<name>``.
        self.webhooks = Webhooks()
        app._ductor = self
        self._configure_app()

    def _configure_app(self) -> None:
        def apply(**_: Any) -> None:
            conf = self.app.conf
            if not conf.broker_url and "broker_url" not in conf.changes:
                # No broker configured: Celery's in-memory transport, polled briskly, so a
                # script with local_workers() needs no server at all.
                conf.broker_url = "memory://"
                conf.broker_transport_options = {
                    **(conf.broker_transport_options or {}),
                    "polling_interval": 0.01,
                }
            # On RabbitMQ, Celery makes ductor's queues as ductor declares them (quorum queues,
            # runtime/broker.py) whoever looks them up first.
            self._runtime.queues.hook()
            # Flower needs task events; turn them on unless the user decided otherwise.
            for key in ("worker_send_task_events", "task_send_sent_event"):
                if key not in conf.changes:
                    conf[key] = True
            if self.settings.embedded and str(conf.broker_url or "").split(":")[0] not in (
                "",
                "memory",
            ):
                log.warning(
                    "ductor is using the embedded SQLite database %s with a networked broker: "
                    "workers on other hosts cannot share that file; set ductor_database_url",
                    self.settings.database_url,
                )

        if self.app.configured:
            apply()
        else:
            self.app.on_after_configure.connect(apply, weak=False)

    # -- steps and workflows ----------------------------------------------------------------

    @overload
    def step(self, fn: Callable[..., Any], /) -> Step: ...

    @overload
    def step(
        self,
        fn: None = None,
        /,
        *,
        name: str | None = None,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
        heartbeat_timeout: float | None = None,
        schedule_to_start_timeout: float | None = None,
        queue: str | None = None,
        concurrency: ConcurrencyLimit | None = None,
        rate_limit: RateLimit | None = None,
    ) -> Callable[[Callable[..., Any]], Step]: ...

    def step(
        self,
        fn: Callable[..., Any] | None = None,
        /,
        *,
        name: str | None = None,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
        heartbeat_timeout: float | None = None,
        schedule_to_start_timeout: float | None = None,
        queue: str | None = None,
        concurrency: ConcurrencyLimit | None = None,
        rate_limit: RateLimit | None = None,
    ) -> Any:
        """Turn a function ``fn(ctx, **args)`` into a durable step (a Celery task).

        Everything is checked here, at decoration: a step accepted now must never stop a
        worker from starting or make a run's ticks fail later.
        """
        if fn is not None and not callable(fn):  # @ductor.step(5), @ductor.step("name")
            raise DefinitionError(not_a_function(fn))

        def decorate(func: Callable[..., Any]) -> Step:
            step_name = checked_step_name(func, name)
            check_step_options(
                step_name,
                retry=retry,
                timeout=timeout,
                heartbeat_timeout=heartbeat_timeout,
                schedule_to_start_timeout=schedule_to_start_timeout,
                queue=queue,
                concurrency=concurrency,
                rate_limit=rate_limit,
            )
            if step_name in self._steps and self._steps[step_name].fn is not func:
                raise DefinitionError(
                    f"two different functions are registered as step {step_name!r}"
                )
            step = Step(
                name=step_name,
                fn=func,
                retry=retry or RetryPolicy(),
                timeout=timeout,
                heartbeat_timeout=heartbeat_timeout,
                schedule_to_start_timeout=schedule_to_start_timeout,
                queue=queue,
                concurrency=concurrency,
                rate_limit=rate_limit,
            )
            self._runtime.register_step(step)
            self._steps[step_name] = step
            # The classes its annotations name are the app's word that values may carry them.
            declare_annotations(func)
            return step

        if fn is not None:
            return decorate(fn)
        return decorate

    def register_type(self, cls: type) -> None:
        """Declare a pydantic model or dataclass that values may carry: a value's envelope
        naming it is rebuilt into it (in every process that declares it). Classes named in a
        registered step's annotations are declared already. Nothing is ever imported because
        a value names it; an envelope of an undeclared class stays the plain dict it was sent
        as. Raises ``TypeError`` for anything but a model or dataclass class."""
        register_type(cls)

    def register(self, workflow: Workflow) -> WorkflowSpec:
        """Validate and register a workflow; raises DefinitionError naming the problem."""
        if not isinstance(workflow, Workflow):
            raise DefinitionError(f"register() takes a Workflow, got {type(workflow).__name__}")
        spec = workflow.build(self._steps.get, self._workflows.get)
        self._versions[(spec.name, spec.version)] = spec
        newest = self._workflows.get(spec.name)
        # Registering an older version (to keep starting it with version=) leaves the newest
        # the default; the same version again replaces it.
        if newest is None or spec.version >= newest.version:
            self._workflows[spec.name] = spec
        self._runtime.remember_spec(spec)
        return spec

    def webhook(
        self,
        name: str,
        workflow: str | None = None,
        *,
        secret: str,
        workflow_id: str | None = None,
        signal: str | None = None,
        target: str | None = None,
        scheme: str = "ductor",
    ) -> Webhook:
        """Register a signed webhook, served by the console at ``POST /hooks/<name>``
        (docs/webhooks.md). ``workflow=``: each delivery starts a run with the JSON body as
        its input, its workflow id the value at the ``workflow_id`` path (``"$.body.id"``);
        or ``signal=``: each delivery signals the run whose run id or workflow id is at the
        ``target`` path, the body as the payload. Once per delivery: a repeat does nothing.
        ``secret``: ``"$.secret.<name>"``, read from ``ductor_secret_provider`` when a
        delivery arrives. ``scheme``: ``"ductor"`` (``X-Ductor-Signature``), ``"stripe"``
        (``Stripe-Signature``) or ``"github"`` (``X-Hub-Signature-256``). Raises
        DefinitionError naming the problem; the same hook registered again is a no-op."""
        return self.webhooks.add(
            check_webhook(
                name,
                workflow,
                secret=secret,
                workflow_id=workflow_id,
                signal=signal,
                target=target,
                scheme=scheme,
            )
        )

    # -- client -----------------------------------------------------------------------------

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
        """Start a run; with ``delay`` (seconds) or ``start_at`` (an aware datetime) it stays
        ``pending`` until then (a timer row, cancellable like any open run). ``deadline``:
        seconds from its start after which it ends ``timed_out`` (default: the workflow's).
        ``connection=`` (SQLAlchemy) or ``using=`` (a Django alias): inside the caller's
        transaction on ductor's database, woken once it commits. ``version``: that registered
        version of the workflow (default: the newest); the run keeps it to the end.
        ``priority``: 0..9, higher first wherever work waits (default: the workflow's
        ``priority``, 0 unless set); its child runs inherit it (docs/flow-control.md).
        ``tags``: up to 20 ``{key: value}`` strings of 1..100 characters to find the run by
        (``list_runs(tags=)``); a continue-as-new successor keeps them (docs/tags.md)."""
        return self.client.start(
            workflow,
            input=input,
            workflow_id=workflow_id,
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

    def get(self, target: str) -> RunView:
        return self.client.get(target)

    def wait(self, target: str, timeout: float | None = None) -> RunView:
        return self.client.wait(target, timeout=timeout)

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
        """One page of runs, newest first; iterate it like a list, ``next_cursor`` for more.
        ``tags``: only runs that have every one of these tags. Large values are read back
        into the views (one read per value on the page); ``large_values=False`` shows
        ``"large value (N bytes)"`` instead and reads none (docs/large-values.md)."""
        return self.client.list_runs(
            status=status,
            workflow=workflow,
            limit=limit,
            since=since,
            until=until,
            cursor=cursor,
            workflow_id=workflow_id,
            tags=tags,
            large_values=large_values,
        )

    def signal(
        self,
        target: str,
        name: str,
        payload: Any = None,
        idempotency_key: str | None = None,
        by: str | None = None,
    ) -> int:
        """Send a durable signal to a run (run id or workflow id). Returns the signal's id."""
        return self.client.signal(target, name, payload, idempotency_key=idempotency_key, by=by)

    def approve(
        self, target: str, node: str, by: str | None = None, comment: str | None = None
    ) -> None:
        self.client.decide(target, node, approved=True, by=by, comment=comment)

    def reject(
        self, target: str, node: str, by: str | None = None, comment: str | None = None
    ) -> None:
        self.client.decide(target, node, approved=False, by=by, comment=comment)

    def pause(self, target: str, reason: str | None = None, by: str | None = None) -> None:
        """Pause the run, applied before this returns (``InvalidOperation`` if its state does
        not allow it); ``by``: who asks, for the audit log."""
        self.client.control(target, ControlKind.PAUSE, reason=reason, requested_by=by)

    def resume(self, target: str, by: str | None = None) -> None:
        self.client.control(target, ControlKind.RESUME, requested_by=by)

    def cancel(self, target: str, reason: str | None = None, by: str | None = None) -> None:
        self.client.control(target, ControlKind.CANCEL, reason=reason, requested_by=by)

    def terminate(self, target: str, reason: str | None = None, by: str | None = None) -> None:
        self.client.control(target, ControlKind.TERMINATE, reason=reason, requested_by=by)

    def redrive(
        self,
        target: str,
        from_node: str | None = None,
        input: Any = None,
        by: str | None = None,
    ) -> None:
        """Reopen a finished run: failed and cancelled nodes run again with a fresh retry
        budget (a failed, cancelled or terminated run). ``from_node``: that node and every
        node after it run again too, upstream outputs kept; any finished run, a succeeded one
        too. ``input``: the rerun's nodes see this input instead of the run's
        (docs/operations.md)."""
        self.client.control(
            target,
            ControlKind.REDRIVE,
            node=from_node,
            input=input,
            has_input=input is not None,
            requested_by=by,
        )

    def continue_as_new(
        self,
        target: str,
        input: Any = None,
        version: int | str | None = None,
        by: str | None = None,
    ) -> None:
        """Close the run as ``continued`` and start its successor with the same workflow id.

        Without ``input`` the successor carries the context and every finished node forward;
        with ``input`` it starts the workflow from the top with that input. ``version``:
        ``"latest"`` (the newest registered definition) or a registered version number: the
        successor runs that definition (docs/operations.md); default: the run's own.
        """
        self.client.continue_as_new(
            target, input=input, has_input=input is not None, version=version, requested_by=by
        )

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
        """Who did what, newest first: an ``AuditPage`` of ``AuditEntry`` (docs/operations.md,
        "Who did what"). ``target``: a run id or a workflow id (every run of it)."""
        return self.client.audit(
            target, actor=actor, action=action, since=since, limit=limit, cursor=cursor
        )

    def schedule(
        self,
        name: str,
        workflow: str,
        *,
        cron: str | None = None,
        every: float | None = None,
        timezone: str = "UTC",
        input: Any = None,
        overlap: str = "skip",
        catchup_window: float = DEFAULT_CATCHUP_WINDOW_S,
        by: str | None = None,
    ) -> ScheduleView:
        """Start ``workflow`` on a cron expression (in ``timezone``) or ``every`` N seconds,
        fired by the coordinator's sweeper: one run per fire time, whose workflow id is
        ``<name>@<fire time ISO 8601 UTC>``. ``overlap`` says what a fire time does while the
        previous run is open: ``"skip"`` it, ``"buffer_one"`` (start once that run ends), or
        ``"allow"``. Fire times missed by more than ``catchup_window`` seconds (coordinators
        down) are not fired. Defining a schedule again with the same name replaces it."""
        return self.schedules.schedule(
            name,
            workflow=workflow,
            cron=cron,
            every=every,
            timezone=timezone,
            input=input,
            overlap=overlap,
            catchup_window=catchup_window,
            by=by,
        )

    def unschedule(self, name: str, by: str | None = None) -> None:
        self.schedules.unschedule(name, by=by)

    def pause_schedule(self, name: str) -> None:
        self.schedules.pause(name)

    def resume_schedule(self, name: str) -> None:
        self.schedules.resume(name)

    def trigger_schedule(self, name: str) -> RunHandle:
        """Start a run of the schedule now, even while it is paused."""
        return self.schedules.trigger(name)

    def list_schedules(self) -> list[ScheduleView]:
        return self.schedules.list()

    # -- retention ------------------------------------------------------------------------------

    def prune(
        self,
        older_than: timedelta,
        statuses: list[str] | None = None,
        dry_run: bool = False,
        by: str | None = None,
    ) -> int:
        """Delete finished runs (with their attempts, transitions, signals and controls) that
        finished more than ``older_than`` ago, in short batches; never a child of a parent
        that stays. ``statuses``: only these finished statuses. ``dry_run``: only count.
        Returns how many runs were (or would be) deleted."""
        return retention.prune(self.client, older_than, statuses=statuses, dry_run=dry_run, by=by)

    def local_workers(self, concurrency: int = 4) -> Any:
        """Run a coordinator and step consumers as threads in this process (a context manager)."""
        from .runtime.local import local_workers

        return local_workers(self._runtime, concurrency=concurrency)

    def migrate(self) -> None:
        """Create or upgrade the ``eec_`` schema in the configured database."""
        migrate.upgrade(self.settings.database_url)

    @property
    def runtime(self) -> Runtime:
        return self._runtime
