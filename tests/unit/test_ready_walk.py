"""``start_ready_nodes`` walks the nodes again only when a status moved since its last walk
(engine/schedule.py): a chain's tick walks them once, not once per pass of the settle loop.
That each walk it skips would have found nothing is checked in every tick of the unit tests
(``tests/unit/conftest.py``)."""

from __future__ import annotations

from typing import Any

from support import CFG, NOW, RUN, ok, pure_tick

from ductor_celery.definition import Workflow, WorkflowSpec
from ductor_celery.engine import AttemptResult, RunState, TickInputs, compute_tick, schedule
from ductor_celery.engine import tick as engine_tick


def _chain(length: int) -> WorkflowSpec:
    wf = Workflow("walks")
    for i in range(length):
        wf.step(f"s{i}", "walks.step", after=[f"s{i - 1}"] if i else [])
    return wf.build()


def _inputs(*results: AttemptResult) -> TickInputs:
    return TickInputs(run_id=RUN, results=results, config=CFG)


def test_a_chain_tick_checks_each_waiting_node_s_dependency_once(monkeypatch: Any) -> None:
    spec = _chain(10)
    state = pure_tick(spec, RunState.initial([f"s{i}" for i in range(10)]), _inputs(), NOW).state
    for i in range(3):  # s0, s1, s2 succeed, a tick each
        state = pure_tick(spec, state, _inputs(ok(f"{RUN}:s{i}:1", i)), NOW).state
    checked: list[str] = []
    real = schedule._dependency_done

    def counting(t: Any, dep: str) -> bool:
        checked.append(dep)
        return real(t, dep)

    monkeypatch.setattr(schedule, "_dependency_done", counting)
    # The walks themselves, without conftest's check (which makes every walk on a copy too).
    monkeypatch.setattr(engine_tick, "start_ready_nodes", schedule.start_ready_nodes)
    payload = compute_tick(spec, state, _inputs(ok(f"{RUN}:s3:1", 3)), NOW)

    assert [a.node for a in payload.new_attempts] == ["s4"]
    # One walk: s4 (ready: started) and s5..s9 (each waiting on the node before it). The
    # settle loop's second pass, after s4 started, would check s5..s9 again.
    assert checked == ["s3", "s4", "s5", "s6", "s7", "s8"]
