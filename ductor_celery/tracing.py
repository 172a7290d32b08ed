"""OpenTelemetry traces of runs (optional extra ``ductor_celery[otel]``; docs/tracing.md).

One trace per run, across processes: ``start()`` opens a short ``ductor.start`` span (a child
of the caller's current span, if any) and keeps its context, as a W3C ``traceparent``, on the
run row. Every tick of the run (``ductor.tick``, wherever it runs) and every attempt
(``ductor.attempt``, in the step worker) is a span whose parent is that context, so they
share its trace id whichever process records them. The attempt's span is the current span
while the step function runs: spans the user opens inside a step are its children.

Off unless the user has configured a tracer provider (``trace.set_tracer_provider``); then
every function here returns at its first lines and costs nothing measurable. Without the
``opentelemetry-api`` package installed, the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .engine.status import AttemptOutcome

try:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # pragma: no cover - the extra is not installed
    trace = None  # type: ignore[assignment]

_PROPAGATOR: Any = None if trace is None else TraceContextTextMapPropagator()
_NOOP_PROVIDERS: tuple[type, ...] = (
    () if trace is None else (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
)


def _tracer() -> Any:
    """The tracer, or None when no tracer provider is configured."""
    if trace is None:
        return None
    provider = trace.get_tracer_provider()
    if isinstance(provider, _NOOP_PROVIDERS):
        return None
    return provider.get_tracer("ductor_celery")


def _run_tracer(traceparent: str | None) -> Any:
    """The tracer for a tick or attempt of a run, or None: a run started without tracing has
    no traceparent, and then no provider is looked up (every tick and attempt asks)."""
    return None if traceparent is None else _tracer()


def _parent(traceparent: str | None) -> Any:
    return _PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else None


def start_run(run_id: str, workflow: str) -> str | None:
    """Record the ``ductor.start`` span of a new run; its ``traceparent`` for the run row."""
    tracer = _tracer()
    if tracer is None:
        return None
    attributes = {"ductor.run_id": run_id, "ductor.workflow": workflow}
    carrier: dict[str, str] = {}
    with tracer.start_as_current_span(
        f"ductor.start {workflow}", kind=trace.SpanKind.PRODUCER, attributes=attributes
    ):
        _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent")


def record_tick(
    traceparent: str | None, run_id: str, workflow: str, outcome: str, start_ns: int
) -> None:
    """A tick that computed (committed or no-op), as a span from ``start_ns`` to now."""
    tracer = _run_tracer(traceparent)
    if tracer is None:
        return
    span = tracer.start_span(
        f"ductor.tick {workflow}",
        context=_parent(traceparent),
        start_time=start_ns,
        attributes={"ductor.run_id": run_id, "ductor.workflow": workflow, "ductor.tick": outcome},
    )
    span.end()


@contextmanager
def attempt_span(
    traceparent: str | None, run_id: str, workflow: str, node: str, attempt: int, step: str
) -> Iterator[Any]:
    """The attempt's span, current while the step runs; yields it (None when tracing is off)
    so the caller can mark a failed outcome."""
    tracer = _run_tracer(traceparent)
    if tracer is None:
        yield None
        return
    attributes = {
        "ductor.run_id": run_id,
        "ductor.workflow": workflow,
        "ductor.node": node,
        "ductor.attempt": attempt,
        "ductor.step": step,
    }
    with tracer.start_as_current_span(
        f"ductor.attempt {step}",
        context=_parent(traceparent),
        kind=trace.SpanKind.CONSUMER,
        attributes=attributes,
        record_exception=False,  # a step's failure is its outcome, marked by the caller
        set_status_on_exception=False,
    ) as span:
        yield span


def mark_outcome(span: Any, outcome: str, error: dict[str, Any] | None) -> None:
    if span is None:
        return
    span.set_attribute("ductor.outcome", outcome)
    if outcome != AttemptOutcome.SUCCEEDED:
        message = None if error is None else f"{error.get('type')}: {error.get('message')}"
        span.set_status(trace.Status(trace.StatusCode.ERROR, message))
