"""``autoshard.plan(...)``: capture and analyse a model, then rank every plan for a world size."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autoshard.errors import InputError
from autoshard.planner.hardware import Hardware
from autoshard.planner.report import PlanReport
from autoshard.spec.mesh import Mesh
from autoshard.spec.plan import is_mixed_precision

__all__ = ["DEFAULT_HARDWARE", "plan", "planning_sizes"]

DEFAULT_HARDWARE = "a100-80gb"  # what a plan assumes when it is not told the hardware


def planning_sizes(example_sizes: dict[str, int], global_batch_size: int | None) -> dict[str, int]:
    """The sizes to plan at: the example's, with the batch replaced by ``global_batch_size`` when given."""
    if global_batch_size is None:
        return dict(example_sizes)
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise InputError(f"global_batch_size={global_batch_size!r} must be a positive number of rows")
    return {**example_sizes, "B": global_batch_size}


def plan(
    model: nn.Module,
    world_size: int | Mesh,
    example_inputs: Any,
    example_kwargs: dict[str, Any] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    example_target: Any = None,
    *,
    hardware: Hardware | None = None,
    global_batch_size: int | None = None,
    plan: dict[str, Any] | None = None,
) -> PlanReport:
    """The candidate plans for ``model`` on ``world_size`` ranks (or a fixed Mesh), best first.

    Each candidate has ``.plan``, ``.step_time`` (s), ``.memory`` (per-rank bytes by category, ``.total``),
    ``.tflops_per_device``, ``.mfu``, ``.fits``, ``.why`` and ``.max_batch()``. ``hardware``: a
    ``Hardware`` (``Hardware.preset(...)`` or ``Hardware.measure()``; default the A100 80GB preset).
    ``global_batch_size``: plan for this many rows per step instead of the example's. ``plan``: fields
    fixed as in ``compile`` (``{"zero": 3}``, ``{"tp": 8, "recompute": "full"}``, ...). Nothing runs on
    any rank: a model on the meta device plans at full scale.
    """
    from autoshard.compiler import analyse_for_planning, cast_to, resolve_mesh, resolve_plan

    resolved = resolve_mesh(world_size)
    overrides = resolve_plan(plan if plan is not None else "auto")
    if is_mixed_precision(overrides.get("param_dtype")):
        # Plan with the parameters and activations in the compute dtype, as compile runs them; a model with
        # real weights is copied (compile converts the model itself, planning leaves it as it is).
        on_meta = all(p.is_meta for p in model.parameters())
        model = model if on_meta else copy.deepcopy(model)
        model, example_inputs, example_kwargs, example_target = cast_to(
            overrides["param_dtype"], model, example_inputs, example_kwargs, example_target
        )
    report, *_ = analyse_for_planning(
        model, resolved, overrides, example_inputs, example_kwargs, loss_fn, example_target,
        hardware or Hardware.preset(DEFAULT_HARDWARE), global_batch_size,
    )  # fmt: skip
    return report
