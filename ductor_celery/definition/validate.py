"""Graph checks: ids, dependencies, cycles, paths. Every message names the node or path."""

from __future__ import annotations

import re

from ..errors import DefinitionError
from ..limits import id_problem, show
from .paths import Path, iter_paths, parse_path, secret_name_problem
from .spec import ChildScatterNodeSpec, ScatterNodeSpec, WorkflowSpec, node_templates

_ID = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")


def short(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut short: a message naming a 10,000-character id stays readable (and
    one naming an int too long to print is still written)."""
    return show(value, limit)


def node_id_problem(node_id: object) -> str | None:
    """Why ``node_id`` cannot be a node id, or ``None``. Ids longer than MAX_ID_LENGTH are
    refused here: the node rows' column holds no more, so such a run could never tick."""
    problem = id_problem(node_id)
    if problem is not None:
        return problem
    assert isinstance(node_id, str)
    if not _ID.match(node_id):
        return "must be letters, digits, '_' and '-', not starting with a digit"
    return None


def check_node_id(node_id: object, wf: str) -> None:
    problem = node_id_problem(node_id)
    if problem is not None:
        raise DefinitionError(f"{wf}: invalid node id {short(node_id)}: it {problem}")


def validate_spec(spec: WorkflowSpec) -> None:
    wf = f"workflow {spec.name!r}"
    if not spec.nodes:
        raise DefinitionError(f"{wf} has no nodes")
    seen: set[str] = set()
    for node in spec.nodes:
        check_node_id(node.id, wf)
        if node.id in seen:
            raise DefinitionError(f"{wf}: duplicate node id {node.id!r}")
        seen.add(node.id)
    for node in spec.nodes:
        for dep in node.after:
            if dep == node.id:
                raise DefinitionError(f"{wf}: node {node.id!r} depends on itself (a cycle)")
            if dep not in seen:
                raise DefinitionError(f"{wf}: node {node.id!r} depends on unknown node {dep!r}")
    _check_acyclic(spec)
    ancestors = _ancestors(spec)
    for node in spec.nodes:
        if node.when is not None and not isinstance(node.when, bool):
            if not node.when.startswith(("$.", "!$.")):
                raise DefinitionError(
                    f"{wf}: node {node.id!r}: when={node.when!r} is not a path "
                    "(write '$.input.flag' or '!$.input.flag')"
                )
            parse_path_at(node.when, f"{wf}: node {node.id!r}")
        _check_secrets_only_in_args(node, f"{wf}: node {node.id!r}")
        for path in _paths_at(node_templates(node), f"{wf}: node {node.id!r}"):
            if path.root == "secret":
                _check_secret_name(path, f"{wf}: node {node.id!r}")
            _check_path(
                spec,
                path,
                f"{wf}: node {node.id!r}",
                ancestors[node.id],
                item_ok=isinstance(node, ScatterNodeSpec | ChildScatterNodeSpec)
                and path.text != node.over,
            )
    for path in _paths_at(spec.output, f"{wf}: output"):
        if path.root == "secret":
            raise DefinitionError(f"{wf}: output: {_SECRET_ONLY_IN_ARGS.format(path.text)}")
        _check_path(spec, path, f"{wf}: output", None)


_SECRET_ONLY_IN_ARGS = (
    "secret reference {!r} is allowed only in a step's args (a secret is resolved in the "
    "step worker, never where it could be stored)"
)


def _check_secrets_only_in_args(node: object, where: str) -> None:
    """A secret is resolved only in the worker, just before the call: a condition, a lease
    key, a scatter list or a child's input would need it in the tick, and be stored."""
    templates = node_templates(node)  # type: ignore[arg-type]
    args = getattr(node, "args", None)
    for template in templates:
        if template is args:
            continue
        for path in _paths_at(template, where):
            if path.root == "secret":
                raise DefinitionError(f"{where}: {_SECRET_ONLY_IN_ARGS.format(path.text)}")


def _check_secret_name(path: Path, where: str) -> None:
    """Checked here, not when a stored definition is parsed: a run whose definition was
    registered before the rule still ticks (its attempts fail, naming the problem)."""
    problem = secret_name_problem(path.keys[0])
    if problem is not None:
        raise DefinitionError(f"{where}: secret reference {path.text!r}: {problem}")


def parse_path_at(text: str, where: str) -> Path:
    try:
        return parse_path(text)
    except DefinitionError as exc:
        raise DefinitionError(f"{where}: {exc}") from None


def _paths_at(template: object, where: str) -> list[Path]:
    try:
        return iter_paths(template)
    except DefinitionError as exc:
        raise DefinitionError(f"{where}: {exc}") from None


def _check_path(
    spec: WorkflowSpec, path: Path, where: str, upstream: set[str] | None, item_ok: bool = False
) -> None:
    if path.root == "item" and not item_ok:
        raise DefinitionError(f"{where}: path {path.text!r} is only valid inside a scatter")
    if path.node is None:
        return
    if path.node not in spec.graph.nodes:
        raise DefinitionError(f"{where}: path {path.text!r} names unknown node {path.node!r}")
    if upstream is not None and path.node not in upstream:
        raise DefinitionError(
            f"{where}: path {path.text!r} reads node {path.node!r}, which it does not depend on "
            f"(add {path.node!r} to after=)"
        )


def _check_acyclic(spec: WorkflowSpec) -> None:
    order = spec.graph.order
    if len(order) == len(spec.nodes):
        return
    # Walk from any node left out of the order to name one actual cycle.
    remaining = {n.id: n.after for n in spec.nodes if n.id not in set(order)}
    start = next(iter(remaining))
    trail: list[str] = []
    current = start
    while current not in trail:
        trail.append(current)
        current = next(dep for dep in remaining[current] if dep in remaining)
    cycle = trail[trail.index(current) :] + [current]
    raise DefinitionError(
        f"workflow {spec.name!r}: cycle between nodes " + " -> ".join(repr(c) for c in cycle)
    )


def _ancestors(spec: WorkflowSpec) -> dict[str, set[str]]:
    result: dict[str, set[str]] = {}
    for node_id in spec.graph.order:
        node = spec.graph.nodes[node_id]
        acc: set[str] = set()
        for dep in node.after:
            acc.add(dep)
            acc |= result[dep]
        result[node_id] = acc
    return result
