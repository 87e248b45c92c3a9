"""The user's optimizer: built from their factory, checked, and measured."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from autoshard.errors import InputError

__all__ = ["clip_by_global_norm", "make_optimizer", "optimizer_state_bytes", "weak_grad_hook"]


def make_optimizer(factory: Callable[[Any], torch.optim.Optimizer], params: Iterable[Any]) -> torch.optim.Optimizer:
    optimizer = factory(iter(params))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InputError(f"optimizer(params) must return a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return optimizer


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-parameter state tensors (scalars such as ``step`` left out)."""
    return sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )


def weak_grad_hook(method: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """A gradient hook that calls ``method`` only while its object lives.

    Autograd keeps hooks alive from C++, where Python's garbage collector cannot see the cycle
    parameter -> hook -> gradient sync -> parameter; a strong hook would keep every compiled
    program (and its buffers) alive for as long as the model.
    """
    ref = weakref.WeakMethod(method)

    def hook(param: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(param)

    return hook


def clip_by_global_norm(
    counted: Iterable[torch.Tensor],
    scaled: Iterable[torch.Tensor],
    max_norm: float,
    all_reduce: Callable[[torch.Tensor], Any],
    device: torch.device | None = None,
) -> torch.Tensor:
    """Scale ``scaled`` so that the L2 norm of ``counted``, its squares summed over ranks by
    ``all_reduce``, is at most ``max_norm`` (torch.nn.utils.clip_grad_norm_'s rule); returns the norm.

    Each rank counts its own shard (or stage) of the gradients, so the sum is the single-device norm.
    """
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for grad in counted:
        squares += grad.detach().double().pow(2).sum().to(squares.device)
    all_reduce(squares)
    total = squares.sqrt().float()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grad in scaled:
        grad.mul_(coef.to(grad.device))
    return total
