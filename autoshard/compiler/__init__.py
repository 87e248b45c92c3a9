"""compile(): model + mesh + example inputs -> capture -> analyze -> plan -> transform -> Program.

Everything here is deterministic and needs no process group: the same model, mesh and plan give
the same graphs and placements on every machine, so a plan for a large mesh can be inspected offline.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils import _pytree as pytree

from autoshard import passes
from autoshard.capture import Captured, capture
from autoshard.compiler.torch_compile import TorchCompile, check_devices, check_toolchain, resolve
from autoshard.errors import InputError, MeshError, PlanError
from autoshard.ir.cost import ModelCost, summarize
from autoshard.ir.meta import MODEL_PREFIX, evaluate_expr, get_stage
from autoshard.ir.placements import OnStages, ParamPlacement, Replicate, Shard
from autoshard.planner.api import DEFAULT_HARDWARE, planning_sizes
from autoshard.planner.costing import Costing
from autoshard.planner.hardware import Hardware
from autoshard.planner.profile import profile_graph
from autoshard.planner.report import PlanReport
from autoshard.planner.search import choose_plan
from autoshard.runtime.optim import check_elementwise, group_of_params, make_optimizer
from autoshard.runtime.pipeline import StageGraph
from autoshard.spec.mesh import Mesh
from autoshard.spec.plan import Plan, is_mixed_precision
from autoshard.spec.schedules import Schedule, build_schedule

__all__ = ["Compiled", "analyse_for_planning", "cast_to", "compile", "resolve_mesh", "resolve_plan"]

log = logging.getLogger("autoshard")
run_pass = passes.run_pass


@dataclass
class Compiled:
    """What compile() hands a Program: the plan, every stage's graph, and where each tensor lives."""

    captured: Captured
    model: nn.Module
    plan: Plan
    report: PlanReport
    cost: ModelCost
    placements: dict[str, ParamPlacement]  # the model's state-dict key -> its placement on the mesh
    stages: list[StageGraph]  # pp > 1: one per stage; else empty (the captured graph runs whole)
    schedule: Schedule | None
    tp_report: Any  # passes.tp_placement.TpReport when tp > 1
    template: torch.optim.Optimizer | None  # the user's optimizer over the original parameters
    opt_groups: dict[int, int]  # id(parameter) -> the user's param group holding it
    stages_of: dict[int, frozenset[int]]  # id(tensor) -> the pipeline stages that read it
    master_values: dict[int, torch.Tensor] | None  # fp32 starting values under mixed precision
    analysis_log: list[str]
    # dropout_masks="single_device": the model's dropout ops in draw order, and the generator state when
    # compile began (what single-device training would draw its first mask from)
    masks: tuple[Any, ...] = ()
    rng_state: torch.Tensor | None = None
    timeout: float = 300.0  # seconds any collective or point-to-point wait may take before the step fails
    log_every: int = 0  # steps between progress lines through logging (0: none)
    torch_compile: TorchCompile | None = None  # how each rank graph is compiled (None: run eagerly)


def resolve_mesh(mesh: Any) -> int | Mesh:
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


def resolve_plan(plan: Any) -> dict[str, Any]:
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


def _check_batch(batch: int, dp: int) -> None:
    if batch % dp:
        raise InputError(
            f"the example global batch of {batch} rows is not divisible by dp={dp}; "
            f"use a global batch that is a multiple of {dp}"
        )


def _schedule(plan: Plan, rows: int) -> Schedule:
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


def _stages_reading(gm: fx.GraphModule, pp: int) -> dict[int, frozenset[int]]:
    """id(tensor) -> the stages whose nodes read it (every tensor read by the graph; {0} without a pipeline)."""
    out: dict[int, set[int]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.users:
            try:
                tensor = gm.get_parameter(node.target)
            except AttributeError:
                try:
                    tensor = gm.get_buffer(node.target)
                except AttributeError:
                    continue  # a runtime module (tp), not state
            stages = {get_stage(u) for u in node.users} if pp > 1 else {0}
            out.setdefault(id(tensor), set()).update(stages)
    return {key: frozenset(stages) for key, stages in out.items()}


def _placements(compiled_gm: fx.GraphModule, model: nn.Module, plan: Plan, stages_of: dict[int, frozenset[int]],
                schedule: Schedule | None, tp_report: Any) -> dict[str, ParamPlacement]:  # fmt: skip
    """Every state tensor's placement per mesh dimension, read off what the passes decided."""
    tp_of = {id(compiled_gm.get_parameter(t)): p for t, p in (tp_report.weights if tp_report else {}).items()}
    partial = {id(compiled_gm.get_parameter(t)) for t in (tp_report.partial_grad_params if tp_report else ())}
    out = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        trainable = isinstance(tensor, nn.Parameter) and tensor.requires_grad
        read_by = stages_of.get(id(tensor))
        pp = OnStages(tuple(sorted({schedule.rank_of(s) for s in read_by}))) if schedule and read_by else Replicate()
        dp = Shard(0) if plan.zero == 3 and trainable and read_by else Replicate()
        tp = tp_of.get(id(tensor), Replicate())
        tp = tp if isinstance(tp, Shard) else Replicate()
        out[key] = ParamPlacement(key, tuple(tensor.shape), trainable, pp, dp, tp, id(tensor) in partial)
    return out


def cast_to(dtype: torch.dtype, model: nn.Module, *examples: Any) -> tuple[Any, ...]:
    """The model converted to ``dtype`` in place, and the floating-point example tensors cast alike."""
    model.to(dtype)

    def cast(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    return (model, *pytree.tree_map(cast, examples))


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
    return report, captured, results, cost


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
    hardware: Hardware | None = None,
    timeout: float = 300.0,
    log_every: int | None = None,
    torch_compile: bool | None = None,
    backend: str | Callable[..., Any] | None = None,
) -> Any:
    """Compile ``model`` into this rank's distributed training program (an ``autoshard.Program``).

    example_inputs (and example_kwargs, example_target) are one global batch. ``optimizer`` is a
    callable from parameters to a torch optimizer (parameter groups welcome). Works offline (no
    process group) for inspection; under a process group the mesh must match the world size.
    ``hardware``: what the planner assumes about the devices and links (``autoshard.Hardware``: a preset,
    ``Hardware.measure()`` or ``Hardware.from_json(...)``; default the A100 80GB preset).
    ``timeout``: seconds a rank waits in any collective or send/recv before its step fails with the
    step and the operation named (a rank that died or stalls never hangs the others).
    ``log_every``: every that many steps rank 0 logs a progress line (``program.metrics``) to the
    ``autoshard`` logger.
    ``torch_compile=True``: each rank's graph (each pipeline stage's) is compiled by torch.compile with
    ``backend`` (default inductor); a model already wrapped by ``torch.compile`` is unwrapped and its
    request carried over (None: as the model). ``program.compile_seconds`` reports the time it took.
    """
    from autoshard.program import Program

    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InputError(f"timeout={timeout!r} must be a positive number of seconds, e.g. timeout=300")
    if log_every is not None and (isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1):
        raise InputError(f"log_every={log_every!r} must be a positive number of steps, e.g. log_every=10")
    model, request = resolve(model, torch_compile, backend)
    resolved = resolve_mesh(mesh)
    overrides = resolve_plan(plan)
    if optimizer is not None and not callable(optimizer):
        raise InputError(
            f"optimizer must be a callable(params) -> torch.optim.Optimizer, got {type(optimizer).__name__}; "
            f"e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)"
        )
    distributed = dist.is_available() and dist.is_initialized()
    check_toolchain(request, check_devices(model, dist.get_backend() if distributed else ""))
    if distributed:
        world = dist.get_world_size()
        if isinstance(resolved, Mesh):
            resolved.check_world_size(world)
        elif resolved != world:
            raise MeshError(f"mesh={resolved} ranks != world size {world}; pass mesh={world} or launch {resolved}")
    if isinstance(resolved, Mesh) and isinstance(example_inputs, (tuple, list, torch.Tensor)):
        first = example_inputs if isinstance(example_inputs, torch.Tensor) else next(iter(example_inputs), None)
        if isinstance(first, torch.Tensor) and first.dim() >= 1:
            _check_batch(first.shape[0], resolved.dp)

    rng_state = _generator_state(model)  # before anything here could draw
    master_values = None
    param_dtype = overrides.get("param_dtype")
    if is_mixed_precision(param_dtype):
        # Mixed precision: keep the fp32 values for the optimizer's masters, compute in param_dtype.
        master_values = {id(p): p.detach().to(torch.float32, copy=True) for p in model.parameters()}
        model, example_inputs, example_kwargs, example_target = cast_to(
            param_dtype, model, example_inputs, example_kwargs, example_target
        )
    hardware = hardware or Hardware.preset(DEFAULT_HARDWARE)
    report, captured, results, cost = analyse_for_planning(
        model, resolved, overrides, example_inputs, example_kwargs, loss_fn, example_target, hardware
    )
    gm, sizes = captured.gm, captured.example_sizes
    if overrides.get("autocast") is not None:
        _drop_dtype_asserts(gm)
    chosen = report.winner
    _check_batch(sizes["B"], chosen.dp)
    template = make_optimizer(optimizer, model.parameters()) if optimizer is not None else None
    if template is not None and chosen.zero > 0:
        check_elementwise(
            template, f"ZeRO stage {chosen.zero} steps the optimizer on flat 1/dp shards of the parameters"
        )
    if template is not None and chosen.tp > 1:
        check_elementwise(template, f"tp={chosen.tp} steps the optimizer on slices of the weights")
    opt_groups = group_of_params(template, list(model.parameters())) if template is not None else {}

    tp_report = None
    if chosen.tp > 1:
        results.append(run_pass(passes.tp_placement.PASS, gm, chosen.tp, chosen.sequence_parallel, sizes))
        tp_report = results[-1].value
        if not any(isinstance(p, Shard) for p in tp_report.weights.values()):
            reasons = "; ".join(f"{t.removeprefix(MODEL_PREFIX)}: {why}" for t, why in tp_report.replicated.items())
            raise PlanError(
                f"tp={chosen.tp} shards none of {captured.model_name}'s weights ({reasons or 'no matrix weights'}); "
                f"use tp=1, or a tp degree that divides the model's heads and hidden sizes"
            )
        results.append(run_pass(passes.tp_rewrite.PASS, gm, chosen.tp, chosen.sequence_parallel))
        tp_report.partial_grad_params = results[-1].value
    masks: tuple = ()
    if chosen.dropout_masks == "single_device":
        masks = passes.dropout_masks.catalog(gm, chosen.tp)
        results.append(run_pass(passes.dropout_masks.PASS, gm, masks))
    schedule = None
    rows = sizes["B"] // chosen.dp
    if chosen.pp == 1 and rows % chosen.microbatches:
        raise PlanError(
            f"microbatches={chosen.microbatches} (gradient accumulation) does not divide the {rows} rows each dp "
            f"rank gets of the example batch; use a divisor of {rows}"
        )
    if chosen.pp > 1:
        schedule = _schedule(chosen, sizes["B"] // chosen.dp)
        cuts = list(chosen.pp_cuts) if chosen.pp_cuts is not None else None
        results.append(run_pass(passes.pipeline_split.PASS, gm, chosen.pp * chosen.virtual_stages, sizes, cuts))

    # Flat groups never mix what must stay apart: the stages that read a parameter (so a group is
    # complete when one stage's backward ends, and a group of weights tied across pipeline ranks is laid
    # out alike on each of them), and the user's optimizer group (a ZeRO shard steps with one group's
    # hyper-parameters).
    stages_of = _stages_reading(gm, chosen.pp)
    partition = {}
    for node in gm.graph.nodes:
        param = _param_or_none(gm, node.target) if node.op == "get_attr" else None
        if param is not None and id(param) in stages_of:
            partition[node.target] = (stages_of[id(param)], opt_groups.get(id(param)))
    if chosen.zero == 3:
        results.append(run_pass(passes.zero_groups.PASS, gm, partition))
    else:
        results.append(run_pass(passes.grad_buckets.PASS, gm, chosen.bucket_bytes, partition))
    stages: list[StageGraph] = []
    if schedule is not None:
        results.append(run_pass(passes.pipeline_stages.PASS, gm, chosen.pp * chosen.virtual_stages))
        stages = results[-1].value
    saved = []
    for index, graph in enumerate([s.gm for s in stages] or [gm]):
        if chosen.zero == 3:
            results.append(run_pass(passes.zero3_gather_free.PASS, graph))
        results.append(run_pass(passes.recompute.PASS, graph, chosen.recompute))
        results.append(run_pass(passes.saved_tensors.PASS, graph, hardware.kernels, False, chosen.autocast))
        saved.append((f"stage {index}" if stages else "graph", results[-1].value))
    cost = dataclasses.replace(cost, saved_for_backward=tuple(saved))
    placements = _placements(gm, model, chosen, stages_of, schedule, tp_report)
    log.info("plan %s: %s", chosen, report.reason)
    compiled = Compiled(
        captured=captured, model=model, plan=chosen, report=report, cost=cost, placements=placements, stages=stages,
        schedule=schedule, tp_report=tp_report, template=template, opt_groups=opt_groups, stages_of=stages_of,
        master_values=master_values, timeout=float(timeout), masks=masks, rng_state=rng_state,
        log_every=log_every or 0, torch_compile=request,
        analysis_log=[f"capture: {captured}"] + [str(r) for r in results],
    )  # fmt: skip
    return Program(compiled, optimizer)


def _generator_state(model: nn.Module) -> torch.Tensor | None:
    """The state of the generator the model's dropout draws from (CUDA's when its parameters are there)."""
    if not isinstance(model, nn.Module):
        return None  # capture refuses it, by name
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "meta":
        return None
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _drop_dtype_asserts(gm: fx.GraphModule) -> None:
    """Under autocast, export's checks that a value has the dtype it had when captured (a model's
    ``.float()`` of fp32 logits) no longer hold: matmuls return bf16. They compute nothing; drop them."""
    for node in list(gm.graph.nodes):
        if node.target is torch.ops.aten._assert_tensor_metadata.default and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()


def _param_or_none(gm: fx.GraphModule, target: str) -> nn.Parameter | None:
    try:
        return gm.get_parameter(target)
    except AttributeError:
        return None
