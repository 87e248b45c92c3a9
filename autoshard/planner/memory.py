"""What one rank of a plan holds at its peak: its stages' parameters, gradients, Adam's state and fp32 masters,
divided as the ZeRO stage divides them, ZeRO-3's gathered layers, the buckets being reduced, and the
activations of every microbatch the schedule holds in flight; the most loaded rank's is the plan's.

The search costs every plan's memory and most do not fit (then it needs nothing else of them), so a plan's
memory is kept to a few operations per rank: the sums over each rank's stages come once per stage layout
(``rank_sums``), and ranks with the same sums (a pipeline's middle ranks) share what they hold besides
activations.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from autoshard.planner.report import Memory
from autoshard.planner.stages import RankSums
from autoshard.spec.plan import Plan, is_mixed_precision

__all__ = ["ADAM_STATES", "itemsize", "rank_memory"]

ADAM_STATES = 2  # exp_avg and exp_avg_sq, fp32, per master element


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def rank_memory(
    plan: Plan, sums: Sequence[RankSums], in_flight: Sequence[Sequence[tuple[int, int, int]]], micro: int
) -> tuple[Memory, float]:
    """The most loaded rank's memory (the first such rank), and its activation bytes per row of the global
    batch. ``sums``: each pipeline rank's stages (``rank_sums``); ``in_flight``: per rank, the counts of
    microbatches it holds (forward's activations, W's factors, one in its B or none) at the moments that can be
    its peak."""
    best: tuple[int, ...] = ()
    most, per_row = -1, 0.0
    # id of a rank's sums -> what they hold and its total, in a layer's backward and where the loss's begins
    held: dict[int, tuple[tuple[int, ...], int, tuple[int, ...], int]] = {}
    for rank, group in enumerate(sums):
        entry = held.get(id(group))
        if entry is None:
            entry = held[id(group)] = _held(plan, group)
        fixed, fixed_total, at_loss, at_loss_total = entry
        # Each microbatch in flight on this rank holds one of its stages' activations until its B, then what its
        # W reads until that runs (pp = 1: gradient accumulation runs one microbatch at a time).
        # The microbatch in its B (counted in forward's) adds only the gradients its W will read: the inputs W
        # reads are forward's saved tensors already counted.
        counts = in_flight[rank] if plan.pp > 1 else ((1, 0, 0),)
        in_b = group.held_for_w - group.w_inputs
        kept = max(f * group.kept + w * group.held_for_w + b * in_b for f, w, b in counts)
        kept /= group.count
        # Beside what is kept, the peak holds either a layer's backward (a region recomputing, ZeRO-3's
        # gathered layers and their gradients) or the gradients one op makes at once, the loss's as a rule,
        # where backward begins with everything kept and nothing gathered yet; whichever is more.
        if group.gradients_in_flight > group.transient + fixed_total - at_loss_total:
            activations, fixed, fixed_total = kept + group.gradients_in_flight, at_loss, at_loss_total
        else:
            activations = kept + group.transient
        total = fixed_total + int(activations)
        if total > most:
            best, most = (*fixed[:4], int(activations), *fixed[4:]), total
            per_row = activations / max(1, micro * plan.dp * plan.microbatches)
    return Memory(*best), per_row


def _held(plan: Plan, group: RankSums) -> tuple[tuple[int, ...], int, tuple[int, ...], int]:
    """A rank's bytes besides activations (Memory's fields in order, activations left out), and their sum,
    while a layer's backward runs; then the same where backward begins (ZeRO-3: nothing gathered, no layer's
    gradients yet)."""
    params, elements = group.params, group.elements
    weights, grads = params, params
    # ZeRO shards dense parameters over dp, this rank's experts over the dp / ep ranks holding them.
    replicas = plan.dp * plan.cp
    sharded = (elements + (plan.ep - 1) * group.expert_elements) / replicas
    sharded_bytes = (params + (plan.ep - 1) * group.expert_params) / replicas
    masters = elements * 4 if is_mixed_precision(plan.param_dtype) else 0
    optimizer = ADAM_STATES * elements * 4
    largest = group.largest
    if plan.zero >= 1:
        optimizer = ADAM_STATES * sharded * 4
        masters = sharded * 4 if masters else 0
    # What the runtime holds at the end of backward (autoshard/runtime/holders.py, zero.py): ZeRO-2
    # allocates the full gradient buffers for the backward and keeps only its shard after; ZeRO-3
    # reduce-scatters each group as its backward ends, unless microbatches accumulate into it.
    gathered = layer_grads = 0
    if plan.zero >= 3:
        weights = sharded_bytes
        gathered = 2 * largest  # a layer and the prefetched next one
        layer_grads = 2 * largest if plan.microbatches == 1 else 0
        grads = sharded_bytes + (grads if plan.microbatches > 1 else layer_grads)
    if plan.offload:
        optimizer, masters = 0, 0
    buffers = 0  # gradients are views of their buckets; a reduce_dtype copies one bucket at a time
    if replicas > 1 and plan.reduce_dtype is not None:
        buffers = min(int(plan.bucket_bytes), elements * itemsize(plan.reduce_dtype))
    fixed = tuple(int(x) for x in (weights, grads, optimizer, masters, gathered, buffers))
    at_loss = tuple(int(x) for x in (weights, grads - layer_grads, optimizer, masters, 0, buffers))
    return fixed, sum(fixed), at_loss, sum(at_loss)
