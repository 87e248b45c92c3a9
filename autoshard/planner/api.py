"""``autoshard.plan(...)``: capture and analyse a model, then rank every plan for a world size.

``analyse_for_planning`` is the part ``compile`` shares: capture, the analysis passes, the profile,
and the search.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autoshard import passes
from autoshard.capture import Captured, capture
from autoshard.capture.cast import cast_model
from autoshard.errors import InputError, PlanError
from autoshard.ir.cost import ModelCost, summarize
from autoshard.ir.meta import evaluate_expr
from autoshard.planner.costing import Costing
from autoshard.planner.hardware import Hardware
from autoshard.planner.profile import profile_graph
from autoshard.planner.report import PlanReport
from autoshard.planner.search import choose_plan
from autoshard.spec.mesh import Mesh, resolve_mesh
from autoshard.spec.plan import is_mixed_precision, resolve_plan

__all__ = ["DEFAULT_HARDWARE", "analyse_for_planning", "default_hardware", "plan", "planning_sizes"]

log = logging.getLogger("autoshard")

DEFAULT_HARDWARE = "a100-80gb"  # what a plan for a model on the meta device assumes when not told
_GPU_PRESETS = (("h200", "h200"), ("h100", "h100-80gb"), ("a100", "a100-80gb"))


def default_hardware(model: Any) -> Hardware:
    """What a plan assumes when it is not told: the CPU preset for a model on the CPU, the preset of the GPU a
    model sits on (the A100 80GB's where none matches), and the A100 80GB's for a model on the meta device
    (planning at scale). Hardware.measure() knows better: pass it as ``hardware=``."""
    device = next((p.device for p in model.parameters()), None) if isinstance(model, nn.Module) else None
    if device is not None and device.type == "cpu":
        return Hardware.preset("cpu")
    if device is not None and device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        return Hardware.preset(next((preset for key, preset in _GPU_PRESETS if key in name), DEFAULT_HARDWARE))
    return Hardware.preset(DEFAULT_HARDWARE)


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
    ``Hardware`` (``Hardware.preset(...)`` or ``Hardware.measure()``; default: ``default_hardware(model)``, the
    CPU preset for a model on the CPU, its GPU's preset on a GPU, the A100 80GB's on the meta device).
    ``global_batch_size``: plan for this many rows per step instead of the example's. ``plan``: fields
    fixed as in ``compile`` (``{"zero": 3}``, ``{"tp": 8, "recompute": "full"}``, ...). Nothing runs on
    any rank: a model on the meta device plans at full scale.
    """
    resolved = resolve_mesh(world_size)
    overrides = resolve_plan(plan if plan is not None else "auto")
    if is_mixed_precision(overrides.get("param_dtype")):
        # Plan with the parameters and activations in the compute dtype, as compile runs them; a model with
        # real weights is copied (compile converts the model itself, planning leaves it as it is).
        on_meta = all(p.is_meta for p in model.parameters())
        model = model if on_meta else copy.deepcopy(model)
        model, example_inputs, example_kwargs, example_target = cast_model(
            overrides["param_dtype"], model, example_inputs, example_kwargs, example_target
        )
    report, *_ = analyse_for_planning(
        model, resolved, overrides, example_inputs, example_kwargs, loss_fn, example_target,
        hardware or default_hardware(model), global_batch_size,
    )  # fmt: skip
    return report


def analyse_for_planning(
    model: nn.Module, resolved: int | Mesh, overrides: dict[str, Any], example_inputs: Any,
    example_kwargs: dict[str, Any] | None, loss_fn: Any, example_target: Any, hardware: Hardware,
    global_batch_size: int | None = None,
) -> tuple[PlanReport, Captured, list[Any], ModelCost]:  # fmt: skip
    """Capture, analyse and rank the plans (what compile and autoshard.plan share)."""
    if not isinstance(hardware, Hardware):
        raise InputError(
            f"hardware must be an autoshard.Hardware (Hardware.preset('h100-80gb'), Hardware.measure()), "
            f"got {type(hardware).__name__}"
        )
    captured = capture(model, example_inputs, example_kwargs, loss_fn, example_target)
    gm, sizes = captured.gm, captured.example_sizes
    log.info("captured %s", captured)
    results = passes.analyze(gm, captured.rename)
    cost = summarize(gm)
    _refuse_data_dependent_sizes(captured.model_name, cost, sizes)
    at = planning_sizes(sizes, global_batch_size)
    model_flops = float(evaluate_expr(cost.flops_fwd + cost.flops_bwd, sizes))
    profile = profile_graph(gm, sizes, hardware.kernels, model_flops)
    report = choose_plan(resolved, overrides, Costing(profile, at, hardware), at, hardware)
    parameters = sum(p.numel() for p in model.parameters()) if isinstance(model, nn.Module) else 0
    report = dataclasses.replace(report, model=captured.model_name, parameters=parameters)
    return report, captured, results, cost


def _refuse_data_dependent_sizes(model_name: str, cost: ModelCost, example_sizes: dict[str, int]) -> None:
    """Sizes read from tensor values (``.tolist()``, ``.item()``, ``nonzero``) cannot be planned for."""
    data_dependent = [s for s in cost.symbols if s not in example_sizes]
    if not data_dependent:
        return
    layers = [
        lc.name
        for lc in cost.layers
        if any(s.name in data_dependent for e in (lc.flops_fwd, lc.activation_bytes) for s in e.free_symbols)
    ]
    raise PlanError(
        f"{model_name}'s cost depends on sizes known only from the data ({', '.join(data_dependent[:6])}"
        f"{', ...' if len(data_dependent) > 6 else ''}: .tolist(), .item() or nonzero sizing tensors, in "
        f"{', '.join(layers[:4]) or 'the graph'}); the planner sizes every tensor by the batch and sequence, "
        f"so this version does not compile such models (e.g. MoE layers that route tokens by computed counts): "
        f"compute fixed-size routing (every expert on every token, masked) to compile it"
    )
