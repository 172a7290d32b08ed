"""OpenTelemetry: one trace per run across processes (issue 13, docs/tracing.md).

The test process starts a run inside a span of its own (the SDK's in-memory exporter keeps
the client's spans); a coordinator and a prefork step worker export theirs to a file. Every
span of the run must carry the client's trace id; the ticks and attempts must be children of
the run's start span; the span a step opens must be a child of its attempt's span.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tracing_export import as_dict, read_spans

from ductor_celery import RunStatus

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def client_spans() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # set once per process (OTel's own rule)
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


@pytest.mark.parametrize("inline", ["0", "50"], ids=["inline-off", "inline-on"])
def test_a_run_is_one_trace_across_the_client_coordinator_and_step_workers(
    cluster_factory: Any, client_for: Any, tmp_path: Path, client_spans: Any, inline: str
) -> None:
    spans_file = tmp_path / f"spans-{inline}.jsonl"
    cluster = cluster_factory(E2E_TRACE_FILE=str(spans_file), E2E_INLINE=inline)
    cluster.start_coordinator()
    cluster.start_steps(concurrency=2)
    ductor = client_for(cluster)
    client_spans.clear()

    with trace.get_tracer("test").start_as_current_span("http request") as request:
        handle = ductor.start("traced", input={"value": "v1"})
    view = ductor.wait(handle.run_id, timeout=60)
    assert view.status == RunStatus.SUCCEEDED, cluster.logs()
    trace_id = f"{request.get_span_context().trace_id:032x}"

    mine = [as_dict(s) for s in client_spans.get_finished_spans()]
    [start] = [s for s in mine if s["name"] == "ductor.start traced"]
    assert start["trace_id"] == trace_id
    assert start["attributes"] == {"ductor.run_id": handle.run_id, "ductor.workflow": "traced"}

    deadline = time.monotonic() + 10
    while True:  # a tick's span ends just after its commit, which wait() may beat
        theirs = read_spans(str(spans_file))
        ticks = [s for s in theirs if s["name"] == "ductor.tick traced"]
        attempts = {s["attributes"].get("ductor.node"): s for s in theirs if "attempt" in s["name"]}
        if len(ticks) >= 2 and set(attempts) == {"a", "b"} or time.monotonic() > deadline:
            break
        time.sleep(0.1)

    run_spans = [s for s in theirs if s["attributes"].get("ductor.run_id") == handle.run_id]
    assert {s["trace_id"] for s in run_spans} == {trace_id}
    assert len(ticks) >= 2  # at least the start's tick and the one that finished the run
    assert all(s["parent_id"] == start["span_id"] for s in ticks)
    assert set(attempts) == {"a", "b"}
    for span in attempts.values():
        assert span["parent_id"] == start["span_id"]
        assert span["attributes"]["ductor.workflow"] == "traced"
        assert span["attributes"]["ductor.attempt"] == 1
        assert span["attributes"]["ductor.outcome"] == "succeeded"
        assert span["status"] == "UNSET"
    [user] = [s for s in theirs if s["name"] == "user.work"]
    assert user["trace_id"] == trace_id
    assert user["parent_id"] == attempts["a"]["span_id"]
    assert user["attributes"] == {"user.value": "v1"}


def test_without_a_tracer_provider_nothing_is_kept_on_the_run(
    cluster_factory: Any, client_for: Any
) -> None:
    """The workers have no provider: no spans, and tracing costs them nothing."""
    cluster = cluster_factory()
    cluster.start_coordinator()
    cluster.start_steps(concurrency=1)
    ductor = client_for(cluster)
    handle = ductor.start("diamond", input={"x": 1})
    assert ductor.wait(handle.run_id, timeout=60).status == RunStatus.SUCCEEDED
