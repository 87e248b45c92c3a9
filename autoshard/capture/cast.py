"""A model and its example tensors converted to a compute dtype before capture (mixed precision)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["cast_model"]


def cast_model(dtype: torch.dtype, model: nn.Module, *examples: Any) -> tuple[Any, ...]:
    """The model converted to ``dtype`` in place, and the floating-point example tensors cast alike."""
    model.to(dtype)

    def cast(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    return (model, *pytree.tree_map(cast, examples))
