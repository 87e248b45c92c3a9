"""Statistics over the global batch: a reduction over the batch inside the model, made global over dp.

passes/batch_statistics.py puts ``over_dp`` after each reduction over the batch whose result only reaches
values without a batch dimension (a mixture of experts' load-balancing loss: the tokens and the router's
probability per expert, summed over the tokens). Forward all-reduces it over the data-parallel group: a sum,
or the mean of the ranks' means. Every rank's loss then reads the global statistic, so the gradient of a
rank's own rows is the sum (the mean) of every rank's gradient of it: backward all-reduces the same way.
With the runtime's mean of the ranks' gradients, that is single-device training's gradient exactly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autoshard.distributed import funcol
from autoshard.errors import DistributedError
from autoshard.graph_ops.graph_break import stays_eager

__all__ = ["BatchStatistics", "over_dp"]


class BatchStatistics(nn.Module):
    """The ``dp_stats`` module of a rank graph: the data-parallel degree and group (its name; None in a graph
    built for inspection, which cannot run it)."""

    def __init__(self, degree: int, group_name: str | None = None) -> None:
        super().__init__()
        self.degree = degree
        self._group_name = group_name

    @property
    def group_name(self) -> str:
        if self._group_name is None:
            raise DistributedError(
                "this data-parallel graph was built for inspection; run it through a Program compiled under a "
                "process group"
            )
        return self._group_name


def _reduce(x: torch.Tensor, group_name: str, mean: bool, degree: int) -> torch.Tensor:
    total = funcol.all_reduce(x, group_name, "sum", "dp_statistics")
    return total / degree if mean else total


class _OverDp(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group_name: str, mean: bool, degree: int) -> torch.Tensor:
        ctx.args = group_name, mean, degree
        return _reduce(x, group_name, mean, degree)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _reduce(grad, *ctx.args), None, None, None


@stays_eager
def over_dp(stats: BatchStatistics, x: torch.Tensor, mean: bool) -> torch.Tensor:
    """``x``, a statistic of this rank's rows, over every dp rank's: their sum, or with ``mean`` their mean."""
    return _OverDp.apply(x, stats.group_name, mean, stats.degree)
