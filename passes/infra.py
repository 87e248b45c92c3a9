"""What every pass returns, and the checks run between passes."""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

__all__ = ["PassResult", "check_graph"]


@dataclass(frozen=True)
class PassResult:
    """The outcome of one pass: whether it changed the graph, and one line for the log."""

    name: str
    modified: bool
    summary: str

    def __str__(self) -> str:
        return f"{self.name}: {self.summary}{' (graph changed)' if self.modified else ''}"


def check_graph(gm: fx.GraphModule, writes: tuple[str, ...] = ()) -> None:
    """Lint the graph and check that every node (but the output) carries the keys a pass promised."""
    gm.graph.lint()
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        missing = [key for key in writes if key not in node.meta]
        if missing:
            raise AssertionError(f"node {node.format_node()} lacks {missing} after the pass that writes them")
