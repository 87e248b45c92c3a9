"""compile(): model + mesh + example inputs -> capture -> analyze -> plan -> transform -> Program."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from autoshard import passes
from autoshard.capture import capture
from autoshard.cost import summarize
from autoshard.errors import InputError, MeshError, PlanError
from autoshard.mesh import Mesh
from autoshard.meta import get_layer, get_shape
from autoshard.placements import Shard
from autoshard.plan import Plan, is_mixed_precision
from autoshard.planner import DeviceSpec, choose_plan
from autoshard.program import Program
from autoshard.runtime.pipeline import gradient_owners
from autoshard.schedules import Schedule, ScheduleError, build_schedule

__all__ = ["compile"]

log = logging.getLogger("autoshard")


def _resolve_mesh(mesh: Any) -> int | Mesh:
    if isinstance(mesh, Mesh):
        return mesh
    if isinstance(mesh, int) and not isinstance(mesh, bool):
        if mesh < 1:
            raise MeshError(f"mesh={mesh} is not a positive world size; pass the number of ranks or a Mesh")
        return mesh
    if type(mesh).__name__ == "DeviceMesh":
        return Mesh.from_device_mesh(mesh)
    raise InputError(
        f"mesh must be an autoshard.Mesh, a torch DeviceMesh, or an int world size, got {type(mesh).__name__}"
    )


def _resolve_plan(plan: Any) -> dict[str, Any]:
    if isinstance(plan, str) and plan == "auto":
        return {}
    if isinstance(plan, Plan):
        return {name: getattr(plan, name) for name in Plan.field_names()}  # asdict would unpack a Schedule
    if isinstance(plan, dict):
        Plan.check_overrides(plan)
        schedule = plan.get("schedule")
        if isinstance(schedule, Schedule):
            for name in ("microbatches", "virtual_stages"):
                if name in plan and plan[name] != getattr(schedule, name):
                    raise PlanError(
                        f"plan asks for {name}={plan[name]} but its schedule has {getattr(schedule, name)}; "
                        f"drop {name} from the plan (the schedule sets it)"
                    )
        return dict(plan)
    raise PlanError(f'plan must be "auto", an autoshard.Plan, or a dict of Plan fields, got {plan!r}')


def _check_batch(batch: int, dp: int) -> None:
    if batch % dp:
        raise InputError(
            f"the example global batch of {batch} rows is not divisible by dp={dp}; "
            f"use a global batch that is a multiple of {dp}"
        )


def _tied_parameters(gm: torch.fx.GraphModule) -> tuple[str, ...]:
    """Trainable parameters read by more than one layer (tied weights such as GPT-2's embedding and head)."""
    layers: dict[str, set[str]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and get_shape(node).requires_grad:
            users = (u for u in node.users if u.op == "call_function")
            layers.setdefault(node.target, set()).update(get_layer(user) for user in users)
    return tuple(sorted(t.removeprefix("model.") for t, used in layers.items() if len(used) > 1))


def _build_pipeline(
    gm: torch.fx.GraphModule, plan: Plan, sizes: dict[str, int], results: list[passes.PassResult]
) -> tuple[Schedule, list[passes.pipeline_stages.StageGraph]]:
    """Validate the schedule, cut the graph into stages, and bucket each stage's gradients."""
    if isinstance(plan.schedule, Schedule):
        schedule = plan.schedule
        if schedule.pp != plan.pp:
            raise ScheduleError(f"the custom schedule has {schedule.pp} ranks but pp={plan.pp}; write one row per rank")
        schedule.validate()
    else:
        schedule = build_schedule(plan.schedule, plan.pp, plan.microbatches, plan.virtual_stages)
    rows = sizes["B"] // plan.dp
    if rows % plan.microbatches:
        raise PlanError(
            f"microbatches={plan.microbatches} does not divide the {rows} rows each dp rank gets of the example "
            f"batch; use a divisor of {rows}, or a global batch divisible by dp x microbatches = "
            f"{plan.dp * plan.microbatches}"
        )
    n_stages = plan.pp * plan.virtual_stages
    cuts = list(plan.pp_cuts) if plan.pp_cuts is not None else None
    results.append(passes.pipeline_split.run(gm, n_stages, sizes, cuts))
    stages, result = passes.pipeline_stages.run(gm, n_stages)
    results.append(result)
    if plan.zero > 0:
        ranks_of: dict[str, set[int]] = {}
        for stage in stages:
            for target in stage.parameter_targets:
                ranks_of.setdefault(target, set()).add(schedule.rank_of(stage.stage))
        tied = sorted(t.removeprefix("model.") for t, ranks in ranks_of.items() if len(ranks) > 1)
        if tied:
            raise PlanError(
                f"zero={plan.zero} with pp={plan.pp} shards each stage's gradients over dp, but {tied} are tied "
                f"across pipeline ranks, whose gradients must be summed first; this version does not do that "
                f"under ZeRO: use zero=0 with pp > 1, or untie the weights"
            )
    owners = gradient_owners(schedule, {s.stage: s.parameter_targets for s in stages})
    for stage in stages:
        results.append(passes.grad_buckets.run(stage.gm, plan.bucket_bytes, owners[stage.stage]))
    return schedule, stages


def compile(  # noqa: A001 - the public name of the compiler entry point
    model: nn.Module,
    mesh: Mesh | int | Any,
    example_inputs: Any,
    example_kwargs: dict[str, Any] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    plan: str | Plan | dict[str, Any] = "auto",
    *,
    example_target: Any = None,
    device: DeviceSpec | None = None,
) -> Program:
    """Compile ``model`` into this rank's distributed training program.

    example_inputs (and example_kwargs, example_target) are one global batch. Works offline (no
    process group) for inspection; under a process group the mesh must match the world size.
    """
    resolved = _resolve_mesh(mesh)
    overrides = _resolve_plan(plan)
    if optimizer is not None and not callable(optimizer):
        raise InputError(
            f"optimizer must be a callable(params) -> torch.optim.Optimizer, got {type(optimizer).__name__}; "
            f"e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)"
        )
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        if isinstance(resolved, Mesh):
            resolved.check_world_size(world)
        elif resolved != world:
            raise MeshError(f"mesh={resolved} ranks != world size {world}; pass mesh={world} or launch {resolved}")
    if isinstance(resolved, Mesh) and isinstance(example_inputs, (tuple, list, torch.Tensor)):
        first = example_inputs if isinstance(example_inputs, torch.Tensor) else next(iter(example_inputs), None)
        if isinstance(first, torch.Tensor) and first.dim() >= 1:
            _check_batch(first.shape[0], resolved.dp)

    master_values = None
    param_dtype = overrides.get("param_dtype")
    if is_mixed_precision(param_dtype):
        # Mixed precision: keep the fp32 values for the optimizer's masters, compute in param_dtype.
        master_values = {id(p): p.detach().to(torch.float32, copy=True) for p in model.parameters()}
        model.to(param_dtype)

        def cast(t: Any) -> Any:
            return t.to(param_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        example_inputs, example_kwargs, example_target = pytree.tree_map(
            cast, (example_inputs, example_kwargs, example_target)
        )
    captured = capture(model, example_inputs, example_kwargs, loss_fn, example_target)
    log.info("captured %s in %.2fs: %d nodes", captured.model_name, captured.seconds, len(captured.gm.graph.nodes))
    results = passes.analyze(captured.gm, captured.rename)
    cost = summarize(captured.gm)
    tied = _tied_parameters(captured.gm)
    report = choose_plan(resolved, overrides, cost, captured.example_sizes, device or DeviceSpec(), tied)
    chosen = report.winner
    chosen.check_implemented(list(report.chosen.not_implemented))
    _check_batch(captured.example_sizes["B"], chosen.dp)
    schedule, stages, tp_report = None, None, None
    if chosen.tp > 1:
        tp_report, result = passes.tp_placement.run(
            captured.gm, chosen.tp, chosen.sequence_parallel, captured.example_sizes
        )
        results.append(result)
        if not any(isinstance(p, Shard) for p in tp_report.weights.values()):
            reasons = "; ".join(f"{t.removeprefix('model.')}: {why}" for t, why in tp_report.replicated.items())
            raise PlanError(
                f"tp={chosen.tp} shards none of {captured.model_name}'s weights ({reasons or 'no matrix weights'}); "
                f"use tp=1, or a tp degree that divides the model's heads and hidden sizes"
            )
        tp_report.partial_grad_params, result = passes.tp_rewrite.run(captured.gm, chosen.tp, chosen.sequence_parallel)
        results.append(result)
    if chosen.pp > 1:
        schedule, stages = _build_pipeline(captured.gm, chosen, captured.example_sizes, results)
    else:
        results.append(passes.grad_buckets.run(captured.gm, chosen.bucket_bytes))
    if chosen.zero == 3:
        results.append(passes.zero_groups.run(captured.gm))
        results.append(passes.zero3_gather_free.run(captured.gm))
    passes.check_graph(captured.gm)
    log.info("plan %s: %s", chosen, report.reason)
    return Program(
        captured=captured,
        model=model,
        plan=chosen,
        report=report,
        cost=cost,
        optimizer_factory=optimizer,
        master_values=master_values,
        schedule=schedule,
        stages=stages,
        tp_report=tp_report,
        analysis_log=[f"capture: {captured.model_name} in {captured.seconds:.2f}s"] + [str(r) for r in results],
    )
