"""Batch statistics over the global batch: reductions over the batch that only reach batch-free values.

Reads:  autoshard.shape, autoshard.layer
Writes: autoshard.shape, autoshard.layer and autoshard.cost (no FLOPs) on the nodes it inserts

Data parallelism averages the ranks' losses and gradients, which is exact for a loss that is a mean over
the rows. A statistic of the batch inside the model is not: a mixture of experts' load-balancing loss
multiplies the share of tokens each expert gets by the router's mean probability for it, both over the
batch, and the mean of the ranks' products is not the product over the global batch. So with dp > 1 each
reduction over the batch (``sum`` or ``mean`` over a dimension that carries the batch symbol ``B``, or a
``histc`` count of such a tensor) whose result, and everything computed from it, has no batch dimension
left, is followed by ``batch_stats.over_dp``: the sum (mean) over every dp rank, forward and backward.
A count the graph divides such a sum by, computed from the batch size (``B * S``), is multiplied by dp.
A reduction whose result comes back to the rows (a mixture of experts' row offsets, a normalisation over
the batch) is left to each rank: its rows are its own.
"""

from __future__ import annotations

import operator

import sympy
import torch
from torch import fx

from autoshard.graph_ops import batch_stats
from autoshard.ir.meta import COST, LAYER, SHAPE, get_shape

from .infra import Need, Pass, PassResult, calls_to, mark_inserted, runtime_attr

__all__ = ["PASS", "RUNTIME_ATTR", "run"]

RUNTIME_ATTR = "dp_stats"
aten = torch.ops.aten
_SUMS = {aten.sum.dim_IntList: False, aten.mean.dim: True, aten.histc.default: False}  # -> a mean


def _batched(expr: sympy.Expr) -> bool:
    return any(s.name == "B" for s in sympy.sympify(expr).free_symbols)


def _carries_batch(node: fx.Node) -> bool:
    shape = node.meta.get(SHAPE)
    if shape is None:
        return False
    if shape.scalar is not None:
        return False  # a size, not rows
    return any(t is not None and any(_batched(s) for s in t.sizes) for t in shape.tensors)


def _batch_free_downstream(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes whose value and every value computed from it have no batch dimension."""
    free: set[fx.Node] = set()
    for node in reversed(gm.graph.nodes):
        if node.op == "output" or (not _carries_batch(node) and all(u in free or u.op == "output" for u in node.users)):
            free.add(node)
    return free


def _reduces_batch(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _SUMS or not isinstance(node.args[0], fx.Node):
        return False
    source = get_shape(node.args[0]).tensors[0]
    if node.target is aten.histc.default:
        return _batched(source.numel)
    dims = node.args[1] if len(node.args) > 1 else ()
    return any(_batched(source.sizes[d]) for d in dims)


def _from_batch_size(node: fx.Node) -> bool:
    """A Python number computed from the batch size (a count of rows: ``B * S``)."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen or not isinstance(n, fx.Node):
            continue
        seen.add(n)
        shape = n.meta.get(SHAPE)
        if shape is not None and shape.scalar is not None and _batched(shape.scalar):
            return True
        python_number = n.op == "call_function" and not isinstance(n.target, torch._ops.OpOverload)
        if python_number or n.target is aten.sym_size.int:
            stack.extend(n.all_input_nodes)
    return False


def run(gm: fx.GraphModule, dp: int) -> PassResult:
    graph = gm.graph
    free = _batch_free_downstream(gm)
    stats = [n for n in graph.nodes if _reduces_batch(n) and n in free]
    if not stats:
        return PassResult("batch_statistics", False, "no statistic of the batch reaches the loss alone")
    runtime = runtime_attr(gm, RUNTIME_ATTR, batch_stats.BatchStatistics(dp))
    made: set[fx.Node] = set()
    for node in stats:
        users = list(node.users)
        with graph.inserting_after(node):
            made_node = graph.call_function(batch_stats.over_dp, (runtime, node, _SUMS[node.target]))
        mark_inserted(made_node, get_shape(node), node.meta.get(LAYER, "(top)"))
        made.add(made_node)
        for user in users:
            user.replace_input_with(node, made_node)
    # What reads the global sums: a division by the local count of rows becomes one by the global count.
    reached = set(made)
    scaled = 0
    for node in graph.nodes:
        if node in reached or not any(a in reached for a in node.all_input_nodes):
            continue
        reached.add(node)
        divisor = node.args[1] if node.target is aten.div.Tensor and len(node.args) > 1 else None
        number = isinstance(divisor, fx.Node) and all(t is None for t in get_shape(divisor).tensors)
        if number and _from_batch_size(divisor):
            with graph.inserting_before(node):
                count = graph.call_function(operator.mul, (divisor, dp))
            mark_inserted(count, get_shape(divisor), divisor.meta.get(LAYER, "(top)"))
            node.replace_input_with(divisor, count)
            scaled += 1
    graph.lint()
    gm.recompile()
    names = ", ".join(n.name for n in stats)
    return PassResult("batch_statistics", True, f"{len(stats)} over dp={dp} ({names}); {scaled} counts of rows scaled")


PASS = Pass(
    "batch_statistics",
    reads=(Need(SHAPE), Need(LAYER)),
    writes=(Need(COST, calls_to("the statistics over dp", batch_stats.over_dp)),),
    run=run,
)
