"""Collectives over torch.distributed, counted.

Every collective autoshard issues goes through a CommCounter so that tests and benchmarks can
check communication volume. ``volume`` uses the ZeRO paper's accounting, in bytes of the full
tensor: an all-reduce moves 2x its size (a reduce-scatter plus an all-gather), a reduce-scatter
or an all-gather 1x the full (unsharded) size.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["CommCounter"]

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CommCounter:
    group: dist.ProcessGroup | None = None
    calls: Counter = field(default_factory=Counter)
    volume_bytes: Counter = field(default_factory=Counter)

    def _count(self, op: str, nbytes: int) -> None:
        self.calls[op] += 1
        self.volume_bytes[op] += nbytes

    @property
    def total_volume(self) -> int:
        return sum(self.volume_bytes.values())

    def reset(self) -> None:
        self.calls.clear()
        self.volume_bytes.clear()

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        self._count("all_reduce", 2 * tensor.numel() * tensor.element_size())
        return dist.all_reduce(tensor, group=self.group, async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        """Sum ``inp`` (full) over the group and keep this rank's chunk in ``out``."""
        self._count("reduce_scatter", inp.numel() * inp.element_size())
        return _reduce_scatter(out, inp, group=self.group, async_op=async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        """Concatenate every rank's ``inp`` into ``out`` (full), in rank order."""
        self._count("all_gather", out.numel() * out.element_size())
        return _all_gather(out, inp, group=self.group, async_op=async_op)
