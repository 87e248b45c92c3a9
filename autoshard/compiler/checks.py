"""What compile() checks and prepares before and after the planner: the request (timeout, logging, the
optimizer, the mesh against the world size, the batch), the schedule, the user's optimizer against the plan.
Every error names the problem and the fix, raised before any rank starts work."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoshard.errors import InputError, MeshError, PlanError
from autoshard.runtime.optim import check_elementwise, group_of_params, make_optimizer
from autoshard.spec.mesh import Mesh
from autoshard.spec.plan import Plan
from autoshard.spec.schedule_builders import build_schedule
from autoshard.spec.schedules import Schedule

__all__ = [
    "check_batch",
    "check_mesh",
    "check_options",
    "generator_state",
    "optimizer_template",
    "schedule_for",
]


def check_options(timeout: Any, log_every: Any, optimizer: Any, check_data: Any = 0) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InputError(f"timeout={timeout!r} must be a positive number of seconds, e.g. timeout=300")
    if log_every is not None and (isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1):
        raise InputError(f"log_every={log_every!r} must be a positive number of steps, e.g. log_every=10")
    if isinstance(check_data, bool) or not isinstance(check_data, int) or check_data < 0:
        raise InputError(f"check_data={check_data!r} must be a number of steps (0: no checks), e.g. check_data=3")
    if optimizer is not None and not callable(optimizer):
        raise InputError(
            f"optimizer must be a callable(params) -> torch.optim.Optimizer, got {type(optimizer).__name__}; "
            f"e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)"
        )


def check_mesh(resolved: int | Mesh, example_inputs: Any) -> None:
    """The mesh against the process group (when there is one) and the example batch against its dp."""
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        if isinstance(resolved, Mesh):
            resolved.check_world_size(world)
        elif resolved != world:
            raise MeshError(f"mesh={resolved} ranks != world size {world}; pass mesh={world} or launch {resolved}")
    if isinstance(resolved, Mesh) and isinstance(example_inputs, (tuple, list, torch.Tensor)):
        first = example_inputs if isinstance(example_inputs, torch.Tensor) else next(iter(example_inputs), None)
        if isinstance(first, torch.Tensor) and first.dim() >= 1:
            check_batch(first.shape[0], resolved.dp)


def check_batch(batch: int, dp: int) -> None:
    if batch % dp:
        raise InputError(
            f"the example global batch of {batch} rows is not divisible by dp={dp}; "
            f"use a global batch that is a multiple of {dp}"
        )


def schedule_for(plan: Plan, batch: int) -> Schedule | None:
    """The pipeline schedule (None without a pipeline), and the microbatches checked against each dp rank's
    rows of the example batch."""
    check_batch(batch, plan.dp)
    rows = batch // plan.dp
    if plan.pp == 1:
        if rows % plan.microbatches:
            raise PlanError(
                f"microbatches={plan.microbatches} (gradient accumulation) does not divide the {rows} rows each "
                f"dp rank gets of the example batch; use a divisor of {rows}"
            )
        return None
    if isinstance(plan.schedule, Schedule):
        schedule = plan.schedule.check_for(plan.pp)
    else:
        schedule = build_schedule(plan.schedule, plan.pp, plan.microbatches, plan.virtual_stages)
    if rows % plan.microbatches:
        raise PlanError(
            f"microbatches={plan.microbatches} does not divide the {rows} rows each dp rank gets of the example "
            f"batch; use a divisor of {rows}, or a global batch divisible by dp x microbatches = "
            f"{plan.dp * plan.microbatches}"
        )
    return schedule


def optimizer_template(
    factory: Callable[[Any], torch.optim.Optimizer] | None, model: nn.Module, plan: Plan
) -> tuple[torch.optim.Optimizer | None, dict[int, int]]:
    """The user's optimizer over the model's parameters (checked against what the plan shards), and each
    parameter's group in it."""
    if factory is None:
        return None, {}
    template = make_optimizer(factory, model.parameters())
    if plan.zero > 0:
        check_elementwise(template, f"ZeRO stage {plan.zero} steps the optimizer on flat 1/dp shards of the parameters")
    if plan.tp > 1:
        check_elementwise(template, f"tp={plan.tp} steps the optimizer on slices of the weights")
    return template, group_of_params(template, list(model.parameters()))


def generator_state(model: nn.Module) -> torch.Tensor | None:
    """The state of the generator the model's dropout draws from (CUDA's when its parameters are there)."""
    if not isinstance(model, nn.Module):
        return None  # capture refuses it, by name
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "meta":
        return None
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
