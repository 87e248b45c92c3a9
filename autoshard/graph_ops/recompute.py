"""Recompute regions at run time: a region's activations are dropped after forward and recomputed in backward.

passes/recompute outlines each region into a submodule called through ``region``; this runs it
under ``torch.utils.checkpoint`` (non-reentrant), which keeps only the region's inputs and replays
its forward ahead of its backward. Random numbers replay exactly: checkpoint restores the global
generators, and the context below restores each tensor-parallel rank's own stream (the one dropout
on sharded values draws from), so every mask in the recomputation equals the first forward's.

``input_recomputed`` is the finer grain (what torch's min-cut partitioner does for pointwise ops): a matmul
whose saved input is a norm's or an activation's output keeps, instead of that input, a recipe to make it
again from the producer's own inputs, which the producer's backward keeps anyway. Only the producer repeats,
just before the matmul's backward reads it; the matmul is not repeated.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import fx
from torch.utils.checkpoint import checkpoint

from autoshard.graph_ops.graph_break import stays_eager
from autoshard.graph_ops.tp import UnboundTensorParallel
from autoshard.ir.ops import WRAPPERS

if TYPE_CHECKING:
    from autoshard.runtime.zero import Zero3Runtime

__all__ = ["callable_name", "input_recomputed", "region"]


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


class _Remade:
    """A value that matmuls no longer keep: what makes it again (the op, its arguments, the value's size and
    stride), shared by the matmuls that read it, so it is made once in backward and held until the last of
    them has read it."""

    __slots__ = ("producer", "args", "kwargs", "layout", "pending", "made")

    def __init__(self, producer: Any, args: Any, kwargs: Any, layout: tuple) -> None:
        self.producer, self.args, self.kwargs, self.layout = producer, args, kwargs, layout
        self.pending, self.made = 0, None

    def take(self, view: tuple) -> torch.Tensor:
        """The view a matmul saved (size, stride, offset in the value's storage), of the value made again."""
        if self.made is None:
            with torch.no_grad():
                again = self.producer(*self.args, **self.kwargs)
            size, stride = self.layout
            if again.stride() != stride or again.storage_offset() != 0:  # laid out as forward's was
                again = torch.empty_strided(size, stride, dtype=again.dtype, device=again.device).copy_(again)
            self.made = again
        out = self.made.as_strided(*view)
        self.pending -= 1
        if self.pending <= 0:
            self.made = None
        return out


@stays_eager  # saved-tensor hooks round one op, outside any graph
def input_recomputed(
    op: Any, value: torch.Tensor, producer: Any, producer_args: tuple, producer_kwargs: dict, *args: Any, **kwargs: Any
) -> Any:
    """Graph op: ``op(*args, **kwargs)`` (a matmul reading ``value``, the output of ``producer(*producer_args,
    **producer_kwargs)``), where what the matmul saves of ``value`` is made again in backward, not kept."""
    op = _resolved(op)
    if not torch.is_grad_enabled() or not isinstance(value, torch.Tensor):
        return op(*args, **kwargs)
    storage = value.untyped_storage()
    if value.storage_offset() != 0 or storage.nbytes() != value.numel() * value.element_size():
        return op(*args, **kwargs)  # a view of something larger: keeping part of it is not ours to undo
    remade = getattr(value, "_autoshard_remade", None)  # the other matmuls that read it share one
    if remade is None:
        remade = _Remade(producer, producer_args, producer_kwargs, (tuple(value.shape), value.stride()))
        value._autoshard_remade = remade
    where = (storage.data_ptr(), value.device, value.dtype)

    def pack(saved: torch.Tensor) -> Any:
        if (saved.untyped_storage().data_ptr(), saved.device, saved.dtype) != where:
            return saved
        remade.pending += 1
        return remade, (tuple(saved.shape), saved.stride(), saved.storage_offset())

    def unpack(packed: Any) -> torch.Tensor:
        return packed[0].take(packed[1]) if isinstance(packed, tuple) else packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return op(*args, **kwargs)


def callable_name(op: Any) -> Any:
    """How the graph names ``op``: an ATen op as itself, a runtime function (a zero-bubble matmul) by its module
    and name, which a graph's code can hold where the function itself cannot be written."""
    return op if isinstance(op, torch._ops.OpOverload) else f"{op.__module__}:{op.__qualname__}"


@functools.cache
def _named(name: str) -> Any:
    module, qualname = name.split(":")
    return getattr(importlib.import_module(module), qualname)


def _resolved(op: Any) -> Any:
    return _named(op) if isinstance(op, str) else op


def _as_op(args: tuple) -> tuple[object, tuple]:
    op, rest = _resolved(args[0]), args[5:]
    unwrap = WRAPPERS.get(op)
    return unwrap(rest) if unwrap is not None else (op, rest)


# The analyses see the matmul it runs (through a zero-bubble matmul: the ATen matmul that runs).
WRAPPERS[input_recomputed] = _as_op
