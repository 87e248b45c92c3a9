"""A part of the model cut out of the analysed graph, and what the profile reads off it: the work of each
node (FLOPs, bytes, a matmul's dimensions), the collectives the tp rewrite put there, the parameters a
rank holds, and what a recompute choice repeats in backward."""

from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
from torch import fx

from autoshard import passes
from autoshard.graph_ops import tp as tp_ops
from autoshard.ir.meta import COST, RECOMPUTE, TP, TP_COMM, evaluate_expr, get_cost, get_layer, get_shape, get_tp
from autoshard.ir.ops import ALIASING, packet
from autoshard.ir.placements import Partial
from autoshard.planner.kernels import kernel_name
from autoshard.planner.part_times import Comm, Work

__all__ = ["comms", "extract", "held_for_w", "local_params", "recomputed", "works"]

aten = torch.ops.aten
_NO_WORK = {"placeholder", "get_attr", "output"}


def extract(gm: fx.GraphModule, nodes: list[fx.Node]) -> fx.GraphModule:
    """``nodes`` (in graph order) as a graph of their own: values read from elsewhere become placeholders
    (their meta kept), parameters read from elsewhere (a tied head) are read here too, values read
    elsewhere become outputs."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inside = set(nodes)
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg in inside or arg in env:
                continue
            if arg.op == "get_attr":
                env[arg] = graph.node_copy(arg)
            else:
                env[arg] = graph.placeholder(arg.name)
                env[arg].meta = dict(arg.meta)
        env[node] = graph.node_copy(node, env.__getitem__)
    outputs = [env[n] for n in nodes if n.op != "get_attr" and any(u not in inside for u in n.users)]
    graph.output(tuple(outputs))
    # The part reads meta stand-ins of the model's tensors: it is only analysed, and a profile kept for
    # later compiles must not keep the model's memory alive.
    attrs = {n.target: on_meta(operator.attrgetter(n.target)(gm)) for n in graph.nodes if n.op == "get_attr"}
    return fx.GraphModule(attrs, graph)


def on_meta(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    meta = torch.empty_like(value, device="meta")
    if isinstance(value, torch.nn.Parameter):
        return torch.nn.Parameter(meta, requires_grad=value.requires_grad)
    return meta


def works(gm: fx.GraphModule) -> tuple[Work, ...]:
    out = []
    for node in gm.graph.nodes:
        if node.op in _NO_WORK or node.target is operator.getitem:
            continue
        shape = get_shape(node)
        cost = get_cost(node) if COST in node.meta else None
        op = packet(node.target) if isinstance(node.target, torch._ops.OpOverload) else None
        kernel = op is not None and op not in ALIASING
        reads = [get_shape(a).nbytes for a in node.all_input_nodes]
        nbytes = sympy.Add(shape.nbytes, *reads) if kernel else sympy.Integer(0)
        dims = matmul_dims(node) if cost is not None and cost.flops_fwd != 0 else ()
        grad = any(t is not None and t.requires_grad for t in shape.tensors)
        flops_fwd = cost.flops_fwd if cost is not None else sympy.Integer(0)
        flops_bwd = cost.flops_bwd if cost is not None else sympy.Integer(0)
        weight = passes.weight_grad_split.deferred_weight(gm, node) if dims else None
        name = kernel_name(node) if kernel and not dims else ""
        out.append(Work(node.name, flops_fwd, flops_bwd, dims, nbytes, grad, kernel or bool(dims), weight, name))
    return tuple(out)


def matmul_dims(node: fx.Node) -> tuple[sympy.Expr, ...]:
    """(m, n, k) of a matmul-class node from its operands' local shapes (attention: query, key length, head)."""
    shapes = [get_shape(a).tensors[0] if isinstance(a, fx.Node) and get_shape(a).tensors else None for a in node.args]
    out = get_shape(node).tensors[0]
    op = packet(node.target)
    if op in (aten.linear,) and shapes[1] is not None:
        k, n = shapes[1].sizes[-1], shapes[1].sizes[0]
        return (sympy.expand(out.numel / n), n, k)
    if op in (aten.addmm, aten.baddbmm) and shapes[1] is not None:
        k, n = shapes[1].sizes[-1], out.sizes[-1]
        return (sympy.expand(out.numel / n), n, k)
    if op in (aten.mm, aten.bmm, aten.matmul) and shapes[0] is not None:
        k, n = shapes[0].sizes[-1], out.sizes[-1]
        return (sympy.expand(out.numel / n), n, k)
    if shapes and shapes[0] is not None and len(shapes[0].sizes) >= 2:  # attention: [..., L, E]
        q = shapes[0]
        return (q.sizes[-2], shapes[1].sizes[-2] if shapes[1] is not None else q.sizes[-2], q.sizes[-1])
    return ()


def local_params(
    gm: fx.GraphModule, owned: frozenset[str], owners: dict[str, str]
) -> tuple[int, int, int, int, tuple[tuple[str, str, int, int], ...]]:
    """Bytes and elements of the parameters this part owns (a tied one counts in the part that first reads it),
    the most one gather brings, the layers they belong to (ZeRO-3's groups, as passes/zero_groups forms them),
    and the tied ones it reads (``owners``: their owning parts)."""
    total = elements = 0
    tied = []
    seen = set()
    layers = set()
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target in seen or (node.target not in owned and node.target not in owners):
            continue
        seen.add(node.target)
        shape = get_shape(node)
        if not shape.tensors or not shape.tensors[0].requires_grad:
            continue
        t = shape.tensors[0]
        n, nbytes = int(evaluate_expr(t.numel, {})), int(evaluate_expr(t.nbytes, {}))
        if node.target in owned:
            total, elements = total + nbytes, elements + n
            layers.add(get_layer(node))
        else:
            tied.append((str(node.target), owners[node.target], nbytes, n))
    return total, elements, total, len(layers), tuple(tied)


def comms(gm: fx.GraphModule, hands_on: bool) -> tuple[Comm, ...]:
    """Every collective a microbatch of the part issues over tp: those the rewrite inserted, those of the ops it
    put in (a vocab-parallel loss), and where it ``hands_on`` a partial sum (an embedding's), the all-reduce that
    the next part's first reader makes of it (a part is profiled reading its inputs replicated). A sequence
    shard handed on needs none here: the next part's collectives for a replicated input stand in for sequence
    parallel's gather at its entry."""
    out = []
    for node in gm.graph.nodes:
        if TP_COMM in node.meta:
            c = node.meta[TP_COMM]
            source = next((a for a in node.all_input_nodes if a.op != "get_attr"), node)
            out.append(Comm(c.forward, c.backward, get_shape(source).nbytes, get_shape(node).nbytes))
        elif node.target is tp_ops.vocab_parallel_cross_entropy:
            logits = get_shape(node.args[1]).tensors[0]
            rows = logits.numel / logits.sizes[1]  # every value but the classes (dim 1): what the row max keeps
            for values in tp_ops.CROSS_ENTROPY_ALL_REDUCES:
                nbytes = rows * values * logits.dtype.itemsize
                out.append(Comm("all_reduce", None, nbytes, nbytes))
        elif node.op == "output" and TP in node.meta and hands_on:
            for handed, placement in zip(node.args[0], get_tp(node).out):
                nbytes = get_shape(handed).nbytes if isinstance(handed, fx.Node) else 0
                if isinstance(placement, Partial):
                    out.append(Comm("all_reduce", None, nbytes, nbytes))
    return tuple(out)


def recomputed(gm: fx.GraphModule) -> frozenset[str]:
    names = set()
    for node in gm.graph.nodes:
        if RECOMPUTE in node.meta and node.meta[RECOMPUTE].remade:  # a matmul's input made again: its producer
            names.add(node.meta[RECOMPUTE].remade)
        elif RECOMPUTE in node.meta:
            sub = getattr(gm, node.args[0].target)
            names |= {n.name for n in sub.graph.nodes if n.op == "call_function"}
    return frozenset(names)


def held_for_w(g: fx.GraphModule, in_b: frozenset[str] = frozenset()) -> tuple[sympy.Expr, sympy.Expr]:
    """Bytes a microbatch holds from its B to its W where backward is split, and the share of them that is
    forward's own saved tensors: each deferred matmul's input (each value once; the matmul saved it for
    backward) and its output's gradient (as large as the output, made in B). ``in_b``: weights whose gradient
    stays in B (a tied weight whose owner runs on the same rank), whose matmuls hold nothing for W."""
    inputs: dict[fx.Node, sympy.Expr] = {}
    grads: list[sympy.Expr] = []
    for node in g.graph.nodes:
        x = passes.weight_grad_split.deferred_input(g, node) if node.op == "call_function" else None
        if x is not None and passes.weight_grad_split.deferred_weight(g, node) not in in_b:
            inputs.setdefault(x, get_shape(x).nbytes)
            grads.append(get_shape(node).nbytes)
    saved = sympy.expand(sympy.Add(*inputs.values()))
    return sympy.expand(saved + sympy.Add(*grads)), saved
