"""ZeRO-3's graph ops: gather a layer's parameters before use, mark each use (the last frees them).

passes/zero3_gather_free inserts ``gather`` before a group's first use and ``mark`` on the output of
every op that uses it; both take the rank's ZeRO-3 runtime (runtime/zero.py's ``Zero3Runtime``, a
get_attr node named ``zero3``; ``UnboundZero3Runtime`` in a graph compiled offline) and call back into
it: the gather's backward adds the group's gradient into a flat buffer, a mark's backward gathers the
group again ahead of the op's backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autoshard.distributed.tracing import span
from autoshard.graph_ops.graph_break import stays_eager

if TYPE_CHECKING:
    from autoshard.runtime.zero import Zero3Runtime

__all__ = ["UnboundZero3Runtime", "gather", "mark"]


class _Gather(torch.autograd.Function):
    """Forward: all-gather a group's parameters. Backward: accumulate (and, armed, reduce-scatter) their gradients."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, runtime: Zero3Runtime, group: int) -> tuple[torch.Tensor, ...]:
        ctx.runtime, ctx.group = runtime, group
        with span(f"zero3_gather.group{group}"):
            runtime.ensure_gathered(group)
        if not runtime.replaying:
            runtime.prefetch(runtime.next_of.get(group))
        return tuple(runtime.layouts[group].views(runtime.fulls[group]))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, None, None]:
        ctx.runtime.add_grads(ctx.group, grads)
        return None, None, None


class _Mark(torch.autograd.Function):
    """Identity on the output of an op that used a group's parameters.

    Forward: frees the gathered group after its last use. Backward: gathers the group again (and
    prefetches the one used before it) before the op's backward needs the parameters.
    """

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, runtime: Zero3Runtime, group: int, free: bool) -> torch.Tensor:
        ctx.runtime, ctx.group = runtime, group
        if free and not runtime.replaying:
            runtime.free(group)
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        ctx.runtime.ensure_gathered(ctx.group)
        ctx.runtime.prefetch(ctx.runtime.prev_of.get(ctx.group))
        return grad, None, None, None


@stays_eager
def gather(runtime: Zero3Runtime, group: int) -> tuple[torch.Tensor, ...]:
    """Graph op: this group's full parameters, gathered from the dp shards."""
    return _Gather.apply(runtime.shards[group], runtime, group)


@stays_eager
def mark(y: torch.Tensor, runtime: Zero3Runtime, group: int, free: bool) -> torch.Tensor:
    """Graph op: ``y`` came from parameters of ``group``; ``free``: that was their last use in forward."""
    return _Mark.apply(y, runtime, group, free)


class UnboundZero3Runtime(nn.Module):
    """Stands in for a rank's Zero3Runtime in graphs compiled offline; a Program replaces it to run."""

    def forward(self) -> None:
        raise RuntimeError("this ZeRO-3 graph was compiled offline; only a Program on a process group runs it")
