"""The tensor-parallel rewrite: local sizes, vocab-parallel ops, and explicit collectives at placement changes.

Reads:  autoshard.tp, autoshard.shape, autoshard.layer
Writes: autoshard.tp_comm (meta.TpCollective) on every collective it inserts; updates autoshard.shape
        to local sizes on sharded values (parameters included, so gradient buckets size the shards);
        autoshard.layer, autoshard.tp and autoshard.ir.cost (no FLOPs) on the nodes it inserts

After tp_placement has chosen every value's placement, this pass makes the graph compute each
rank's share. The graph stays the same on every rank: collectives and rank-dependent ops read the
rank's ``TensorParallel`` module (get_attr ``tp``). Where an op reads an input in another placement
than it was made in, a redistribution goes between (one per value and placement, shared by every
reader):

    Partial -> Replicate   tp.all_reduce     (Megatron's g; backward: identity)
    Shard   -> Replicate   tp.all_gather     (backward: slice)
    Replicate -> Shard     tp.scatter        (a local slice; backward: all-gather)
    Partial -> Shard       tp.reduce_scatter (backward: all-gather)

A replicated value that requires grad and feeds an op whose result is sharded or partial (the input
of a column-parallel linear) gets each rank's gradient only partially: it is read through
``tp.copy`` (Megatron's f: identity forward, all-reduce backward), one per value, so q, k and v
projections of one input share a single backward all-reduce.

Random ops (dropout) on sharded values draw from each rank's own stream (``tp.sharded_random``);
on replicated values they draw from the shared stream, which the Program keeps equal across the
group, so the mask is the same on every rank.

Op rewrites: literal sizes in view/reshape/expand/split arguments become local sizes; an embedding
with rows sharded becomes ``tp.vocab_parallel_embedding``; cross_entropy_loss over class-sharded
logits becomes ``tp.vocab_parallel_cross_entropy``; a row-parallel linear with a bias adds the bias
after its all-reduce.
"""

from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
from torch import fx

from autoshard.graph_ops import tp as tp_ops
from autoshard.ir.meta import (
    BIAS_AFTER_REDUCE,
    BIAS_SPLIT,
    COST,
    LAYER,
    NO_COST,
    SHAPE,
    TP,
    TP_COMM,
    NodeShape,
    TensorShape,
    TpCollective,
    TpPlacement,
    get_shape,
    get_tp,
)
from autoshard.ir.ops import RANDOM, SHARD_PRESERVING, attention_dropout
from autoshard.ir.placements import Partial, Placement, Replicate, Shard
from autoshard.sharding.matmul import matmul_dims

from .infra import Need, Pass, PassResult, all_nodes, calls_to

__all__ = ["PASS", "RUNTIME_ATTR", "collectives_by_layer", "run"]

RUNTIME_ATTR = "tp"
aten = torch.ops.aten
R = Replicate()


def _local_tensor(shape: TensorShape | None, placement: Placement, degree: int) -> TensorShape | None:
    if shape is None or not isinstance(placement, Shard):
        return shape
    sizes = list(shape.sizes)
    sizes[placement.dim] = sympy.simplify(sizes[placement.dim] / degree)
    return TensorShape(tuple(sizes), shape.dtype, shape.requires_grad)


def _local_shape(shape: NodeShape, placement: Placement | tuple[Placement, ...], degree: int) -> NodeShape:
    if shape.scalar is not None:
        return shape
    placements = placement if isinstance(placement, tuple) else (placement,) * len(shape.tensors)
    return NodeShape(tensors=tuple(_local_tensor(t, p, degree) for t, p in zip(shape.tensors, placements)))


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, degree: int, sequence_parallel: bool) -> None:
        self.gm = gm
        self.graph = gm.graph
        self.degree = degree
        self.sequence_parallel = sequence_parallel
        self.partial_grad_params: set[str] = set()
        self.cache: dict[tuple[fx.Node, Any], fx.Node] = {}
        first = next(iter(self.graph.nodes))
        with self.graph.inserting_before(first):
            self.tp = self.graph.get_attr(RUNTIME_ATTR)
        self.tp.meta[SHAPE] = NodeShape()
        self.tp.meta[LAYER] = "(top)"
        self.tp.meta[TP] = TpPlacement(out=R, inputs=())

    def placement(self, node: fx.Node) -> Any:
        return get_tp(node).out

    def _insert(
        self, after: fx.Node, fn: Any, args: tuple, out: Placement, comm: TpCollective | None, shape: NodeShape
    ) -> fx.Node:
        with self.graph.inserting_after(after):
            node = self.graph.call_function(fn, (self.tp, *args))
        node.meta[SHAPE] = shape
        node.meta[LAYER] = comm.layer if comm is not None else after.meta.get(LAYER, "(top)")
        node.meta[TP] = TpPlacement(out=out, inputs=(R, self.placement(after)))
        if comm is not None and (comm.forward or comm.backward):
            node.meta[TP_COMM] = comm
        return node

    def redistribute(self, source: fx.Node, src: Placement, dst: Placement, consumer: fx.Node) -> fx.Node:
        key = (source, dst)
        if key in self.cache:
            return self.cache[key]
        full = get_shape(source)  # local sizes: a partial value has the full tensor's
        slice_bwd = "all_gather" if full.requires_grad else None  # a slice's backward joins the gradient
        here = consumer.meta.get(LAYER, "(top)")
        whole, as_dst = f"{consumer.name} reads it whole", f"{consumer.name} reads it as {dst}"
        # Each step: (op, its extra arguments, placement made, forward and backward collective, layer,
        # why, shape of the result).
        if (
            isinstance(src, Shard)
            and src.blocks == 1
            and dst == R
            and self.sequence_parallel
            and self._partial_grad_readers(source)
        ):
            # Sequence parallel's entry into a column-parallel region: all-gather forward, and backward
            # one reduce-scatter that both sums the ranks' partial gradients and keeps this rank's part.
            steps = [(tp_ops.gather_rs, (src.dim,), R, "all_gather", "reduce_scatter", here, whole,
                      self._full_shape(source, src))]  # fmt: skip
        elif isinstance(src, Shard):  # gather first; then slice if a shard was wanted
            gathered = self._full_shape(source, src)
            steps = [(tp_ops.all_gather, (src.dim, src.blocks), R, "all_gather", None,
                      source.meta.get(LAYER, "(top)"), whole, gathered)]  # fmt: skip
            if dst != R:
                steps.append((tp_ops.scatter, (dst.dim, dst.blocks), dst, None, slice_bwd, here, as_dst,
                              _local_shape(gathered, dst, self.degree)))  # fmt: skip
        elif isinstance(src, Partial) and dst == R:
            steps = [(tp_ops.all_reduce, (), R, "all_reduce", None, self._origin_layer(source), whole, full)]
        elif isinstance(src, Partial):
            steps = [(tp_ops.reduce_scatter, (dst.dim, dst.blocks), dst, "reduce_scatter", "all_gather",
                      self._origin_layer(source), as_dst, _local_shape(full, dst, self.degree))]  # fmt: skip
        else:
            steps = [(tp_ops.scatter, (dst.dim, dst.blocks), dst, None, slice_bwd, here, as_dst,
                      _local_shape(full, dst, self.degree))]  # fmt: skip
        node = source
        for fn, extra, out, forward, backward, layer, why, shape in steps:
            node = self._insert(node, fn, (node, *extra), out, TpCollective(forward, backward, layer, why), shape)
        self.cache[key] = node
        return node

    def _origin_layer(self, source: fx.Node) -> str:
        """The layer whose op made a Partial value (a row-parallel linear, an embedding), past casts and sums."""
        node = source
        for _ in range(64):
            partial = [a for a in node.all_input_nodes if isinstance(self.placement(a), Partial)]
            if not partial:
                break
            node = partial[-1]
        return node.meta.get(LAYER, "(top)")

    def _partial_grad_readers(self, source: fx.Node) -> bool:
        """Whether everything reading ``source`` whole (through views) makes a sharded or partial result."""
        readers = [
            u
            for u in source.users
            if u.op == "call_function" and dict(zip(u.all_input_nodes, get_tp(u).inputs)).get(source) == R
        ]
        return bool(readers) and all(self._partial_grad_reader(u) for u in readers)

    def _partial_grad_reader(self, node: fx.Node, depth: int = 0) -> bool:
        out = get_tp(node).out
        if node.op != "call_function" or depth > 16:
            return False
        if any(not isinstance(p, Replicate) for p in (out if isinstance(out, tuple) else (out,))):
            return True
        return (
            node.target in SHARD_PRESERVING
            and bool(node.users)
            and all(self._partial_grad_reader(u, depth + 1) for u in node.users)
        )

    def _reduced_in_backward(self, source: fx.Node) -> bool:
        """Whether ``source`` is a sequence-parallel all-gather (or a view of one), whose backward sums already."""
        for _ in range(16):
            if source.target is tp_ops.gather_rs:
                return True
            if source.op != "call_function" or source.target not in SHARD_PRESERVING:
                return False
            source = source.args[0]
        return False

    def _full_shape(self, source: fx.Node, placement: Shard) -> NodeShape:
        local = get_shape(source).tensor
        sizes = list(local.sizes)
        sizes[placement.dim] = sympy.simplify(sizes[placement.dim] * self.degree)
        return NodeShape(tensors=(TensorShape(tuple(sizes), local.dtype, local.requires_grad),))

    def copy(self, source: fx.Node, consumer: fx.Node) -> fx.Node:
        key = (source, "copy")
        if key not in self.cache:
            self.cache[key] = self._insert(
                source, tp_ops.copy, (source,), R,
                TpCollective(None, "all_reduce", consumer.meta.get(LAYER, "(top)"),
                             f"{consumer.name} makes its gradient partial"),
                get_shape(source),
            )  # fmt: skip
        return self.cache[key]

    def rewrite_inputs(self, node: fx.Node) -> None:
        record = get_tp(node)
        wanted = dict(zip(node.all_input_nodes, record.inputs))
        for source, dst in wanted.items():
            src = self.placement(source)
            if isinstance(src, tuple) or src == dst:
                continue
            node.replace_input_with(source, self.redistribute(source, src, dst, node))
        out = record.out
        sharded_out = any(not isinstance(p, Replicate) for p in (out if isinstance(out, tuple) else (out,)))
        if not sharded_out:
            return
        for source in list(node.all_input_nodes):
            if source is self.tp or TP_COMM in source.meta or self._reduced_in_backward(source):
                continue
            shape = get_shape(source)
            if shape.scalar is None and shape.requires_grad and self.placement(source) == R:
                if source.op == "get_attr":  # a replicated weight: its gradients are summed after backward
                    self.partial_grad_params.add(source.target)
                else:
                    node.replace_input_with(source, self.copy(source, node))

    def rewrite_op(self, node: fx.Node) -> None:
        record = get_tp(node)
        out, target = record.out, node.target
        degree = self.degree
        if target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default):
            if isinstance(out, Shard):
                sizes = list(node.args[1])
                size = sizes[out.dim]
                if isinstance(size, int) and size != -1:
                    sizes[out.dim] = size // degree
                elif isinstance(size, fx.Node):  # a size of the whole (the sequence length): this rank's part
                    with self.graph.inserting_before(node):
                        sizes[out.dim] = self.graph.call_function(operator.floordiv, (size, degree))
                    sizes[out.dim].meta.update({SHAPE: NodeShape(scalar=get_shape(size).scalar / degree)})
                    sizes[out.dim].meta[LAYER] = node.meta.get(LAYER, "(top)")
                    sizes[out.dim].meta[TP] = TpPlacement(out=R, inputs=(R,))
                node.args = (node.args[0], sizes, *node.args[2:])
        elif target in (aten.split.Tensor, aten.split_with_sizes.default):
            source_placement = record.inputs[0]
            nd = len(get_shape(node.args[0]).tensor.sizes)
            dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % nd
            if isinstance(source_placement, Shard) and source_placement.dim == dim:
                sizes = node.args[1]
                sizes = [s // degree for s in sizes] if isinstance(sizes, (list, tuple)) else sizes // degree
                node.args = (node.args[0], sizes, *node.args[2:])
        elif target == aten.embedding.default and record.inputs[0] == Shard(0):
            padding = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
            node.target = tp_ops.vocab_parallel_embedding
            node.args, node.kwargs = (self.tp, node.args[0], node.args[1], padding), {}
        elif target == aten.cross_entropy_loss.default and record.inputs[0] == Shard(1):
            reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
            ignore = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
            node.target = tp_ops.vocab_parallel_cross_entropy
            node.args, node.kwargs = (self.tp, node.args[0], node.args[1], reduction, ignore), {}
        elif target == aten.sym_size.int and isinstance(record.inputs[0], Shard):
            self.whole_size(node, record.inputs[0])
        elif target in RANDOM and self._draws_on_shards(node):
            node.target = tp_ops.sharded_random
            node.args = (self.tp, target, *node.args)
        elif matmul_dims(target) and record.bias == BIAS_AFTER_REDUCE:
            self.bias_after_reduce(node)
        elif matmul_dims(target) and record.bias == BIAS_SPLIT:
            index = 0 if target == aten.addmm.default else 2
            bias = node.args[index] if len(node.args) > index else node.kwargs["bias"]
            with self.graph.inserting_before(node):
                share = self.graph.call_function(aten.div.Tensor, (bias, degree))
            share.meta.update({SHAPE: get_shape(bias), LAYER: node.meta.get(LAYER, "(top)")})
            share.meta[TP] = TpPlacement(out=R, inputs=(R,))
            node.replace_input_with(bias, share)
            self.partial_grad_params.add(bias.target)  # each rank's bias gradient is 1/tp of the whole

    def whole_size(self, node: fx.Node, placement: Shard) -> None:
        """A size read off a sharded dimension is the rank's part: times the degree, the whole tensor's
        (what the rule promised and what later view sizes are divided from)."""
        source, dim = node.args[:2]
        if dim % len(get_shape(source).tensor.sizes) != placement.dim:
            return
        with self.graph.inserting_after(node):
            whole = self.graph.call_function(operator.mul, (node, self.degree))
        node.replace_all_uses_with(whole, delete_user_cb=lambda user: user is not whole)
        whole.meta.update({k: v for k, v in node.meta.items() if k != SHAPE})
        whole.meta[SHAPE] = get_shape(node)
        node.meta[SHAPE] = NodeShape(scalar=get_shape(node).scalar / self.degree)
        whole.meta[TP] = TpPlacement(out=R, inputs=(R,))

    def _draws_on_shards(self, node: fx.Node) -> bool:
        if node.target == aten.scaled_dot_product_attention.default:
            p = attention_dropout(node.args, node.kwargs)
            if not p:
                return False
        return isinstance(get_tp(node).out, Shard)

    def bias_after_reduce(self, node: fx.Node) -> None:
        """linear(x, W, b) / addmm(b, x, W), row-parallel: all-reduce the product, then add the bias once."""
        if node.target == aten.addmm.default:
            bias, x, w = node.args[:3]
            product_args: tuple = (x, w)
            product_fn = aten.mm.default
        else:
            x, w, bias = node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs["bias"]
            product_args, product_fn = (x, w), aten.linear.default
        with self.graph.inserting_before(node):
            product = self.graph.call_function(product_fn, product_args)
        product.meta.update({k: v for k, v in node.meta.items() if k != TP})
        product.meta[TP] = TpPlacement(out=Partial(), inputs=(Shard(len(get_shape(x).tensor.sizes) - 1), Shard(0)))
        reduced = self._insert(
            product, tp_ops.all_reduce, (product,), R,
            TpCollective("all_reduce", None, node.meta.get(LAYER, "(top)"), f"{node.name} is row-parallel"),
            get_shape(node),
        )  # fmt: skip
        with self.graph.inserting_after(reduced):
            total = self.graph.call_function(aten.add.Tensor, (reduced, bias))
        total.meta.update(node.meta)
        node.replace_all_uses_with(total)
        self.graph.erase_node(node)

    def run(self) -> None:
        for node in self.graph.nodes:  # local sizes first: the inserted nodes' sizes derive from them
            if node.op in ("call_function", "get_attr") and node is not self.tp:
                node.meta[SHAPE] = _local_shape(get_shape(node), get_tp(node).out, self.degree)
        for node in list(self.graph.nodes):  # a snapshot: the nodes this inserts are not visited
            if node.op == "call_function":
                self.rewrite_inputs(node)
                self.rewrite_op(node)
        output = next(n for n in self.graph.nodes if n.op == "output")
        outs = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
        output.meta[TP] = TpPlacement(
            out=tuple(self.placement(o) if isinstance(o, fx.Node) else R for o in outs), inputs=()
        )


def collectives_by_layer(gm: fx.GraphModule) -> dict[str, dict[str, int]]:
    """The collectives this pass inserted, per layer: ``"<op> fwd"`` / ``"<op> bwd"`` -> how many."""
    out: dict[str, dict[str, int]] = {}
    for node in all_nodes(gm):
        comm = node.meta.get(TP_COMM)
        if comm is None:
            continue
        counts = out.setdefault(comm.layer, {})
        for phase, op in (("fwd", comm.forward), ("bwd", comm.backward)):
            if op:
                counts[f"{op} {phase}"] = counts.get(f"{op} {phase}", 0) + 1
    return out


def run(gm: fx.GraphModule, degree: int, sequence_parallel: bool = False) -> PassResult:
    """Its value: the replicated weights whose gradients are partial on each rank (summed over tp after backward)."""
    gm.add_submodule(RUNTIME_ATTR, tp_ops.UnboundTensorParallel(degree))
    rewriter = _Rewriter(gm, degree, sequence_parallel)
    rewriter.run()
    for node in gm.graph.nodes:  # what the rewrite added costs no FLOPs (a pipeline cut reads every node's cost)
        if node.op != "output" and COST not in node.meta:
            node.meta[COST] = NO_COST
    gm.graph.lint()
    gm.recompile()
    totals: dict[str, int] = {}
    for counts in collectives_by_layer(gm).values():
        for op, n in counts.items():
            totals[op] = totals.get(op, 0) + n
    inserted = sum(1 for node in gm.graph.nodes if TP_COMM in node.meta)
    summary = f"{inserted} collectives inserted: {dict(sorted(totals.items())) or 'none'}"
    if rewriter.partial_grad_params:
        summary += f"; {len(rewriter.partial_grad_params)} replicated weights' gradients summed over tp after backward"
    return PassResult("tp_rewrite", True, summary, value=tuple(sorted(rewriter.partial_grad_params)))


# The collectives that always communicate (a slice communicates only in backward, when it needs a gradient).
_COMMUNICATING = calls_to(
    "tp collective nodes", tp_ops.all_reduce, tp_ops.copy, tp_ops.all_gather, tp_ops.reduce_scatter, tp_ops.gather_rs
)
PASS = Pass(
    "tp_rewrite",
    reads=(Need(TP), Need(SHAPE), Need(LAYER)),
    writes=(Need(TP_COMM, _COMMUNICATING), Need(SHAPE), Need(LAYER), Need(TP), Need(COST)),
    run=run,
)
