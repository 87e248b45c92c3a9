"""Context parallelism: every value that carries the sequence is computed on this rank's tokens.

Reads:  autoshard.shape, autoshard.layer
Writes: autoshard.cp (meta.CpPlacement) on every node but the output; updates autoshard.shape to local
        sizes on values this rank holds a share of the tokens of; autoshard.layer and autoshard.cost
        (no FLOPs) on the nodes it inserts. Returns a CpReport.

Each cp rank is handed the same rows as the others of its dp rank, every token of them; the graph keeps
this rank's tokens (graph_ops/context.py: two chunks of each sequence, for balanced causal attention) and
the sharding rules (autoshard.sharding, as tensor parallelism uses them) carry the shard through the model
(autoshard/sharding/sequence.py propagates the placements; this pass rewrites the graph to them):

1. Seeds: where a token's computation starts. An embedding reads this rank's tokens of its indices (token
   ids, positions); every rank is handed every token, and what else reads the ids (a label shift, a mask
   built from them) reads them whole. A float input with a sequence dimension is cut where it enters.
2. Every op that works token by token keeps the shard (linears, norms, pointwise ops, views). Where such an
   op meets a value every rank holds whole (positions, their embeddings, rotary tables, masks, labels after
   the model shifted them), that value is cut to this rank's tokens there: positions and masks are computed
   for the whole sequence, so they are right for every token, and label shifting sees the next token.
3. Attention (``scaled_dot_product_attention``) over sharded queries becomes ring attention (its keys and
   values go round the cp ranks; a mask keeps this rank's query rows and every key), or all-to-all attention
   (the sequence traded for heads; the mask whole).
4. A sum or mean over the tokens gives a partial value (each rank its own tokens' part); cross_entropy over
   sharded rows divides the rank's sum by the global count of counted tokens. A partial value that an op
   needs whole is all-reduced over cp; the loss leaves the graph in the runtime's units (graph_ops/context.py:
   ``replica_mean``), so that the mean over dp x cp ranks the runtime takes is the global loss and gradient.
5. Any other op that would need a sharded value whole mixes tokens (a cumsum, a convolution over time, a
   sequence pooled by its first token, attention weights read outside the attention): cp refuses the model
   with the node named, before any rank starts work. Attention written out (q @ k^T -> scale -> + mask ->
   softmax -> dropout -> @ v, as Hugging Face's eager attention) is first folded into one SDPA node
   (passes/eager_attention.py).

Sizes: a view, reshape or expand of a sharded value gets the local size along the shard; a size read from a
sharded value (``sym_size``) is multiplied back to the whole sequence's, so that every size in the graph
still means what it meant on one device.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import sympy
import torch
from torch import fx

from autoshard.errors import InputError, PlanError
from autoshard.graph_ops import context as cp_ops
from autoshard.ir.meta import CP, LAYER, SHAPE, CpPlacement, NodeShape, TensorShape, get_shape
from autoshard.ir.ops import attention_dropout
from autoshard.ir.placements import Partial, Placement, Replicate, Shard
from autoshard.sharding.sequence import SEQUENCE_SUMS, Propagation, is_tensor, sequence_input

from . import eager_attention
from .infra import Need, Pass, PassResult, calls_to, mark_inserted, runtime_attr

__all__ = ["PASS", "RUNTIME_ATTR", "CpReport", "run"]

aten = torch.ops.aten
R, P = Replicate(), Partial()
RUNTIME_ATTR = "cp"
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_SIZED = (*_VIEWS, aten.expand.default)  # ops whose size argument must be local along the shard
_SUMS = SEQUENCE_SUMS  # sums and means over the tokens: partial values (a mean scaled to its part)
_SDPA = aten.scaled_dot_product_attention.default
_CROSS_ENTROPY = aten.cross_entropy_loss.default
_INSERTED = (
    cp_ops.local_tokens, cp_ops.all_reduce, cp_ops.ring_attention, cp_ops.all_to_all_attention, cp_ops.cross_entropy,
    cp_ops.replica_mean,
)  # fmt: skip


@dataclass
class CpReport:
    """What the pass did: the token indices (and float inputs) it cut, the attentions it turned into rings or
    all-to-alls, the other whole values it cut to this rank's tokens, the partial values it all-reduced, how
    the loss leaves."""

    degree: int
    mode: str = "ring"
    inputs: list[str] = field(default_factory=list)
    attention: list[str] = field(default_factory=list)
    sliced: list[str] = field(default_factory=list)
    all_reduced: list[str] = field(default_factory=list)
    loss: str = ""
    folded: list[str] = field(default_factory=list)  # attentions written out, folded into one SDPA node

    def _folded(self) -> str:
        return f" ({len(self.folded)} written out, folded)" if self.folded else ""

    def __str__(self) -> str:
        return (
            f"cp={self.degree}: {', '.join(self.inputs)} cut to each rank's tokens where an embedding reads them "
            f"(or where they enter); "
            f"{len(self.attention)} attention(s) as {self.mode} attention{self._folded()}; "
            f"{len(self.sliced)} whole value(s) cut where they meet the tokens; "
            f"{len(self.all_reduced)} sum(s) over tokens all-reduced; loss {self.loss}"
        )


# ---- the rewrite --------------------------------------------------------------------------------------------


def _local_sizes(shape: TensorShape, dim: int, degree: int) -> TensorShape:
    sizes = list(shape.sizes)
    sizes[dim] = sympy.sympify(sizes[dim]) / degree
    return TensorShape(tuple(sizes), shape.dtype, shape.requires_grad)


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, prop: Propagation, report: CpReport) -> None:
        self.gm, self.graph, self.prop, self.report = gm, gm.graph, prop, report
        self.degree = prop.degree
        self.cp = runtime_attr(gm, RUNTIME_ATTR, cp_ops.UnboundContextParallel(prop.degree))
        self.cache: dict[tuple[fx.Node, object], fx.Node] = {}
        self.seq_len: fx.Node | None = None

    def _insert(self, after: fx.Node | None, before: fx.Node | None, target, args, shape, placement, note, kwargs=None):  # noqa: ANN001, ANN202
        where = self.graph.inserting_after(after) if after is not None else self.graph.inserting_before(before)
        with where:
            node = self.graph.call_function(target, args, kwargs or {})
        layer = (after or before).meta.get(LAYER, "(top)")
        if target is cp_ops.local_tokens:  # this rank's tokens: 1/cp of the value along the split dimension
            shape = NodeShape((_local_sizes(shape.tensor, placement.dim, self.degree),))
        mark_inserted(node, shape, layer)
        node.meta[CP] = CpPlacement(placement, note=note)
        return node

    def run(self) -> None:
        self._seeds()
        for consumer, source, dst in self.prop.wants:
            self._redistribute(consumer, source, dst)
        for node in list(self.graph.nodes):
            if node.op != "call_function" or node.target in _INSERTED:
                continue
            placement = self.prop.out.get(node, R)
            if node.target is _SDPA and isinstance(placement, Shard):
                self._ring(node)
            elif node.target is _CROSS_ENTROPY and placement != R:
                node.target = cp_ops.cross_entropy
                node.args = (self.cp, *node.args)
            elif node.target in _SUMS and placement == P and _SUMS[node.target]:
                self._mean(node)
            elif node.target in _SIZED and isinstance(placement, Shard):
                self._local_size_arg(node, placement.dim)
            elif node.target is aten.sym_size.int:
                self._whole_size(node)
        self._loss()
        for node in self.graph.nodes:
            if node.op == "output" or CP in node.meta:
                continue
            if node in self.prop.seeds:  # handed every token; its local_tokens node holds this rank's
                node.meta[CP] = CpPlacement(R, note="every token, cut to this rank's where it enters")
                continue
            placement = self.prop.out.get(node, R)
            node.meta[CP] = CpPlacement(placement, node in self.prop.merged, self.prop.notes.get(node, ""))
            if isinstance(placement, Shard) and is_tensor(node):
                node.meta[SHAPE] = NodeShape((_local_sizes(get_shape(node).tensor, placement.dim, self.degree),))

    def _seeds(self) -> None:
        if not self.prop.seeds and not self.prop.looked_up:
            raise PlanError(
                "context parallelism found no sequence to split: no embedding reads token ids [batch, sequence] "
                "and no float input has a sequence dimension; pass the sequence as the model's input, or use cp=1"
            )
        whole = sequence_input(self.gm)
        if whole is not None:  # the sequence's length, read off an input every rank is handed whole
            placeholder, dim = whole
            with self.graph.inserting_after(placeholder):
                self.seq_len = self.graph.call_function(aten.sym_size.int, (placeholder, dim))
            mark_inserted(self.seq_len, NodeShape(scalar=get_shape(placeholder).tensor.sizes[dim]), "(top)")
            self.seq_len.meta[CP] = CpPlacement(R, note="the whole sequence's length")
        self.report.inputs += [n.name for n in self.prop.looked_up]
        for placeholder, dim in self.prop.seeds.items():
            users = [u for u in placeholder.users if u.target is not aten.sym_size.int]  # sizes stay whole
            local = self._insert(
                self.seq_len, None, cp_ops.local_tokens, (self.cp, placeholder, dim, self.seq_len),
                get_shape(placeholder), Shard(dim), "this rank's tokens",
            )  # fmt: skip
            for user in users:
                user.replace_input_with(placeholder, local)
            self.report.inputs.append(placeholder.name)

    def _redistribute(self, consumer: fx.Node, source: fx.Node, dst: Placement) -> None:
        key = (source, dst)
        made = self.cache.get(key)
        if made is None:
            if isinstance(dst, Shard):  # a whole value: this rank's tokens of it, before its first reader
                made = self._insert(
                    None, consumer, cp_ops.local_tokens, (self.cp, source, dst.dim, self.seq_len), get_shape(source),
                    dst, f"{consumer.name} reads this rank's tokens",
                )  # fmt: skip
                if source not in self.prop.looked_up:
                    self.report.sliced.append(source.name)
            else:  # a partial value needed whole
                made = self._insert(
                    source, None, cp_ops.all_reduce, (self.cp, source), get_shape(source), R,
                    f"{consumer.name} needs the sum over every token",
                )  # fmt: skip
                self.report.all_reduced.append(source.name)
            self.cache[key] = made
        if isinstance(dst, Shard):
            made.meta[CP] = CpPlacement(dst, consumer in self.prop.merged or any(
                a in self.prop.merged for a in consumer.all_input_nodes
            ), made.meta[CP].note)  # fmt: skip
        consumer.replace_input_with(source, made)

    def _ring(self, node: fx.Node) -> None:
        node.target = cp_ops.ring_attention if self.prop.attention == "ring" else cp_ops.all_to_all_attention
        node.args = (self.cp, *node.args)
        node.kwargs = {**node.kwargs, "seq_len": self.seq_len}
        self.report.attention.append(node.name)

    def _mean(self, node: fx.Node) -> None:
        """A mean over this rank's tokens is cp times its part of the mean over every token."""
        users = list(node.users)
        part = self._insert(node, None, operator.truediv, (node, self.degree), get_shape(node), P, "this rank's part")
        for user in users:
            user.replace_input_with(node, part)
        self.prop.out[part] = P

    def _local_size_arg(self, node: fx.Node, dim: int) -> None:
        sizes = list(node.args[1])
        size = sizes[dim]
        if isinstance(size, int):
            if size != -1:
                sizes[dim] = size // self.degree
        elif isinstance(size, fx.Node):
            share = NodeShape(scalar=get_shape(size).scalar / self.degree)
            local = self._insert(None, node, operator.floordiv, (size, self.degree), share, R, "this rank's share")
            sizes[dim] = local
        node.args = (node.args[0], sizes, *node.args[2:])

    def _whole_size(self, node: fx.Node) -> None:
        x, dim = node.args[:2]
        p = self.prop.out.get(x, R)
        if not isinstance(p, Shard) or dim % len(get_shape(x).tensor.sizes) != p.dim or x in self.prop.seeds:
            return
        users = list(node.users)
        whole = self._insert(node, None, operator.mul, (node, self.degree), get_shape(node), R, "the whole size")
        for user in users:
            user.replace_input_with(node, whole)

    def _loss(self) -> None:
        output = next(n for n in self.graph.nodes if n.op == "output")
        flat = output.args[0]
        values = list(flat) if isinstance(flat, (tuple, list)) else [flat]
        for i, value in enumerate(values):
            made = value.meta[CP].out if isinstance(value, fx.Node) and CP in value.meta else self.prop.out.get(value)
            if made != P:
                continue
            if i == 0:
                values[i] = self._insert(
                    value, None, cp_ops.replica_mean, (self.cp, value), get_shape(value), P,
                    "the loss in the runtime's units: its mean over dp x cp is the global loss",
                )  # fmt: skip
                self.report.loss = "partial over cp: each rank's tokens' share, times cp"
            else:
                values[i] = self._insert(value, None, cp_ops.all_reduce, (self.cp, value), get_shape(value), R, "whole")
        output.args = (type(flat)(values) if isinstance(flat, (tuple, list)) else values[0],)
        if not self.report.loss:
            self.report.loss = "computed whole on every rank"


def _check(gm: fx.GraphModule, degree: int, sizes: dict[str, int], attention: str) -> None:
    """What cp cannot run, said before any rank works: a sequence that does not split into 2 x cp chunks,
    attention with dropout (the ring computes attention in blocks), heads that all-to-all cannot split."""
    seq = sizes.get("S")
    if seq is None:
        raise PlanError(
            f"context parallelism (cp={degree}) splits the sequence, but the model's inputs have no sequence "
            f"dimension (the second dimension of integer token ids, [batch, sequence]); use cp=1"
        )
    if seq % (2 * degree):
        raise InputError(
            f"context parallelism splits each sequence into 2 x cp = {2 * degree} equal chunks (two a rank, for "
            f"balanced causal attention), but the example's sequence has {seq} tokens; use sequences whose length "
            f"is a multiple of {2 * degree}, or another cp"
        )
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is _SDPA:
            dropout = attention_dropout(node.args, node.kwargs)
            heads = [get_shape(t).tensor.sizes[-3] for t in node.args[1:3]] + [get_shape(node.args[0]).tensor.sizes[-3]]
            if attention == "all_to_all" and any(not h.is_Integer or int(h) % degree for h in heads):
                raise PlanError(
                    f"cp_attention='all_to_all' gives each of the cp={degree} ranks heads / cp of the heads, but "
                    f"{node.name} in {node.meta.get(LAYER, '(top)')} has {heads[2]} heads and {heads[0]} K/V heads; "
                    f"use cp_attention='ring', or a cp that divides both"
                )
            if dropout and attention == "ring":
                raise PlanError(
                    f"context parallelism: {node.name} in {node.meta.get(LAYER, '(top)')} is attention with dropout "
                    f"(p={dropout}), which ring attention, computing it in blocks, does not draw as one device "
                    f"does; set the model's attention dropout to 0 (attn_pdrop, attention_dropout, "
                    f"attention_probs_dropout_prob), use cp_attention='all_to_all' (whole-sequence attention per "
                    f"head), or use cp=1"
                )


def run(gm: fx.GraphModule, degree: int, sizes: dict[str, int], attention: str = "ring") -> PassResult:
    folded = eager_attention.fold(gm)  # attention written out: one SDPA node, which cp splits
    _check(gm, degree, sizes, attention)
    prop = Propagation(gm, degree, sizes, attention)
    prop.run()
    report = CpReport(degree, attention.replace("_", "-"), folded=folded)
    _Rewriter(gm, prop, report).run()
    gm.graph.lint()
    gm.recompile()
    return PassResult("context_parallel", True, str(report), value=report)


PASS = Pass(
    "context_parallel",
    reads=(Need(SHAPE), Need(LAYER)),
    writes=(Need(CP), Need(SHAPE), Need(LAYER, calls_to("the context-parallel ops", *_INSERTED))),
    run=run,
)
