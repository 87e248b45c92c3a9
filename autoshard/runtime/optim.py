"""The user's optimizer, as the user wrote it: its parameter groups and hyper-parameters on every plan.

``optimizer=factory`` is called on the original model's parameters; that optimizer's
``param_groups`` say which parameter belongs to which group with which hyper-parameters (no
weight decay on norms and biases, say). Without ZeRO the rank's optimizer is built by the same
factory. With ZeRO it steps flat fp32 shards instead: every flat group holds parameters of one
user group only (the passes never mix them), so the shards are put in the same groups, with the same
hyper-parameters, in an optimizer of the same class. Either way ``program.optimizer.param_groups``
mirror the user's, and ``torch.optim.lr_scheduler`` works on it unchanged.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from autoshard.errors import InputError, PlanError

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "IMPLEMENTATION_FLAGS",
    "check_elementwise",
    "clip_by_global_norm",
    "group_of_params",
    "make_optimizer",
    "optimizer_like",
    "optimizer_state_bytes",
    "weak_grad_hook",
    "with_fused_kernel",
]

# Which of torch's kernels runs an update, not what it computes: a checkpoint does not carry them over.
IMPLEMENTATION_FLAGS = ("fused", "foreach")

ELEMENTWISE_OPTIMIZERS = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "RMSprop", "NAdam", "RAdam", "Rprop", "ASGD")
    if hasattr(torch.optim, name)
)


def make_optimizer(factory: Callable[[Any], torch.optim.Optimizer], params: Iterable[Any]) -> torch.optim.Optimizer:
    optimizer = factory(iter(params))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InputError(f"optimizer(params) must return a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return optimizer


def check_elementwise(optimizer: torch.optim.Optimizer, why: str) -> None:
    """Refuse an optimizer whose update of one element reads others (``why``: what splits the tensors)."""
    if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        names = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
        raise PlanError(
            f"{why}, which is only equal to unsharded training for optimizers whose update is elementwise; "
            f"{type(optimizer).__name__} is not known to be ({names} are); use one of those, or a plan without it"
        )


def group_of_params(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> dict[int, int]:
    """id(parameter) -> index of the user's param group holding it (parameters in no group are left out)."""
    known = {id(p) for p in params}
    out: dict[int, int] = {}
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) not in known:
                raise InputError(
                    "the optimizer factory returned an optimizer over a tensor that is not a parameter of the "
                    "model; build the optimizer from the parameters it is given (or the model's own)"
                )
            out[id(param)] = index
    return out


def optimizer_like(
    template: torch.optim.Optimizer, groups: list[list[torch.Tensor]], **settings: Any
) -> torch.optim.Optimizer:
    """An optimizer of ``template``'s class whose group ``i`` steps ``groups[i]`` with the template's group ``i``
    hyper-parameters (its defaults for anything a group does not set), ``settings`` replacing them in every
    group and the defaults."""
    accepted = inspect.signature(type(template).__init__).parameters
    defaults = {k: v for k, v in template.defaults.items() if k in accepted} | settings
    param_groups = [
        {**{k: v for k, v in group.items() if k != "params"}, **settings, "params": tensors}
        for group, tensors in zip(template.param_groups, groups)
    ]
    return type(template)(param_groups, **defaults)


def with_fused_kernel(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` on torch's fused kernel (``fused=True``: one pass over each tensor's memory per step
    instead of one per operation) where the user left the implementation open (``fused`` and ``foreach``
    both None, torch's "choose for me") and torch has that kernel for its class and tensors; otherwise
    ``optimizer`` itself. The same update up to float rounding; torch_compile=True asks for it, since
    the optimizer step is pointwise work that the compiled graphs do not contain."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    groups = optimizer.param_groups
    tensors = [p for group in groups for p in group["params"]]
    supported = torch.utils._foreach_utils._get_fused_kernels_supported_devices()
    hooks = [getattr(optimizer, name, None) for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")]
    if (
        "fused" not in accepted
        or getattr(torch.optim, cls.__name__, None) is not cls  # a subclass may take other arguments: as written
        or any(hooks)  # hooks the user's factory registered stay with the user's optimizer
        or optimizer.state  # built before its first step only
        or not tensors
        or any(group.get(flag) is not None for group in groups for flag in IMPLEMENTATION_FLAGS)
        or any(group.get("differentiable") for group in groups)
        or not all(p.is_floating_point() and p.device.type in supported for p in tensors)
    ):
        return optimizer
    try:
        return optimizer_like(optimizer, [group["params"] for group in groups], fused=True)
    except (RuntimeError, ValueError):  # a setting torch's fused kernel does not take: torch's own default
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
    max_norm: float | None,
    all_reduce: Callable[[torch.Tensor], Any],
    device: torch.device,
) -> torch.Tensor:
    """The L2 norm of ``counted``, its squares summed over ranks by ``all_reduce``; with ``max_norm``,
    ``scaled`` is multiplied so that the norm is at most ``max_norm`` (clip_grad_norm_'s rule).

    Each rank counts a disjoint part of the gradients (ParamPlacement.counts_in_norm), so the sum is
    the single-device norm.
    """
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for grad in counted:
        squares += grad.detach().double().pow(2).sum().to(device)
    all_reduce(squares)
    total = squares.sqrt().float()
    if max_norm is not None:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for grad in scaled:
            grad.mul_(coef.to(grad.device))
    return total
