"""Collectives issued as early, and waited for as late, as the graph allows (the graphs torch.compile compiles).

Reads:  nothing (runs on the forward and backward graphs AOTAutograd hands the compiler, which carry
        no autoshard keys)
Writes: nothing; moves nodes

A functional collective (``torch.ops._c10d_functional.*``) starts communication and returns at once;
its ``wait_tensor`` blocks until the result is there. Each collective moves up to just after the last
node it reads (and after the collective before it, so every rank issues them in one order), and each
wait moves down to just before the first node that reads its result: whatever lies between runs
while the collective is in flight. Before and after, in a backward graph (``mm_2`` computes a weight's
gradient, which the reduction of ``mm_1`` does not need):

    mm_1 = aten.mm(grad, w1)                       mm_1 = aten.mm(grad, w1)
    mm_2 = aten.mm(x_t, grad)                      all_reduce = all_reduce(mm_1, 'sum', '5')
    all_reduce = all_reduce(mm_1, 'sum', '5')      mm_2 = aten.mm(x_t, grad)
    wait_tensor = wait_tensor(all_reduce)          wait_tensor = wait_tensor(all_reduce)
    add = aten.add(wait_tensor, residual)          add = aten.add(wait_tensor, residual)
"""

from __future__ import annotations

import torch
from torch import fx

from .infra import Pass, PassResult

__all__ = ["COLLECTIVES", "PASS", "WAIT", "run"]

_ops = torch.ops._c10d_functional
COLLECTIVES = frozenset(
    getattr(_ops, name).default
    for name in (
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
        "all_to_all_single",
    )
)
WAIT = _ops.wait_tensor.default


def _positions(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(graph.nodes)}


def run(gm: fx.GraphModule) -> PassResult:
    graph = gm.graph
    moved = 0
    previous: fx.Node | None = None  # the last collective placed: collectives keep their order
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in COLLECTIVES]:
        position = _positions(graph)
        anchors = [*node.all_input_nodes, *([previous] if previous is not None else [])]
        anchor = max(anchors, key=position.__getitem__, default=None)
        if anchor is not None and anchor.next is not node:
            anchor.append(node)
            moved += 1
        previous = node
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is WAIT]:
        if not node.users:
            continue
        position = _positions(graph)
        first = min(node.users, key=position.__getitem__)
        if node.next is not first:
            first.prepend(node)
            moved += 1
    graph.lint()
    gm.recompile()
    return PassResult("overlap_comm", moved > 0, f"{moved} collectives or waits moved")


PASS = Pass("overlap_comm", reads=(), writes=(), run=run)
