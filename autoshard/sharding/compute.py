"""Sharding rules of the compute ops: matrix multiplies, embedding, attention, norms, reductions, the loss.

Each rule reads the placements its inputs arrive in (see autoshard.sharding.rules) and returns a
Decision; they register themselves in autoshard.sharding.rules.RULES when that module loads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from autoshard.ir.meta import BIAS_AFTER_REDUCE, BIAS_SPLIT
from autoshard.ir.placements import Partial, Placement, Shard
from autoshard.sharding.rules import Decision, P, R, RuleInput, norm_dim, register, replicate_all

__all__ = ["matmul_dims"]

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
        if isinstance(bias, fx.Node) and ctx.p(bias) != Shard(0, pw.blocks):
            want[bias] = Shard(0, pw.blocks)
        return Decision(Shard(last, pw.blocks), want, "column-parallel")
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
        if isinstance(bias, fx.Node) and ctx.p(bias) != R:
            want[bias] = R
        return Decision(px, want)  # rows (batch or sequence) sharded, the weight whole
    if isinstance(px, Shard):
        want[x] = R
    if isinstance(bias, fx.Node) and ctx.p(bias) != R:
        want[bias] = R
    return Decision(R, want)


def _bmm(ctx: RuleInput) -> Decision:
    """bmm / matmul of two activations [..., m, k] @ [..., k, n] with equal ranks."""
    a, b = ctx.node.args[:2]
    if ctx.ndim(a) != ctx.ndim(b) or ctx.ndim(a) < 2:
        return replicate_all(ctx)
    nd = ctx.ndim(a)
    pa, pb = ctx.p(a), ctx.p(b)
    if isinstance(pa, Partial) or isinstance(pb, Partial):
        return replicate_all(ctx)
    if isinstance(pa, Shard) and pa.dim < nd - 2:  # batch dims (heads) sharded alike
        return Decision(pa, {} if pb == pa else {b: pa})
    if isinstance(pb, Shard) and pb.dim < nd - 2:
        return Decision(pb, {a: pb})
    if pa == Shard(nd - 1) and pb == Shard(nd - 2):
        return Decision(P)
    if isinstance(pa, Shard) and pa.dim == nd - 2 and pb == R:
        return Decision(pa)
    if pa == R and pb == Shard(nd - 1):
        return Decision(pb)
    return replicate_all(ctx)


def _embedding(ctx: RuleInput) -> Decision:
    w, ids = ctx.node.args[:2]
    pw, pi = ctx.p(w), ctx.p(ids)
    out_nd = len(ctx.out_sizes())
    if pw == Shard(0):
        return Decision(P, {} if pi == R else {ids: R}, "vocab-parallel")
    if pw == Shard(1):
        return Decision(Shard(out_nd - 1), {} if pi == R else {ids: R})
    if isinstance(pi, Shard):
        return Decision(pi, {} if pw == R else {w: R})
    return replicate_all(ctx)


def _sdpa(ctx: RuleInput) -> Decision:
    """scaled_dot_product_attention(q, k, v, mask) on [B, H, S, D]: heads sharded, or batch."""
    q, k, v = ctx.node.args[:3]
    mask = ctx.arg(3, "attn_mask")
    placements = [ctx.p(t) for t in (q, k, v)]
    if any(isinstance(p, Shard) and p.dim == 1 for p in placements):
        heads = [ctx.sizes(t)[1] for t in (q, k, v)]
        if all(ctx.divisible(h) for h in heads) and ctx.sizes(q)[1] == ctx.sizes(k)[1]:
            want = {t: Shard(1) for t, p in zip((q, k, v), placements) if p != Shard(1)}
            if isinstance(mask, fx.Node):
                per_head = ctx.ndim(mask) == 4 and ctx.sizes(mask)[1] != 1
                target = Shard(1) if per_head else R
                if ctx.p(mask) != target:
                    want[mask] = target
            return Decision(Shard(1), want, "attention sharded by heads")
    return replicate_all(ctx)


def _layer_norm(ctx: RuleInput) -> Decision:
    x, normalized = ctx.node.args[:2]
    p = ctx.p(x)
    params = [a for a in ctx.node.args[2:4] if isinstance(a, fx.Node)]
    if isinstance(p, Shard) and p.dim < ctx.ndim(x) - len(normalized):
        return Decision(p, {a: R for a in params if ctx.p(a) != R})
    return replicate_all(ctx)


def _reduce_dims(ctx: RuleInput) -> Decision:
    """mean.dim / sum.dim_IntList / amax: fine while the sharded dimension is not reduced."""
    x = ctx.node.args[0]
    p = ctx.p(x)
    nd = ctx.ndim(x)
    dims = ctx.arg(1, "dim")
    dims = list(range(nd)) if dims is None else [norm_dim(d, nd) for d in (dims if isinstance(dims, list) else [dims])]
    keepdim = ctx.arg(2, "keepdim", False)
    if isinstance(p, Shard) and p.dim not in dims:
        return Decision(Shard(p.dim if keepdim else p.dim - sum(d < p.dim for d in dims), p.blocks))
    if isinstance(p, Partial) and ctx.node.target in (aten.sum.dim_IntList, aten.mean.dim):
        return Decision(P)
    return replicate_all(ctx) if p != R else Decision(R)


def _softmax(ctx: RuleInput) -> Decision:
    x, dim = ctx.node.args[:2]
    p = ctx.p(x)
    if isinstance(p, Shard) and p.dim != norm_dim(dim, ctx.ndim(x)):
        return Decision(p)
    return replicate_all(ctx)


def _cross_entropy(ctx: RuleInput) -> Decision:
    """cross_entropy_loss(logits [N, C], target [N]): with classes sharded, Megatron's vocab-parallel loss."""
    logits, target = ctx.node.args[:2]
    plain = (
        ctx.arg(2, "weight") is None
        and ctx.arg(5, "label_smoothing", 0.0) == 0.0
        and ctx.arg(3, "reduction", 1) in (0, 1, 2)
        and ctx.ndim(logits) == 2
    )
    if plain and ctx.p(logits) == Shard(1):
        return Decision(R, {} if ctx.p(target) == R else {target: R}, "vocab-parallel cross-entropy")
    return replicate_all(ctx)


def _pad(ctx: RuleInput) -> Decision:
    x, pads = ctx.node.args[:2]
    p = ctx.p(x)
    nd = ctx.ndim(x)
    padded = {nd - 1 - i // 2 for i in range(len(pads))}
    if isinstance(p, Shard) and p.dim not in padded:
        return Decision(p)
    return replicate_all(ctx) if p != R else Decision(R)


register(_matmul_weight, aten.linear.default, aten.addmm.default, aten.mm.default)
register(_bmm, aten.bmm.default, aten.matmul.default)
register(_embedding, aten.embedding.default)
register(_sdpa, aten.scaled_dot_product_attention.default)
register(_layer_norm, aten.layer_norm.default)
register(_reduce_dims, aten.mean.dim, aten.sum.dim_IntList, aten.amax.default)
register(_softmax, aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
register(_cross_entropy, aten.cross_entropy_loss.default)
register(_pad, aten.pad.default, aten.constant_pad_nd.default)
