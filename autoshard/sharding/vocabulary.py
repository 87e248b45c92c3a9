"""Sharding rules of the vocabulary's two ends: an embedding table sharded by rows gives a partial sum
(vocab-parallel); logits sharded by classes feed Megatron's vocab-parallel cross-entropy.
"""

from __future__ import annotations

import torch

from autoshard.ir.placements import Shard
from autoshard.sharding.rule import Decision, P, R, RuleInput, replicate_all, table

__all__ = ["RULES"]

aten = torch.ops.aten


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


RULES = table(
    (_embedding, (aten.embedding.default,)),
    (_cross_entropy, (aten.cross_entropy_loss.default,)),
)
