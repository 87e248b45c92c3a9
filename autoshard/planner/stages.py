"""Pipeline stages as the cost model sees them: what one stage costs, which stages a rank runs, what a rank's
stages add up to, and where the blocks are cut so that the costliest stage is cheapest."""

from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = ["RankSums", "Stage", "balanced_starts", "by_rank", "rank_sums"]


@dataclass(frozen=True)
class Stage:
    """One pipeline stage's costs on one rank, per microbatch where it says so."""

    forward: float  # one microbatch
    backward: float  # recomputation included
    recompute: float
    tp_comm: float
    send: float  # its output to the next stage (and the gradient back)
    params: int  # bytes one rank holds of this stage's parameters (tp shards)
    elements: int
    largest: int  # the largest part's parameters (a ZeRO-3 gather)
    groups: int  # ZeRO-3 flat groups (one per layer): a gather in forward and backward, a reduce-scatter each
    kept: float  # activation bytes one microbatch keeps
    transient: float
    partial_grads: int = 0  # bytes of replicated weights' gradients summed over tp once a step
    expert_params: int = 0  # of params: this rank's experts (E / ep of each MoE layer's), data parallel over dp / ep
    expert_elements: int = 0
    ep_comm: float = 0.0  # of forward + backward: expert parallelism's all-to-alls, one microbatch
    cp_comm: float = 0.0  # of forward + backward: context parallelism's ring, what compute does not hide
    gradients_in_flight: float = 0.0  # the most one op's backward holds at once (passes/gradients_in_flight)
    held_for_w: float = 0.0  # what one microbatch holds from its B to its W, where backward is split
    parts: frozenset[str] = frozenset()  # the profile's parts it runs
    # tied parameters it reads whose owner part runs elsewhere, counted in params as a copy: (name, owner part,
    # bytes, elements); no copy where the owner is another stage of the same rank (zbv's first and last)
    tied_copies: tuple[tuple[str, str, int, int], ...] = ()
    weight_grad: float = 0.0  # of backward: what a split backward's W computes, one microbatch
    w_inputs: float = 0.0  # of held_for_w: forward's own saved tensors (its matmuls' inputs)


def by_rank(stages: list[Stage], pp: int, v_placement: bool = False) -> list[list[Stage]]:
    """Each pipeline rank's stages: with virtual stages every pp-th, or placed as a V (zbv: r and 2pp-1-r)."""
    if v_placement:
        return [[stages[r], stages[2 * pp - 1 - r]] for r in range(pp)]
    return [stages[r::pp] for r in range(pp)]


@dataclass(frozen=True)
class RankSums:
    """One pipeline rank's stages added up: what its memory and its data-parallel traffic read."""

    params: int
    elements: int
    expert_params: int
    expert_elements: int
    groups: int
    partial_grads: int
    largest: int  # the most of any of its stages
    kept: float  # its stages' kept bytes, summed in stage order
    transient: float  # the most of any of its stages
    count: int  # how many stages it runs
    gradients_in_flight: float  # the most of any of its stages
    held_for_w: float  # its stages', summed
    w_inputs: float  # the same


def _shared_copies(group: list[Stage]) -> dict[str, tuple[int, int]]:
    """The tied copies a rank's stages count whose owner runs on the same rank: (bytes, elements) by name."""
    parts = frozenset().union(*(s.parts for s in group))
    return {t: (b, n) for s in group for t, owner, b, n in s.tied_copies if owner in parts}


def rank_sums(stages: tuple[Stage, ...], pp: int, v_placement: bool = False) -> tuple[RankSums, ...]:
    """Each pipeline rank's sums (``by_rank``'s groups): the search costs tens of thousands of plans on a few
    thousand stage layouts, so it takes these once per layout rather than once per plan."""
    alike: dict[RankSums, RankSums] = {}  # ranks with equal sums share one object (rank_memory's costs them once)
    return tuple(
        alike.setdefault(sums, sums)
        for group in by_rank(list(stages), pp, v_placement)
        for shared in [_shared_copies(group)]
        for sums in [RankSums(
            sum(s.params for s in group) - sum(b for b, _ in shared.values()),
            sum(s.elements for s in group) - sum(n for _, n in shared.values()), sum(s.expert_params for s in group),
            sum(s.expert_elements for s in group), sum(s.groups for s in group),
            sum(s.partial_grads for s in group), max(s.largest for s in group), sum(s.kept for s in group),
            max(s.transient for s in group), len(group), max(s.gradients_in_flight for s in group),
            sum(s.held_for_w for s in group), sum(s.w_inputs for s in group),
        )]
    )  # fmt: skip


@functools.lru_cache(maxsize=4096)
def balanced_starts(seconds: tuple[float, ...], n: int) -> list[int]:
    """Where each of ``n`` contiguous groups of blocks starts so the costliest group is cheapest."""
    count = len(seconds)
    if n >= count:
        return [min(i, count) for i in range(n)] + [count]
    lo, hi = max(seconds), sum(seconds)
    for _ in range(40):
        cap = (lo + hi) / 2
        groups, acc = 1, 0.0
        for s in seconds:
            if acc + s > cap and acc > 0:
                groups, acc = groups + 1, s
            else:
                acc += s
        lo, hi = (cap, hi) if groups > n else (lo, cap)
    starts, acc = [0], 0.0
    for i, s in enumerate(seconds):
        if acc + s > hi * (1 + 1e-9) and acc > 0 and len(starts) < n:
            starts.append(i)
            acc = s
        else:
            acc += s
    while len(starts) < n:  # fewer groups than asked: split the last ones one block each
        starts.append(starts[-1] + 1)
    starts = sorted(set(min(s, count - (n - i)) for i, s in enumerate(starts)))
    while len(starts) < n:
        starts.append(starts[-1] + 1)
    return [*starts, count]
