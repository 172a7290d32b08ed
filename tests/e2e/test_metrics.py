"""Prometheus metrics scraped from real worker processes (issue 13, docs/metrics.md).

A prefork step worker (two pool children) and a coordinator each serve ``/metrics`` on their
own port; after a handful of runs with known outcomes, the counts summed over both must be
exactly what happened: the children's counts reach the parent that serves them.
"""

from __future__ import annotations

import time
import urllib.request
from collections import Counter
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from servers import free_port

from ductor_celery import RunStatus

pytestmark = pytest.mark.e2e

Key = tuple[str, tuple[tuple[str, str], ...]]


def scrape(port: int) -> tuple[str, Counter[Key]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    samples: Counter[Key] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] += sample.value
    return text, samples


def total(samples: Counter[Key], name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def test_a_worker_fleet_counts_runs_attempts_and_ticks_exactly(
    cluster_factory: Any, client_for: Any
) -> None:
    cluster = cluster_factory(E2E_SLOW_TIMEOUT="1")
    coord_port, steps_port = free_port(), free_port()
    cluster.start_coordinator(E2E_METRICS_PORT=str(coord_port))
    cluster.start_steps(concurrency=2, E2E_METRICS_PORT=str(steps_port))
    ductor = client_for(cluster)

    handles = {
        "diamond": ductor.start("diamond", input={"x": 1}),
        "flaky": ductor.start("flaky", input={"fail_times": 2}),
        "fatal": ductor.start("fatal"),
        "slow": ductor.start("slow", input={"seconds": 3}),
    }
    final = {name: ductor.wait(h.run_id, timeout=60).status for name, h in handles.items()}
    assert final == {
        "diamond": RunStatus.SUCCEEDED,
        "flaky": RunStatus.SUCCEEDED,
        "fatal": RunStatus.FAILED,
        "slow": RunStatus.SUCCEEDED,
    }, cluster.logs()

    expected_attempts = {
        ("e2e.add", "succeeded"): 1,  # diamond: start (extra is skipped)
        ("e2e.mul", "succeeded"): 2,  # diamond: left, right
        ("e2e.collect", "succeeded"): 1,  # diamond: join
        ("e2e.flaky", "failed"): 2,
        ("e2e.flaky", "succeeded"): 1,
        ("e2e.fatal", "failed"): 1,
        ("e2e.slow", "timed_out"): 1,  # closed by a tick after 1 s; the worker's late
        ("e2e.slow", "succeeded"): 1,  # outcome is refused and not counted again
    }
    deadline = time.monotonic() + 15
    while True:  # a tick counts just after its commit, which wait() may beat
        texts, merged = [], Counter[Key]()
        for port in (coord_port, steps_port):
            text, samples = scrape(port)
            texts.append(text)
            merged.update(samples)
        got = {
            key: total(merged, "ductor_step_attempts_total", step=key[0], outcome=key[1])
            for key in expected_attempts
        }
        done = got == expected_attempts and all(
            total(merged, "ductor_runs_finished_total", workflow=w) == 1 for w in handles
        )
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.2)

    assert got == expected_attempts
    assert total(merged, "ductor_step_attempts_total") == sum(expected_attempts.values())
    for workflow, status in final.items():
        assert total(merged, "ductor_runs_started_total", workflow=workflow) == 1
        assert total(merged, "ductor_runs_finished_total", workflow=workflow, status=status) == 1
        assert total(merged, "ductor_run_duration_seconds_count", workflow=workflow) == 1
    # Every attempt was claimed by a worker and timed from its dispatch: 10 claims in all.
    assert total(merged, "ductor_step_schedule_to_start_seconds_count") == 10
    assert total(merged, "ductor_step_duration_seconds_count", step="e2e.mul") == 2
    committed = total(merged, "ductor_ticks_total", result="committed")
    assert committed >= len(handles) * 2  # at least a start and an end per run
    assert total(merged, "ductor_tick_duration_seconds_count") >= committed
    # The pool children wrote every outcome but the timed-out one; their parent served them.
    _, steps_only = scrape(steps_port)
    written = sum(
        total(steps_only, "ductor_step_attempts_total", outcome=outcome)
        for outcome in ("succeeded", "failed")
    )
    assert written == sum(expected_attempts.values()) - 1

    # No run id or workflow id in any label: one series per run would grow without bound.
    everything = "\n".join(texts)
    for handle in handles.values():
        assert handle.run_id not in everything
    labels = {name for (_, ls) in merged for name, _ in ls}
    assert not labels & {"run_id", "workflow_id", "run", "token"}


def test_a_port_already_taken_leaves_the_worker_running(
    cluster_factory: Any, client_for: Any
) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cluster = cluster_factory()
        cluster.start_coordinator()
        steps = cluster.start_steps(concurrency=1, E2E_METRICS_PORT=str(port))
        ductor = client_for(cluster)
        handle = ductor.start("diamond", input={"x": 2})
        assert ductor.wait(handle.run_id, timeout=60).status == RunStatus.SUCCEEDED
        assert "cannot listen on 127.0.0.1:" in steps.log_tail(400)
