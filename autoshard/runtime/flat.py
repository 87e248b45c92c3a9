"""Flat groups: parameters laid out one after another in one buffer, the unit of gradient sync and of ZeRO.

Passes assign each trainable parameter a slot (group, offset, numel): gradient buckets for data
parallelism and ZeRO-1/2, gather groups for ZeRO-3. A FlatLayout is one group on one rank: the
buffer padded to a multiple of dp, so that rank ``i`` owns elements ``[i * n, (i + 1) * n)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["FlatLayout", "layouts_from_slots"]


@dataclass
class FlatLayout:
    """One flat group: its parameters (in offset order), padded to a multiple of dp; this rank's shard."""

    gid: int
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    dp: int
    dp_rank: int
    shapes: list[torch.Size] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.shapes = self.shapes or [p.shape for p in self.params]

    @property
    def padded(self) -> int:
        return math.ceil(self.numel / self.dp) * self.dp

    @property
    def shard_numel(self) -> int:
        return self.padded // self.dp

    @property
    def lo(self) -> int:
        return self.dp_rank * self.shard_numel

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def flatten(self, dtype: torch.dtype | None = None, values: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """The parameters (or ``values[id(param)]`` where given) in one padded flat tensor."""
        flat = torch.zeros(self.padded, dtype=dtype or self.dtype, device=self.device)
        for param, offset in zip(self.params, self.offsets):
            source = values[id(param)] if values is not None and id(param) in values else param.detach()
            flat[offset : offset + source.numel()].copy_(source.reshape(-1))
        return flat

    def own(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a flat (padded) buffer laid out like this group."""
        return flat[self.lo : self.lo + self.shard_numel]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view into a flat buffer laid out like this group."""
        return [flat[o : o + math.prod(s)].view(s) for o, s in zip(self.offsets, self.shapes)]

    def own_ranges(self, select: Callable[[nn.Parameter], bool]) -> list[tuple[int, int]]:
        """Where the selected parameters lie in this rank's shard: (start, end) in shard coordinates."""
        ranges = []
        for param, offset, shape in zip(self.params, self.offsets, self.shapes):
            start, end = max(offset, self.lo), min(offset + math.prod(shape), self.lo + self.shard_numel)
            if start < end and select(param):
                ranges.append((start - self.lo, end - self.lo))
        return ranges


def layouts_from_slots(
    slots: Iterable[tuple[nn.Parameter, int, int, int]], dp: int, dp_rank: int
) -> dict[int, FlatLayout]:
    """Group (param, group id, offset, numel) slots into FlatLayouts by group id (a parameter once)."""
    by_group: dict[int, dict[int, tuple[int, nn.Parameter]]] = {}
    sizes: dict[int, int] = {}
    for param, group, offset, numel in slots:
        by_group.setdefault(group, {})[id(param)] = (offset, param)
        sizes[group] = max(sizes.get(group, 0), offset + numel)
    layouts = {}
    for group in sorted(by_group):
        entries = sorted(by_group[group].values(), key=lambda e: e[0])
        layouts[group] = FlatLayout(group, [p for _, p in entries], [o for o, _ in entries], sizes[group], dp, dp_rank)
    return layouts
