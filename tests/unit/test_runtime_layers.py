"""The step worker's modules stay layered (issue 28): ``runtime/runtime.py`` builds the Celery
tasks and calls down into ``steps``, ``tick_task``, ``inline`` and ``sweeper``; they take the
narrow ``ports.WorkerPort`` and never import ``runtime.py`` back.

import-linter cannot say it (pyproject.toml's contracts see ``runtime`` as one layer, and an
import under ``if TYPE_CHECKING:`` or inside a function is how such a cycle hides), so the
imports are read here with ``ast``: every import, at module level, under ``TYPE_CHECKING`` or
inside a function, counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ductor_celery.runtime

RUNTIME_DIR = Path(ductor_celery.runtime.__file__).resolve().parent
PACKAGE = "ductor_celery"

#: The runtime modules that may import ``runtime.py``: they are handed finished ``Runtime``
#: objects from above it (``replay``: the harness's replay of one attempt), and nothing
#: ``runtime.py`` reaches imports them.
ABOVE_RUNTIME = frozenset({"replay"})

#: The modules the issue names: the step and tick code, which must not know ``Runtime``.
BELOW_RUNTIME = (
    "steps",
    "outcome",
    "tick_task",
    "inline",
    "task_events",
    "sweeper",
    "ports",
    "local",
)


def _modules() -> dict[str, Path]:
    return {p.stem: p for p in RUNTIME_DIR.glob("*.py") if p.stem != "__init__"}


def _imported(path: Path, modules: dict[str, Path]) -> set[str]:
    """The runtime modules ``path`` imports anywhere in its body (short names)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:  # from .x import y / from . import x
                base = node.module or ""
            elif node.level == 0 and (node.module or "").startswith(f"{PACKAGE}.runtime"):
                base = (node.module or "").removeprefix(f"{PACKAGE}.runtime").lstrip(".")
            else:
                continue
            if base:
                found.add(base.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(f"{PACKAGE}.runtime."):
                    found.add(alias.name.split(".")[2])
    return found & modules.keys()


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(path, modules) for name, path in modules.items()}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph[name])
    return seen


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among the runtime modules, as a path that ends where it starts."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name)) is not None:
            return found
    return None


def test_the_reader_sees_the_imports_it_is_meant_to_judge() -> None:
    # Not vacuous: the module-level imports the runtime is built from are seen, and so is one
    # under TYPE_CHECKING (steps.py names WorkerPort only for its annotations).
    graph = _graph()
    assert {"steps", "tick_task", "sweeper", "dispatch"} <= graph["runtime"]
    assert {"tick_task", "inline", "outcome", "ports"} <= graph["steps"]
    assert "ports" in graph["sweeper"]
    assert "runtime" in graph["replay"]


def test_the_reader_counts_imports_hidden_in_functions_and_type_checking(tmp_path: Path) -> None:
    module = tmp_path / "probe.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from .runtime import Runtime\n"
        "def later():\n"
        "    from . import sweeper\n"
        "    from ductor_celery.runtime.inline import InlineChain\n"
        "    import ductor_celery.runtime.steps\n"
    )
    assert _imported(module, _modules()) == {"runtime", "sweeper", "inline", "steps"}


def test_no_import_cycle_among_the_runtime_modules() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "runtime modules import each other in a circle: " + " -> ".join(
        cycle or []
    )


def test_the_finder_of_cycles_finds_one() -> None:
    graph = {"runtime": {"steps"}, "steps": {"inline"}, "inline": {"runtime"}, "ports": set()}
    assert _cycle(graph) == ["inline", "runtime", "steps", "inline"]
    assert _cycle({"runtime": {"steps"}, "steps": set()}) is None


def test_only_modules_above_the_runtime_import_it() -> None:
    graph = _graph()
    importers = {name for name, imported in graph.items() if "runtime" in imported}
    assert importers <= ABOVE_RUNTIME, (
        f"{sorted(importers - ABOVE_RUNTIME)} import runtime.py: take ports.WorkerPort instead"
    )
    for name in BELOW_RUNTIME:
        assert "runtime" not in graph[name], f"runtime/{name}.py imports runtime.py"
    # What runtime.py is built from never reaches back up to a module that imports it.
    assert not (_reachable(graph, "runtime") & (ABOVE_RUNTIME | {"runtime"}))


def test_the_tick_task_is_not_named_like_the_coordinator_package() -> None:
    # ``runtime/coordinator.py`` was confused with ``coordinator/`` (the tick loop itself).
    assert not (RUNTIME_DIR / "coordinator.py").exists()
    assert (RUNTIME_DIR / "tick_task.py").exists()
