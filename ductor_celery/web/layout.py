"""Where each node of a workflow's graph is drawn: a layered layout, computed on the server.

Pure (no IO): ranks by longest path from the roots, nodes ordered within a rank by the mean
position of their dependencies (a few barycenter sweeps, which untangle most crossings of the
small DAGs workflows are), then boxes and edge curves in SVG coordinates. A scatter is one
node, however many branches it has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..definition.spec import WorkflowSpec

BOX_W = 250
BOX_H = 58
GAP_X = 36
GAP_Y = 56
MARGIN = 16
#: Barycenter sweeps: each orders every rank by its dependencies' positions in the rank above.
SWEEPS = 4


@dataclass(frozen=True, slots=True)
class GraphNode:
    id: str
    after: tuple[str, ...]
    #: What the node does, the box's second line: a step name, "approval", "scatter of s.x".
    caption: str
    kind: str


@dataclass(frozen=True, slots=True)
class Box:
    node: GraphNode
    x: float
    y: float

    @property
    def cx(self) -> float:
        return self.x + BOX_W / 2


@dataclass(frozen=True, slots=True)
class Edge:
    source: str
    target: str
    #: The SVG path: a cubic curve from the bottom of the source to the top of the target.
    d: str


@dataclass(frozen=True, slots=True)
class Layout:
    width: float
    height: float
    box_w: float
    box_h: float
    boxes: tuple[Box, ...]
    edges: tuple[Edge, ...]


def graph_nodes(spec: WorkflowSpec) -> list[GraphNode]:
    """The spec's nodes in topological order, with the caption each box shows."""
    found = []
    for node_id in spec.graph.order:
        node = spec.graph.nodes[node_id]
        step = getattr(node, "step", None)
        workflow = getattr(node, "workflow", None)
        if node.kind == "scatter":
            caption = f"scatter of {step}"
        elif node.kind == "child_scatter":
            caption = f"scatter of {workflow} runs"
        elif workflow is not None:
            caption = f"{node.kind} {workflow}"
        else:
            caption = step or node.kind
        found.append(
            GraphNode(id=node_id, after=tuple(node.after), caption=caption, kind=node.kind)
        )
    return found


def _ranks(nodes: Sequence[GraphNode]) -> dict[str, int]:
    rank: dict[str, int] = {}
    for node in nodes:  # topological order: every dependency is ranked already
        rank[node.id] = 1 + max((rank[d] for d in node.after if d in rank), default=-1)
    return rank


def _ordered(nodes: Sequence[GraphNode], rank: dict[str, int]) -> list[list[GraphNode]]:
    layers: list[list[GraphNode]] = [[] for _ in range(max(rank.values(), default=-1) + 1)]
    for node in nodes:
        layers[rank[node.id]].append(node)
    position = {n.id: float(i) for layer in layers for i, n in enumerate(layer)}
    for _ in range(SWEEPS):
        for layer in layers[1:]:

            def centre(n: GraphNode) -> float:
                deps = [position[d] for d in n.after if d in position]
                return sum(deps) / len(deps) if deps else position[n.id]

            layer.sort(key=centre)  # stable: ties keep the definition's order
            for i, n in enumerate(layer):
                position[n.id] = float(i)
    return layers


def layout(nodes: Sequence[GraphNode]) -> Layout:
    """Boxes and edges of the graph, top to bottom."""
    rank = _ranks(nodes)
    layers = _ordered(nodes, rank)
    widest = max((len(layer) for layer in layers), default=0)
    width = 2 * MARGIN + widest * BOX_W + max(widest - 1, 0) * GAP_X
    boxes: dict[str, Box] = {}
    for r, layer in enumerate(layers):
        row = len(layer) * BOX_W + max(len(layer) - 1, 0) * GAP_X
        left = (width - row) / 2
        for i, node in enumerate(layer):
            boxes[node.id] = Box(node, left + i * (BOX_W + GAP_X), MARGIN + r * (BOX_H + GAP_Y))
    edges = []
    for node in nodes:
        target = boxes[node.id]
        for dep in node.after:
            source = boxes.get(dep)
            if source is None:
                continue
            x1, y1 = source.cx, source.y + BOX_H
            x2, y2 = target.cx, target.y
            bend = (y2 - y1) / 2
            edges.append(
                Edge(
                    dep,
                    node.id,
                    f"M{x1:.1f},{y1:.1f} C{x1:.1f},{y1 + bend:.1f} "
                    f"{x2:.1f},{y2 - bend:.1f} {x2:.1f},{y2 - 2:.1f}",
                )
            )
    height = 2 * MARGIN + len(layers) * BOX_H + max(len(layers) - 1, 0) * GAP_Y
    return Layout(
        box_w=BOX_W,
        box_h=BOX_H,
        width=max(width, BOX_W + 2 * MARGIN),
        height=max(height, BOX_H + 2 * MARGIN),
        boxes=tuple(boxes[n.id] for n in nodes),
        edges=tuple(edges),
    )
