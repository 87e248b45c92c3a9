"""Dropout masks as single-device training draws them (plan ``dropout_masks="single_device"``).

By default each rank draws its own masks: fast, statistically the same, but not the masks one device
would draw, so training with dropout is not bit-equal to single-device training. With
``dropout_masks="single_device"`` every rank follows the random sequence of one device instead: the
model's dropout ops, in graph order, each draw a mask for the whole global batch from one state that
every rank shares (the default generator's state when ``compile()`` began, taken from rank 0), and each
rank keeps its slice of it: its dp rows, then its microbatch's rows, then its tp or sequence shard.
Ops that run on other pipeline stages are drawn too, only to advance the state, so every rank ends a
step in the same state. The price: every rank draws every mask at global size.

A mask is drawn on the op's first call in a step and kept until the step ends, so later microbatches
slice it and a recomputed region replays it exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autoshard.errors import DistributedError
from autoshard.ir.meta import MaskSpec, evaluate_expr
from autoshard.ir.ops import WRAPPERS

if TYPE_CHECKING:
    from autoshard.spec.mesh import Mesh

__all__ = ["SingleDeviceMasks", "UnboundMasks", "dropout"]


class UnboundMasks(nn.Module):
    """The ``masks`` of a graph built for inspection; running it needs a Program under a process group."""

    def mask(self, index: int, x: torch.Tensor) -> torch.Tensor:
        raise DistributedError(
            "this graph draws single-device dropout masks; run it through a Program compiled under a process group"
        )


class SingleDeviceMasks(nn.Module):
    """This rank's view of the single-device random sequence of one step's dropout masks."""

    def __init__(self, specs: Sequence[MaskSpec], state: torch.Tensor, coords: dict[str, int], mesh: Mesh) -> None:
        super().__init__()
        self.specs = tuple(specs)
        self.state = state  # the shared generator state (CPU ByteTensor, or a CUDA generator's state)
        self.coords, self.dp, self.tp = coords, mesh.dp, mesh.tp
        self.microbatch, self.microbatches = 0, 1
        self._sizes: dict[str, int] = {}
        self._next = 0  # the next op in draw order
        self._kept: dict[int, torch.Tensor] = {}  # this step's masks, this rank's dp rows of them

    def begin(self, local_sizes: dict[str, int], microbatches: int) -> None:
        """A forward pass over the global batch starts; ``local_sizes``: this dp rank's symbol values."""
        self._sizes = {**local_sizes, "B": local_sizes["B"] * self.dp}
        self.microbatch, self.microbatches = 0, microbatches
        self._next, self._kept = 0, {}

    def end(self) -> None:
        """Draw what this rank's stages did not (later stages' ops), so every rank ends in the same state."""
        if self._sizes:
            self._draw_until(len(self.specs), None, torch.float32, None)
        self._kept, self._sizes = {}, {}

    def mask(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if index not in self._kept:
            if index < self._next:
                raise RuntimeError(f"dropout op {index} was drawn past without being kept; draw order broken")
            self._draw_until(index + 1, index, x.dtype, x)
        spec, kept = self.specs[index], self._kept[index]
        if spec.batch_dim is not None and self.microbatches > 1:
            kept = kept.chunk(self.microbatches, spec.batch_dim)[self.microbatch]
        if spec.tp is not None:
            kept = spec.tp.local(kept, self.coords["tp"], self.tp)
        if kept.shape != x.shape:
            raise RuntimeError(f"dropout op {index} ({spec.node}): mask {tuple(kept.shape)} for input {tuple(x.shape)}")
        return kept

    def _draw_until(self, stop: int, keep: int | None, dtype: torch.dtype, like: torch.Tensor | None) -> None:
        if not self._sizes:
            raise RuntimeError("a dropout op ran outside a step or forward call of the program")
        device = like.device if like is not None else self.state.device
        cuda = device.type == "cuda"
        get = (lambda: torch.cuda.get_rng_state(device)) if cuda else torch.get_rng_state
        put = (lambda state: torch.cuda.set_rng_state(state, device)) if cuda else torch.set_rng_state
        theirs = get()
        put(self.state)
        try:
            while self._next < stop:
                spec = self.specs[self._next]
                shape = [evaluate_expr(s, self._sizes) for s in spec.sizes]
                if 0 in shape:  # aten.dropout returns an empty input as it is, drawing nothing
                    self._kept[self._next] = self._rows(spec, torch.empty(shape, dtype=dtype, device=device))
                    self._next += 1
                    continue
                ones = _ones_like_layout(shape, like if self._next == keep else None, dtype, device)
                # aten.dropout of ones is the scaled mask the op multiplies by, drawn exactly as the op
                # would draw it for the whole batch (bernoulli on CPU, the fused kernel on CUDA).
                noise = torch.ops.aten.dropout.default(ones, spec.p, True)
                if self._next == keep:
                    self._kept[keep] = self._rows(spec, noise)
                self._next += 1
            self.state = get()
        finally:
            put(theirs)

    def _rows(self, spec: MaskSpec, noise: torch.Tensor) -> torch.Tensor:
        if spec.batch_dim is None:
            return noise
        per_rank = noise.shape[spec.batch_dim] // self.dp
        return noise.narrow(spec.batch_dim, self.coords["dp"] * per_rank, per_rank)


def _ones_like_layout(shape: list[int], like: torch.Tensor | None, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """Ones of ``shape`` laid out in memory as ``like`` is (the op draws in memory order, as empty_like)."""
    if like is None or like.dim() != len(shape) or like.is_contiguous():
        return torch.ones(shape, dtype=dtype, device=device)
    order = sorted(range(len(shape)), key=lambda d: -like.stride(d))
    laid = torch.ones([shape[d] for d in order], dtype=dtype, device=device)
    return laid.permute([order.index(d) for d in range(len(shape))])


def dropout(masks: SingleDeviceMasks, index: int, x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """aten.dropout(x, p, train) with the mask single-device training draws for this op."""
    if not train:
        return x  # eval mode: aten.dropout draws nothing either
    if x.numel() == 0:
        masks.mask(index, x)  # keeps the draw order
        return x
    return x * masks.mask(index, x)


WRAPPERS[dropout] = lambda args: (torch.ops.aten.dropout.default, args[2:])
