"""Recompute regions at run time: a region's activations are dropped after forward and recomputed in backward.

passes/recompute outlines each region into a submodule called through ``region``; this runs it
under ``torch.utils.checkpoint`` (non-reentrant), which keeps only the region's inputs and replays
its forward ahead of its backward. Random numbers replay exactly: checkpoint restores the global
generators, and the context below restores each tensor-parallel rank's own stream (the one dropout
on sharded values draws from), so every mask in the recomputation equals the first forward's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import fx
from torch.utils.checkpoint import checkpoint

from autoshard.graph_ops.graph_break import stays_eager
from autoshard.graph_ops.tp import UnboundTensorParallel

if TYPE_CHECKING:
    from autoshard.runtime.zero import Zero3Runtime

__all__ = ["region"]


def _contexts(tps: list[Any], zero3: Zero3Runtime | None, inputs: tuple[Any, ...]) -> tuple[Any, Any]:
    """(forward, recompute) contexts: remember the rank streams at the region's start, replay from there.
    ZeRO-3: before replaying, gather the groups whose gathered parameters the region reads (freed since
    forward; the first saved tensor backward unpacks, a dropout mask say, may come before their own
    regather), and replay without forward's frees (the gather's backward frees each group)."""
    start: dict[int, dict[str, torch.Tensor]] = {}

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        for tp in tps:
            start[id(tp)] = dict(tp._streams)
        yield

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        after = {id(tp): dict(tp._streams) for tp in tps}
        if zero3 is not None:
            for group in zero3.groups_viewed_by(inputs):
                zero3.ensure_gathered(group)
            zero3.replaying += 1
        for tp in tps:
            tp._streams = dict(start[id(tp)])
        try:
            yield
        finally:
            for tp in tps:
                tp._streams = after[id(tp)]
            if zero3 is not None:
                zero3.replaying -= 1

    return forward(), recompute()


@stays_eager
def region(module: fx.GraphModule, zero3: Zero3Runtime | None, *inputs: Any) -> Any:
    """Graph op: run an outlined region, keeping only its inputs for backward (recomputing the rest).
    ``zero3``: the graph's ZeRO-3 runtime (None without ZeRO-3)."""
    if not torch.is_grad_enabled():
        return module(*inputs)  # a forward-only call keeps nothing anyway
    tps = [a for a in inputs if isinstance(a, UnboundTensorParallel) and hasattr(a, "_streams")]
    return checkpoint(module, *inputs, use_reentrant=False, context_fn=lambda: _contexts(tps, zero3, inputs))
