"""Sharding rules of elementwise ops: broadcasting from the right; a sum of partial values stays partial."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx

from autoshard.ir.placements import Partial, Placement, Shard
from autoshard.sharding.rule import Decision, P, R, RuleInput, replicate_all, table

__all__ = ["RULES"]

aten = torch.ops.aten


def _pointwise(linear: bool) -> Callable[[RuleInput], Decision]:
    """Elementwise ops, broadcasting from the right. ``linear``: a sum of partial values stays partial."""

    def rule(ctx: RuleInput) -> Decision:
        inputs = ctx.tensor_inputs()
        out_nd = len(ctx.out_sizes())
        placements = [ctx.p(a) for a in inputs]
        want: dict[fx.Node, Placement] = {}
        if any(isinstance(p, Partial) for p in placements):
            if linear and _linear_in_partials(ctx, inputs, placements):
                return Decision(P)
            want.update({a: R for a, p in zip(inputs, placements) if isinstance(p, Partial)})
            placements = [R if isinstance(p, Partial) else p for p in placements]
        target = None
        for a, p in zip(inputs, placements):
            if isinstance(p, Shard):
                target = (p.dim + out_nd - ctx.ndim(a), p.blocks)
                break
        if target is None:
            return Decision(R, want)
        dim, blocks = target
        if not ctx.divisible(ctx.out_sizes()[dim], blocks):
            return replicate_all(ctx)
        for a, p in zip(inputs, placements):
            local_dim = dim - (out_nd - ctx.ndim(a))
            if local_dim < 0 or ctx.sizes(a)[local_dim] == 1:
                if isinstance(p, Shard):
                    want[a] = R
                continue  # broadcast along the sharded dimension
            if p != Shard(local_dim, blocks):
                want[a] = Shard(local_dim, blocks)
        return Decision(Shard(dim, blocks), want)

    return rule


def _linear_in_partials(ctx: RuleInput, inputs: list[fx.Node], placements: list[Placement]) -> bool:
    """Whether the op maps partial values to partial values: a sum of partials, or a partial scaled."""
    target = ctx.node.target
    args = ctx.node.args
    tensor_args = [a for a in args if isinstance(a, fx.Node)]
    if target in (aten.add.Tensor, aten.sub.Tensor):
        return len(tensor_args) == len(args) == 2 and all(isinstance(p, Partial) for p in placements)
    if target in (aten.mul.Tensor, aten.div.Tensor):
        return len(tensor_args) == 1 and (target == aten.mul.Tensor or tensor_args[0] is args[0])
    return len(inputs) == 1  # unary: neg, dtype casts, contiguous, clone


def _type_as(ctx: RuleInput) -> Decision:
    """type_as(x, other): a cast of x; ``other`` lends only its dtype, so its placement does not matter."""
    return Decision(ctx.p(ctx.node.args[0]))


RULES = table(
    (_type_as, (aten.type_as.default,)),
    (
        _pointwise(linear=True),
        (
            aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.neg.default,
            aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.contiguous.default,
            aten.clone.default, aten.alias.default,
        ),
    ),
    (
        _pointwise(linear=False),
        (
            aten.gelu.default, aten.silu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default,
            aten.exp.default, aten.log.default, aten.sqrt.default, aten.rsqrt.default, aten.pow.Tensor_Scalar,
            aten.pow.Tensor_Tensor, aten.erf.default, aten.cos.default, aten.sin.default, aten.abs.default,
            aten.dropout.default, aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
            aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.le.Tensor, aten.le.Scalar,
            aten.lt.Tensor, aten.lt.Scalar, aten.ge.Tensor, aten.ge.Scalar, aten.gt.Tensor, aten.gt.Scalar,
            aten.__and__.Tensor, aten.__or__.Tensor, aten.bitwise_not.default, aten.logical_not.default,
            aten.detach.default, aten.maximum.default, aten.minimum.default, aten.clamp.default,
        ),
    ),
)  # fmt: skip
