"""The user's optimizer: built from their factory, checked, and measured."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from autoshard.errors import InputError

__all__ = ["make_optimizer", "optimizer_state_bytes"]


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
