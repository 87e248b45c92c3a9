"""Functional collectives over a process group's name: the form both eager autograd and torch.compile run.

The graph ops of tensor parallelism (graph_ops/tp.py) call these inside their autograd functions, so
an eager step and a step compiled by torch.compile issue the same ``torch.ops._c10d_functional``
collectives (every one followed by its ``wait_tensor``; inductor may move the wait later). They are
out of place, take plain arguments (a group name, its size) that dynamo treats as constants, and
count themselves (calls, bytes, seconds blocked) in the CommCounter registered for the group, except
while dynamo traces them: compiled graphs are counted from their recorded collectives instead
(runtime/compiled.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from autoshard.distributed.comm import CommCounter
from autoshard.ir.placements import Shard

__all__ = ["all_gather", "all_reduce", "gather_along", "register_counter", "scatter_along"]

_ops = torch.ops._c10d_functional
_COUNTERS: weakref.WeakValueDictionary[str, CommCounter] = weakref.WeakValueDictionary()


def register_counter(group_name: str, comm: CommCounter) -> None:
    """Count the collectives issued on ``group_name`` in ``comm``."""
    _COUNTERS[group_name] = comm


def _issue(group_name: str, op: str, nbytes: int, collective: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Run ``collective`` (issue and wait); eagerly, count it and the time it blocks, and mark it in a profile."""
    if torch.compiler.is_compiling():
        return collective()
    counter = _COUNTERS.get(group_name)
    if counter is None:
        return collective()
    counter.count(op, nbytes)
    with counter.timing(op):
        return collective()


def all_reduce(x: torch.Tensor, group_name: str, op: str = "sum", name: str = "tp_all_reduce") -> torch.Tensor:
    """The reduction of ``x`` over the group (a new tensor)."""
    return _issue(
        group_name, name, 2 * x.numel() * x.element_size(),
        lambda: _ops.wait_tensor(_ops.all_reduce(x.contiguous(), op, group_name)),
    )  # fmt: skip


def all_gather(x: torch.Tensor, size: int, group_name: str) -> torch.Tensor:
    """Every rank's ``x`` concatenated along dimension 0, in rank order."""
    return _issue(
        group_name, "tp_all_gather", size * x.numel() * x.element_size(),
        lambda: _ops.wait_tensor(_ops.all_gather_into_tensor(x.contiguous(), size, group_name)),
    )  # fmt: skip


def gather_along(x: torch.Tensor, placement: Shard, size: int, group_name: str) -> torch.Tensor:
    """Shard -> whole: every rank's ``placement`` slice joined (the inverse of ``placement.local``)."""
    gathered = all_gather(x, size, group_name)
    return placement.join(list(gathered.chunk(size)))


def scatter_along(x: torch.Tensor, placement: Shard, size: int, group_name: str, rank: int) -> torch.Tensor:
    """Partial -> Shard: the sum over the group of each rank's ``placement`` slice, this rank's kept."""
    pieces = [placement.local(x, r, size).contiguous() for r in range(size)]
    stacked = torch.cat([p.reshape(-1) for p in pieces])
    mine = _issue(
        group_name, "tp_reduce_scatter", x.numel() * x.element_size(),
        lambda: _ops.wait_tensor(_ops.reduce_scatter_tensor(stacked, "sum", size, group_name)),
    )  # fmt: skip
    return mine.view(pieces[rank].shape)
