"""Sharding rules of ops that reduce or normalise along dimensions, attention among them: fine while the
sharded dimension is not the one reduced (heads for attention, rows for a norm).
"""

from __future__ import annotations

import torch
from torch import fx

from autoshard.ir.placements import Partial, Shard
from autoshard.sharding.rule import Decision, P, R, RuleInput, norm_dim, replicate_all, table

__all__ = ["NAMED_RULES", "RULES"]

aten = torch.ops.aten


def _sdpa(ctx: RuleInput, first: int = 0) -> Decision:
    """scaled_dot_product_attention(q, k, v, mask) on [B, H, S, D]: heads sharded, or batch. ``first``: where q
    is among the arguments (context parallelism's ring attention takes its module first)."""
    q, k, v = ctx.node.args[first : first + 3]
    mask = ctx.arg(first + 3, "attn_mask")
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
    dims = dims if isinstance(dims, (list, tuple)) or dims is None else [dims]
    dims = [norm_dim(d, nd) for d in dims] if dims else list(range(nd))  # none or [] reduce every dimension
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


def _ring_attention(ctx: RuleInput) -> Decision:
    """Ring attention of a rank's tokens: split by heads over tp as SDPA is (each head's ring its own)."""
    return _sdpa(ctx, first=1)


RULES = table(
    (_sdpa, (aten.scaled_dot_product_attention.default,)),
    (_layer_norm, (aten.layer_norm.default,)),
    (_reduce_dims, (aten.mean.dim, aten.sum.dim_IntList, aten.amax.default)),
    (_softmax, (aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)),
)
# Graph ops of autoshard's own passes, by module and name (sharding sits below the graph ops it rules on).
NAMED_RULES = {"autoshard.graph_ops.ring_attention.ring_attention": _ring_attention}
