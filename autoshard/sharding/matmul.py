"""Sharding rules of matrix multiplies: a weight's column shard makes its output sharded (column-parallel),
its row shard a partial sum (row-parallel); two activations multiply batched by heads, or into a partial sum.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from autoshard.ir.meta import BIAS_AFTER_REDUCE, BIAS_SPLIT
from autoshard.ir.placements import Partial, Placement, Shard
from autoshard.sharding.rule import Decision, P, R, RuleInput, replicate_all, table

__all__ = ["NAMED_RULES", "RULES", "matmul_dims"]

aten = torch.ops.aten


def matmul_dims(target: Any) -> tuple[int, int, int] | None:
    """(index of x, index of the weight, weight's output-feature dim) for the matmul-like ops."""
    return {
        aten.linear.default: (0, 1, 0),
        aten.addmm.default: (1, 2, 1),
        aten.mm.default: (0, 1, 1),
    }.get(target)


def _matmul_weight(ctx: RuleInput) -> Decision:
    """linear(x, W[n,k], b), addmm(b, x, W[k,n]), mm(x, W[k,n]): column- or row-parallel by W's shard."""
    xi, wi, n_dim = matmul_dims(ctx.node.target)
    k_dim = 1 - n_dim
    x, w = ctx.node.args[xi], ctx.node.args[wi]
    bias = ctx.node.args[0] if ctx.node.target == aten.addmm.default else ctx.arg(2, "bias")
    px, pw = ctx.p(x), ctx.p(w)
    last = ctx.ndim(x) - 1
    want: dict[fx.Node, Placement] = {}
    if isinstance(px, Partial):
        want[x], px = R, R
    if isinstance(pw, Partial):
        want[w], pw = R, R
    if isinstance(pw, Shard) and pw.dim == n_dim:  # column-parallel
        if px != R:
            want[x] = R
        out = Shard(last, pw.blocks)
        _bias_follows(ctx, bias, out, want)
        return Decision(out, want, "column-parallel")
    if isinstance(pw, Shard) and pw.dim == k_dim and pw.blocks == 1:  # row-parallel
        if px != Shard(last):
            want[x] = Shard(last)
        if isinstance(bias, fx.Node):
            if ctx.p(bias) != R:
                want[bias] = R
            if ctx.sequence_parallel:  # each rank adds bias / tp: the reduce-scatter sums them to the bias
                return Decision(P, want, "row-parallel, bias split over the ranks", BIAS_SPLIT)
            return Decision(R, want, "row-parallel, bias added after the all-reduce", BIAS_AFTER_REDUCE)
        return Decision(P, want, "row-parallel")
    if isinstance(pw, Shard):
        return replicate_all(ctx)
    if isinstance(px, Shard) and px.dim != last:
        _bias_follows(ctx, bias, px, want)
        return Decision(px, want)  # rows (batch or sequence) sharded, the weight whole
    if isinstance(px, Shard):
        want[x] = R
    if isinstance(bias, fx.Node) and ctx.p(bias) != R:
        want[bias] = R
    return Decision(R, want)


def _bias_follows(ctx: RuleInput, bias: Any, out: Shard, want: dict[fx.Node, Placement]) -> None:
    """The bias broadcasts onto the output from the right: sharded like it where it has that dimension
    (addmm's bias may be [n], [1, n] or [m, n]), whole where it has none or only 1."""
    if not isinstance(bias, fx.Node):
        return
    dim = out.dim - (len(ctx.out_sizes()) - ctx.ndim(bias))
    target = R if dim < 0 or ctx.sizes(bias)[dim] == 1 else Shard(dim, out.blocks)
    if ctx.p(bias) != target:
        want[bias] = target


def _bmm(ctx: RuleInput) -> Decision:
    """bmm / matmul of two activations [..., m, k] @ [..., k, n] with equal ranks."""
    a, b = ctx.node.args[:2]
    if ctx.ndim(a) != ctx.ndim(b) or ctx.ndim(a) < 2:
        return replicate_all(ctx)
    nd = ctx.ndim(a)
    pa, pb = ctx.p(a), ctx.p(b)
    if isinstance(pa, Partial) or isinstance(pb, Partial):
        return replicate_all(ctx)
    for px, other, po in ((pa, b, pb), (pb, a, pa)):
        if isinstance(px, Shard) and px.dim < nd - 2:  # batch dims (heads) sharded alike
            # matmul broadcasts a batch dimension of 1: that side stays whole
            target = R if ctx.sizes(other)[px.dim] == 1 else px
            return Decision(px, {} if po == target else {other: target})
    if pa == Shard(nd - 1) and pb == Shard(nd - 2):
        return Decision(P)
    if isinstance(pa, Shard) and pa.dim == nd - 2 and pb == R:
        return Decision(pa)
    if pa == R and pb == Shard(nd - 1):
        return Decision(pb)
    return replicate_all(ctx)


def _grouped_mm(ctx: RuleInput) -> Decision:
    """A mixture of experts' grouped matmul: rows x[r, k] sorted by expert, weights w[E, k, n] stacked by expert,
    offs where each expert's rows end. Every expert's matrix sharded alike: n (column-parallel, each expert's
    output features split) or k (row-parallel, a partial sum); the experts' own dimension is expert
    parallelism's (passes/expert_parallel.py), not tp's."""
    x, w = ctx.node.args[:2]
    if ctx.ndim(x) != 2 or ctx.ndim(w) != 3:
        return replicate_all(ctx)
    px, pw = ctx.p(x), ctx.p(w)
    want: dict[fx.Node, Placement] = {a: R for a in ctx.tensor_inputs()[2:] if ctx.p(a) != R}  # offs, bias
    if isinstance(pw, Shard) and pw.dim == 2:  # column-parallel
        if px != R:
            want[x] = R
        return Decision(Shard(1, pw.blocks), want, "column-parallel experts")
    if pw == Shard(1) and not isinstance(px, Partial) and len(ctx.tensor_inputs()) <= 3:  # row-parallel
        if px != Shard(1):
            want[x] = Shard(1)
        return Decision(P, want, "row-parallel experts")
    return replicate_all(ctx)


RULES = table(
    (_matmul_weight, (aten.linear.default, aten.addmm.default, aten.mm.default)),
    (_bmm, (aten.bmm.default, aten.matmul.default)),
    (_grouped_mm, (aten._grouped_mm.default,)),
)
# Ops of other libraries, by qualified name: transformers' grouped matmul for what _grouped_mm does not take.
NAMED_RULES = {"transformers::grouped_mm_fallback": _grouped_mm}
