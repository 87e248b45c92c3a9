"""Zero-bubble pipelines: split each stage's backward into B (input gradients) and W (weight gradients);
in any other eager pipeline, B adds the weight gradients into ``.grad`` in place.

Reads:  autoshard.shape (get_attr nodes, and ZeRO-3's gathered views: which are trainable parameters)
Writes: nothing (replaces matmul nodes; the new node keeps the old node's meta)

Before::

    w = get_attr[model.h.0.fc.weight]
    y = aten.linear(x, w, b)

After::

    y = matmul_deferring_weight_grad("linear", x, w, b)

The new op computes what the old one did; in its backward the gradient of ``x`` (and of the bias)
comes at once and that of ``w`` waits for the schedule's W when a pipeline's B collects them
(autoshard/graph_ops/weight_grad.py). A schedule with no W (GPipe, 1F1B, interleaved) collects them too,
run eagerly: its B ends by adding them into ``.grad`` as W does, one fused multiply-add a weight, where
autograd would write each microbatch's product to a fresh tensor and add it (runtime/pipeline.py).
Rewritten: ``linear``, ``addmm`` (without beta or alpha) and ``mm`` whose weight is a trainable parameter
that only such matmuls read in this graph; a parameter read by anything else (an embedding and a tied
output projection in one stage), or by another stage of the same rank, keeps its gradient in B, so that
each parameter's gradient arrives whole in one place. What W leaves out (biases, norms, embeddings) is
small next to the matmuls it takes.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from autoshard.graph_ops import zero
from autoshard.graph_ops.weight_grad import matmul_deferring_weight_grad
from autoshard.ir.meta import SHAPE, get_shape

from .infra import PARAMETERS, Need, Pass, PassResult, is_trainable_parameter

__all__ = ["PASS", "run"]

aten = torch.ops.aten
# op -> (kind, index of x, index of the weight, index of the bias or None)
_MATMULS = {
    aten.linear.default: ("linear", 0, 1, 2),
    aten.addmm.default: ("addmm", 1, 2, 0),
    aten.mm.default: ("mm", 0, 1, None),
}


def _rewritable(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _MATMULS or node.kwargs:
        return False  # addmm's beta / alpha (kwargs) scale what the deferred gradient would not
    _, _, wi, _ = _MATMULS[node.target]
    return len(node.args) > wi and isinstance(node.args[wi], fx.Node)


def deferred_input(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """The input ``x`` of a matmul whose weight gradient W would take (a rewritable matmul of a trainable
    parameter), else None: W keeps it, and the output's gradient, from B until it runs."""
    if not _rewritable(node):
        return None
    _, xi, wi, _ = _MATMULS[node.target]
    x, weight = node.args[xi], node.args[wi]
    return x if is_trainable_parameter(gm, weight) and isinstance(x, fx.Node) else None


def deferred_weight(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """The target of the parameter whose gradient W would take for ``node`` (as ``deferred_input``), else None."""
    if deferred_input(gm, node) is None:
        return None
    return str(node.args[_MATMULS[node.target][2]].target)


def run(gm: fx.GraphModule, keep_in_b: frozenset[int] | set[int] = frozenset()) -> PassResult:
    """``keep_in_b``: ids of parameters whose gradient stays in B (read by another stage of the same rank)."""
    graph = gm.graph

    def only_a_matmul_weight(node: fx.Node) -> bool:
        return all(_rewritable(u) and u.args[_MATMULS[u.target][2]] is node for u in node.users)

    weights = {
        node
        for node in graph.nodes
        if is_trainable_parameter(gm, node)
        and only_a_matmul_weight(node)
        and id(gm.get_parameter(node.target)) not in keep_in_b
    }
    # ZeRO-3: a parameter is a view of its group's gather; W adds its gradient to the group's flat buffer.
    gathered = {
        node: (node.args[0].args[0], node.args[0].args[1], node.args[1])  # (runtime, group, index)
        for node in graph.nodes
        if node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(node.args[0], fx.Node)
        and node.args[0].target is zero.gather
        and get_shape(node).requires_grad
        and only_a_matmul_weight(node)
    }
    rewritten = 0
    for node in list(graph.nodes):
        if not _rewritable(node):
            continue
        kind, xi, wi, bi = _MATMULS[node.target]
        weight = node.args[wi]
        if weight not in weights and weight not in gathered:
            continue
        bias = node.args[bi] if bi is not None and len(node.args) > bi else None
        args = (kind, node.args[xi], weight, bias, gathered.get(weight))
        with graph.inserting_before(node):
            new = graph.call_function(matmul_deferring_weight_grad, args)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        rewritten += 1
    gm.recompile()
    kept = sum(1 for n in graph.nodes if is_trainable_parameter(gm, n)) - len(weights)
    return PassResult(
        "weight_grad_split",
        rewritten > 0,
        f"{rewritten} matmuls defer their weight gradient to W ({len(weights) + len(gathered)} weights; "
        f"{kept} parameters in B)",
        value=rewritten,
    )


PASS = Pass("weight_grad_split", reads=(Need(SHAPE, PARAMETERS),), writes=(), run=run)
