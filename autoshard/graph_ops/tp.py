"""Tensor-parallel collectives as autograd-aware graph ops, and the vocab-parallel embedding and loss.

The TP rewrite (passes/tp_rewrite) inserts calls to the functions below into the graph; each takes
the rank's tensor-parallel module (a get_attr node named ``tp``: an ``UnboundTensorParallel`` in a graph
built for inspection, runtime/tensor_parallel.py's ``TensorParallel`` on a rank) first, so the graph
itself is the same on every rank. The pairs are Megatron's:

    all_reduce      forward all-reduce, backward identity   (g: after a row-parallel linear)
    copy            forward identity,   backward all-reduce (f: before a column-parallel region)
    all_gather      forward all-gather, backward slice      (a sharded value needed whole)
    scatter         forward slice,      backward all-gather (a replicated value needed sharded)
    reduce_scatter  forward reduce-scatter, backward all-gather  (sequence parallel's g)
    gather_rs       forward all-gather, backward reduce-scatter  (sequence parallel's f)

Their collectives are functional (``torch.ops._c10d_functional`` with ``wait_tensor``, distributed/funcol.py),
forward and backward, over the group's name: an eager step and one compiled by torch.compile run the
same collectives, and the autograd functions take only plain values (the group's name, size and this
rank), which dynamo traces. Every collective is counted in the program's CommCounter under ``tp_<op>``.
"""

from __future__ import annotations

from typing import Any

import torch

from autoshard.distributed import funcol
from autoshard.errors import InputError
from autoshard.graph_ops.graph_break import stays_eager
from autoshard.graph_ops.unbound import UnboundGroup
from autoshard.ir.ops import WRAPPERS
from autoshard.ir.placements import Shard

__all__ = [
    "CROSS_ENTROPY_ALL_REDUCES",
    "UnboundTensorParallel",
    "check_divisible",
    "all_gather",
    "all_reduce",
    "copy",
    "gather_rs",
    "reduce_scatter",
    "scatter",
    "sharded_random",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
]


class UnboundTensorParallel(UnboundGroup):
    """The ``tp`` of a graph built for inspection, and what the graph ops read of a rank's: its degree, its
    rank in the group, the group's name; running it needs a Program under a process group."""

    kind = "tensor-parallel"
    sum_ = sum_each_ = max_ = gather = reduce_scatter_ = rank_stream = UnboundGroup._unbound


def check_divisible(tensor: torch.Tensor, placement: Shard, degree: int) -> None:
    size = tensor.shape[placement.dim]
    if size % (placement.blocks * degree):
        raise InputError(
            f"tensor parallelism splits dimension {placement.dim} of a {tuple(tensor.shape)} activation over "
            f"tp={degree}, but {size} does not divide by {placement.blocks * degree}; with sequence_parallel the "
            f"sequence length of every batch must be a multiple of {degree}"
        )


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, name: str) -> torch.Tensor:
        return funcol.all_reduce(x, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, name: str) -> torch.Tensor:
        ctx.name = name
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return funcol.all_reduce(grad, ctx.name), None


def _check(x: torch.Tensor, placement: Shard, size: int) -> None:
    if not torch.compiler.is_compiling():  # sizes are checked when traced, by the shapes themselves
        check_divisible(x, placement, size)


def _gather(x: torch.Tensor, placement: Shard, name: str, size: int, rank: int) -> torch.Tensor:
    return funcol.gather_along(x, placement, size, name)


def _slice(x: torch.Tensor, placement: Shard, name: str, size: int, rank: int) -> torch.Tensor:
    _check(x, placement, size)
    return placement.local(x, rank, size).contiguous()


def _reduce_scatter(x: torch.Tensor, placement: Shard, name: str, size: int, rank: int) -> torch.Tensor:
    _check(x, placement, size)
    return funcol.scatter_along(x, placement, size, name, rank)


_STEPS = {"gather": _gather, "slice": _slice, "reduce_scatter": _reduce_scatter}


class _Redistribute(torch.autograd.Function):
    """A change of placement along ``dim``: one step forward, its adjoint backward (names in _STEPS)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, blocks: int, fwd: str, bwd: str, name: str, size: int, rank: int
    ) -> torch.Tensor:
        ctx.args = (Shard(dim, blocks), name, size, rank)
        ctx.bwd = bwd
        return _STEPS[fwd](x, Shard(dim, blocks), name, size, rank)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _STEPS[ctx.bwd](grad, *ctx.args), None, None, None, None, None, None, None


def _redistribute(
    tp: UnboundTensorParallel, x: torch.Tensor, dim: int, blocks: int, fwd: str, bwd: str
) -> torch.Tensor:
    return _Redistribute.apply(x, dim, blocks, fwd, bwd, tp.group_name, tp.degree, tp.rank)


def all_reduce(tp: UnboundTensorParallel, x: torch.Tensor) -> torch.Tensor:
    """Partial -> Replicate: sum the ranks' partial values (backward: identity)."""
    return _AllReduce.apply(x, tp.group_name)


def copy(tp: UnboundTensorParallel, x: torch.Tensor) -> torch.Tensor:
    """A replicated value entering sharded work: identity (backward: sum the ranks' partial gradients)."""
    return _Copy.apply(x, tp.group_name)


def all_gather(tp: UnboundTensorParallel, x: torch.Tensor, dim: int, blocks: int = 1) -> torch.Tensor:
    """Shard -> Replicate (backward: keep this rank's slice)."""
    return _redistribute(tp, x, dim, blocks, "gather", "slice")


def scatter(tp: UnboundTensorParallel, x: torch.Tensor, dim: int, blocks: int = 1) -> torch.Tensor:
    """Replicate -> Shard: this rank's slice, no communication (backward: all-gather)."""
    return _redistribute(tp, x, dim, blocks, "slice", "gather")


def reduce_scatter(tp: UnboundTensorParallel, x: torch.Tensor, dim: int, blocks: int = 1) -> torch.Tensor:
    """Partial -> Shard (sequence parallel's exit from a row-parallel linear; backward: all-gather)."""
    return _redistribute(tp, x, dim, blocks, "reduce_scatter", "gather")


def gather_rs(tp: UnboundTensorParallel, x: torch.Tensor, dim: int) -> torch.Tensor:
    """Shard -> Replicate before sharded work (sequence parallel's entry; backward: reduce-scatter)."""
    return _redistribute(tp, x, dim, 1, "gather", "reduce_scatter")


@stays_eager
def sharded_random(tp: UnboundTensorParallel, op: Any, *args: Any, **kwargs: Any) -> Any:
    """A random op (dropout) on sharded values: drawn from this rank's own stream, so ranks' masks differ.

    Random ops on replicated values use the shared stream, which the Program keeps equal across the tp
    group, so every rank draws the same mask there.
    """
    tensor = next(a for a in args if isinstance(a, torch.Tensor))
    with tp.rank_stream(tensor.device):
        return op(*args, **kwargs)


WRAPPERS[sharded_random] = lambda args: (args[1], args[2:])


def vocab_parallel_embedding(
    tp: UnboundTensorParallel, weight: torch.Tensor, ids: torch.Tensor, padding_idx: int = -1
) -> torch.Tensor:
    """Lookup in this rank's rows of the table; other ranks' ids give zeros (a Partial result)."""
    rows = weight.shape[0]
    start = tp.rank * rows
    local = ids - start
    outside = (local < 0) | (local >= rows)
    # F.embedding reads a negative padding_idx from the end; None is "no padding row".
    local_padding = padding_idx - start if padding_idx >= 0 and start <= padding_idx < start + rows else None
    out = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight, padding_idx=local_padding)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


# The forward all-reduces of vocab_parallel_cross_entropy, as values per row of its logits (what the planner
# costs): the row max, then the sum of exponentials and the target's logit stacked into one.
CROSS_ENTROPY_ALL_REDUCES = (1, 2)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's cross-entropy over class-sharded logits: two all-reduces of [N] values, never the logits."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, reduction: int, ignore_index: int, name: str, rank: int
    ) -> torch.Tensor:
        classes = logits.shape[1]
        start = rank * classes
        row_max = funcol.all_reduce(logits.amax(dim=1), name, "max")
        shifted = logits - row_max.unsqueeze(1)
        valid = target != ignore_index
        local = target - start
        mine = valid & (local >= 0) & (local < classes)
        index = local.clamp(0, classes - 1).masked_fill(~mine, 0)
        picked = shifted.gather(1, index.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)
        exp = shifted.exp()
        # One all-reduce for the sum of exponentials and the target's logit.
        both = funcol.all_reduce(torch.stack([exp.sum(dim=1), picked]), name)
        sum_exp, picked = both[0], both[1]
        losses = (sum_exp.log() - picked).masked_fill(~valid, 0.0)
        count = valid.sum()
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(1)), index, mine, valid, count)
        ctx.reduction = reduction
        if reduction == 0:
            return losses
        if reduction == 2:
            return losses.sum()
        return losses.sum() / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        softmax, index, mine, valid, count = ctx.saved_tensors
        grad_logits = softmax
        rows = torch.arange(grad_logits.shape[0], device=grad_logits.device)
        grad_logits[rows, index] -= mine.to(grad_logits.dtype)
        grad_logits.mul_(valid.unsqueeze(1).to(grad_logits.dtype))
        if ctx.reduction == 0:
            grad_logits.mul_(grad.unsqueeze(1))
        elif ctx.reduction == 2:
            grad_logits.mul_(grad)
        else:
            grad_logits.mul_(grad / count)
        return grad_logits, None, None, None, None, None


def vocab_parallel_cross_entropy(
    tp: UnboundTensorParallel, logits: torch.Tensor, target: torch.Tensor, reduction: int = 1, ignore_index: int = -100
) -> torch.Tensor:
    """``aten.cross_entropy_loss`` for logits sharded over classes (dim 1); the loss is replicated."""
    return _VocabParallelCrossEntropy.apply(logits, target, reduction, ignore_index, tp.group_name, tp.rank)
