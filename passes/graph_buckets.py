"""Data-parallel gradient buckets reduced inside a backward graph (torch.compile, one graph per step).

Reads:  nothing (runs on the backward graph AOTAutograd hands the compiler: its outputs are the
        gradients of the forward graph's inputs, in order, None where an input has none)
Writes: nothing; inserts each bucket's reduction

A bucket (the holder's, laid out by passes/grad_buckets) whose parameters are all inputs of the graph
is reduced in it: just after the last of its gradients is computed, each is flattened, cast to the
reduction dtype and divided by dp, and they are concatenated (one fused copy) and all-reduced; the
wait and the views back into each gradient sit just before the output, so the rest of backward runs
while the bucket is on the wire (DDP's overlap, in the graph). The gradients the graph returns are
views of the reduced bucket, which the parameters take as they are. For the inputs 3 and 4, dp=2:

    mm_3 = aten.mm(permute_4, view_2)                    # the bucket's last gradient
    view_7 = aten.reshape(mm_3, [-1]); view_8 = aten.reshape(sum_1, [-1])
    div = aten.div(view_7, 2); div_1 = aten.div(view_8, 2); cat = aten.cat([div, div_1])
    all_reduce = _c10d_functional.all_reduce(cat, 'sum', '3')
    mm_4 = aten.mm(view_1, permute_5)                    # earlier layers' backward, meanwhile
    ...
    wait_tensor = _c10d_functional.wait_tensor(all_reduce)
    split_with_sizes = aten.split_with_sizes(wait_tensor, [1024, 32]); ... views
    return (mm_5, sum_2, None, view_9, view_10)
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from .infra import Pass, PassResult

__all__ = ["PASS", "GraphBucket", "run"]

aten = torch.ops.aten
_ops = torch.ops._c10d_functional


@dataclass(frozen=True)
class GraphBucket:
    """One bucket: its id, and where its parameters' gradients are in the backward graph's outputs."""

    gid: int
    outputs: tuple[int, ...]  # output positions, in the bucket's layout order
    shapes: tuple[tuple[int, ...], ...]


def _call(graph: fx.Graph, target: Any, *args: Any) -> fx.Node:
    """A new node whose meta 'val' is computed from its inputs' (fake) values, as the compiler expects."""
    node = graph.call_function(target, args)
    values = pytree.tree_map_only(fx.Node, lambda n: n.meta["val"], args)
    node.meta["val"] = target(*values)
    return node


def run(
    gm: fx.GraphModule, buckets: list[GraphBucket], dp: int, group_name: str, dtype: torch.dtype | None
) -> PassResult:
    """``dtype``: the dtype gradients are reduced in (None: their own)."""
    graph = gm.graph
    output = graph.output_node()
    results = list(output.args[0])
    position = {node: i for i, node in enumerate(graph.nodes)}
    for bucket in buckets:
        grads = [results[i] for i in bucket.outputs]
        last = max(grads, key=position.__getitem__)
        own = grads[0].meta["val"].dtype
        with graph.inserting_before(last.next):  # inserting_after would reverse them
            flat = [_call(graph, aten.reshape.default, g, [-1]) for g in grads]
            if dtype is not None and dtype != own:
                flat = [_call(graph, torch.ops.prims.convert_element_type.default, f, dtype) for f in flat]
            flat = [_call(graph, aten.div.Tensor, f, dp) for f in flat]
            cat = _call(graph, aten.cat.default, flat)
            reduced = _call(graph, _ops.all_reduce.default, cat, "sum", group_name)
        with graph.inserting_before(output):
            waited = _call(graph, _ops.wait_tensor.default, reduced)
            if dtype is not None and dtype != own:
                waited = _call(graph, torch.ops.prims.convert_element_type.default, waited, own)
            split = _call(graph, aten.split_with_sizes.default, waited, [math.prod(s) for s in bucket.shapes])
            for j, (index, shape) in enumerate(zip(bucket.outputs, bucket.shapes)):
                piece = _call(graph, operator.getitem, split, j)
                results[index] = _call(graph, aten.view.default, piece, list(shape))
        position = {node: i for i, node in enumerate(graph.nodes)}
    output.args = (tuple(results),)
    graph.lint()
    gm.recompile()
    return PassResult("graph_buckets", bool(buckets), f"{len(buckets)} buckets reduced in the backward graph")


PASS = Pass("graph_buckets", reads=(), writes=(), run=run)
