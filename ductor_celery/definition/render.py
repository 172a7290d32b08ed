"""Draw a workflow's graph as Mermaid or Graphviz DOT text (pure)."""

from __future__ import annotations

from collections.abc import Mapping

from .spec import WorkflowSpec


def _label(spec: WorkflowSpec, node_id: str, status: str | None) -> list[str]:
    node = spec.graph.nodes[node_id]
    what = getattr(node, "step", None) or node.kind
    if hasattr(node, "workflow"):
        what = f"{node.kind} {node.workflow}"
    elif node.kind == "scatter":
        what = f"scatter {what} over {getattr(node, 'over', '')}"
    parts = [node_id, what]
    if node.when is not None:
        parts.append(f"when {node.when}")
    if status:
        parts.append(status)
    return parts


def to_mermaid(spec: WorkflowSpec, statuses: Mapping[str, str] | None = None) -> str:
    # Mermaid ids cannot hold every character a node id can ('-'), so number them.
    ids = {node_id: f"n{i}" for i, node_id in enumerate(spec.graph.order)}
    lines = ["flowchart TD"]
    for node_id in spec.graph.order:
        label = "<br/>".join(_label(spec, node_id, (statuses or {}).get(node_id)))
        lines.append(f'    {ids[node_id]}["{label.replace(chr(34), "#quot;")}"]')
    for node in spec.nodes:
        for dep in node.after:
            lines.append(f"    {ids[dep]} --> {ids[node.id]}")
    return "\n".join(lines)


def to_dot(spec: WorkflowSpec, statuses: Mapping[str, str] | None = None) -> str:
    lines = [f'digraph "{spec.name}" {{', "    rankdir=TB;", "    node [shape=box];"]
    for node_id in spec.graph.order:
        label = "\\n".join(_label(spec, node_id, (statuses or {}).get(node_id)))
        lines.append(f'    "{node_id}" [label="{label.replace(chr(34), chr(39))}"];')
    for node in spec.nodes:
        for dep in node.after:
            lines.append(f'    "{dep}" -> "{node.id}";')
    lines.append("}")
    return "\n".join(lines)
