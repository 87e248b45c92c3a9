"""How a step's arguments map onto the captured graph's flat inputs (tensors positional and by keyword, the
target), which keyword values are constants baked in at capture, and how the outputs come back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autoshard.errors import InputError

__all__ = ["CallSpec", "normalize_inputs", "split_kwargs"]

_CONSTANT_TYPES = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class CallSpec:
    """How a call's arguments map onto the graph's flat inputs, and its outputs back."""

    n_args: int
    tensor_kwargs: tuple[str, ...]
    const_kwargs: dict[str, Any] = field(hash=False)
    target_spec: pytree.TreeSpec | None
    output_spec: pytree.TreeSpec | None = None
    output_is_tensor: tuple[bool, ...] = ()

    @property
    def n_inputs(self) -> int:
        return self.n_args + len(self.tensor_kwargs)

    @property
    def n_targets(self) -> int:
        return 0 if self.target_spec is None else self.target_spec.num_leaves

    def flatten_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        if len(args) != self.n_args:
            raise InputError(f"expected {self.n_args} positional input tensor(s) as at compile time, got {len(args)}")
        expected = set(self.tensor_kwargs)
        for key in sorted(set(kwargs) & set(self.const_kwargs)):
            # A constant keyword was baked into the graph at compile time: the same value again is the same
            # call; another value would need another graph.
            if kwargs[key] != self.const_kwargs[key]:
                raise InputError(
                    f"{key}={kwargs[key]!r}: {key} was fixed at compile time as {self.const_kwargs[key]!r} (non-tensor "
                    f"keywords are constants of the graph); compile again with {key}={kwargs[key]!r} to change it"
                )
        kwargs = {k: v for k, v in kwargs.items() if k not in self.const_kwargs}
        unknown = sorted(set(kwargs) - expected)
        missing = sorted(expected - set(kwargs))
        if unknown or missing:
            raise InputError(
                f"keyword inputs must be the tensor keywords given at compile time {sorted(expected)}; "
                f"unexpected {unknown}, missing {missing}"
            )
        flat = list(args) + [kwargs[k] for k in self.tensor_kwargs]
        for i, t in enumerate(flat):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"input {i} is of type {type(t).__name__}, expected a torch.Tensor")
        return flat

    def flatten_target(self, target: Any) -> list[torch.Tensor]:
        if self.target_spec is None:
            if target is not None:
                raise InputError("this program was compiled without loss_fn, so step() takes no target")
            return []
        if target is None:
            raise InputError("this program computes loss_fn(outputs, target): pass step(..., target=...)")
        leaves, spec = pytree.tree_flatten(target)
        if spec != self.target_spec:
            raise InputError(f"target structure {spec} differs from the example target's {self.target_spec}")
        return leaves

    def check_against(self, flat: list[torch.Tensor], compiled: list[Any]) -> None:
        """One line naming the first input or target whose dtype, rank or fixed sizes differ from the
        compiled graph's (``compiled``: each placeholder's TensorShape; symbolic sizes may vary)."""
        names = [f"input {i}" for i in range(self.n_args)] + list(self.tensor_kwargs)
        names += ["target"] if self.n_targets == 1 else [f"target leaf {i}" for i in range(self.n_targets)]
        for name, tensor, shape in zip(names, flat, compiled):
            if shape is None:
                continue
            fixed_ok = len(tensor.shape) == len(shape.sizes) and all(
                not size.is_number or int(size) == got for size, got in zip(shape.sizes, tensor.shape)
            )
            if tensor.dtype != shape.dtype or not fixed_ok:
                want = ", ".join(str(s) for s in shape.sizes)
                raise InputError(
                    f"step(): {name} is {tensor.dtype} of shape {tuple(tensor.shape)}; the program was compiled "
                    f"for {shape.dtype} of shape ({want}) (B and S may vary, other sizes and the dtype may not)"
                )

    def unflatten_outputs(self, tensors: list[torch.Tensor]) -> Any:
        it = iter(tensors)
        leaves = [next(it) if is_tensor else None for is_tensor in self.output_is_tensor]
        return pytree.tree_unflatten(leaves, self.output_spec)


def normalize_inputs(example_inputs: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)) or not example_inputs:
        raise InputError(
            f"example_inputs must be a non-empty tuple of tensors (one global batch), got "
            f"{type(example_inputs).__name__}; e.g. example_inputs=(input_ids,)"
        )
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise InputError(
                f"example_inputs[{i}] is of type {type(x).__name__}, expected a torch.Tensor; pass non-tensor "
                f"arguments as example_kwargs (they are baked into the graph as constants)"
            )
    return tuple(example_inputs)


def split_kwargs(example_kwargs: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    if example_kwargs is None:
        return {}, {}
    if not isinstance(example_kwargs, dict):
        raise InputError(f"example_kwargs must be a dict of keyword arguments, got {type(example_kwargs).__name__}")
    tensors, constants = {}, {}
    for key, value in example_kwargs.items():
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, _CONSTANT_TYPES):
            constants[key] = value
        else:
            raise InputError(
                f"example_kwargs[{key!r}] is of type {type(value).__name__}; keyword inputs must be tensors or "
                f"constants (None, bool, int, float, str)"
            )
    return tensors, constants
