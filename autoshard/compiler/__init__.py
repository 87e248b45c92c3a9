"""compile(): model + mesh + example inputs -> capture -> analyze -> plan -> transform -> Program.

Capture, the analysis passes and the planner run as ``autoshard.plan`` runs them (planner/api.py);
the transform pipeline the plan calls for is declared in compiler/pipeline.py and run by the pass
manager. Everything up to the Program is deterministic and needs no process group: the same model,
mesh and plan give the same graphs and placements on every machine, so a plan for a large mesh can be
inspected offline.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autoshard.capture.cast import cast_model
from autoshard.compiler import checks
from autoshard.compiler.compiled import Compiled
from autoshard.compiler.pipeline import STEPS, Build
from autoshard.compiler.placements import param_placements
from autoshard.passes.infra import run_steps
from autoshard.planner.api import analyse_for_planning, default_hardware
from autoshard.planner.hardware import Hardware
from autoshard.program import Program
from autoshard.spec.mesh import Mesh, resolve_mesh
from autoshard.spec.plan import Plan, is_mixed_precision, resolve_plan
from autoshard.spec.torch_compile import check_devices, check_toolchain, resolve

__all__ = ["Compiled", "compile"]

log = logging.getLogger("autoshard")


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
    check_data: int = 3,
) -> Program:
    """Compile ``model`` into this rank's distributed training program (an ``autoshard.Program``).

    example_inputs (and example_kwargs, example_target) are one global batch. ``optimizer`` is a
    callable from parameters to a torch optimizer (parameter groups welcome). Works offline (no
    process group) for inspection; under a process group the mesh must match the world size.
    ``hardware``: what the planner assumes about the devices and links (``autoshard.Hardware``: a preset,
    ``Hardware.measure()`` or ``Hardware.from_json(...)``; default: the CPU preset for a model on the CPU, its
    GPU's preset on a GPU, the A100 80GB's for a model on the meta device).
    ``timeout``: seconds a rank waits in any collective or send/recv before its step fails with the
    step and the operation named (a rank that died or stalls never hangs the others).
    ``log_every``: every that many steps rank 0 logs a progress line (``program.metrics``) to the
    ``autoshard`` logger.
    ``torch_compile=True``: each rank's graph (each pipeline stage's) is compiled by torch.compile with
    ``backend`` (default inductor); a model already wrapped by ``torch.compile`` is unwrapped and its
    request carried over (None: as the model). ``program.compile_seconds`` reports the time it took.
    ``check_data``: for that many first steps, ``step()`` checks that the ranks of a tensor-parallel group
    and of a pipeline were handed the same rows and the data-parallel ranks different ones (0: never).
    """
    model, request = resolve(model, torch_compile, backend)
    checks.check_options(timeout, log_every, optimizer, check_data)
    resolved, overrides = resolve_mesh(mesh), resolve_plan(plan)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    check_toolchain(request, check_devices(model, torch.distributed.get_backend() if distributed else ""))
    checks.check_mesh(resolved, example_inputs)
    rng_state = checks.generator_state(model)  # before anything here could draw
    master_values = None
    if is_mixed_precision(overrides.get("param_dtype")):  # the masters keep fp32; compute in param_dtype
        master_values = {id(p): p.detach().to(torch.float32, copy=True) for p in model.parameters()}
        model, example_inputs, example_kwargs, example_target = cast_model(
            overrides["param_dtype"], model, example_inputs, example_kwargs, example_target
        )
    hardware = hardware or default_hardware(model)
    report, captured, results, cost = analyse_for_planning(
        model, resolved, overrides, example_inputs, example_kwargs, loss_fn, example_target, hardware
    )
    chosen = report.winner
    schedule = checks.schedule_for(chosen, captured.example_sizes["B"])
    template, opt_groups = checks.optimizer_template(optimizer, model, chosen)
    build = Build(
        captured.gm, chosen, captured.example_sizes, hardware.kernels, captured.model_name, opt_groups,
        schedule=schedule, eager=request is None,
    )  # fmt: skip
    run_steps(STEPS, build)
    log.info("plan %s: %s", chosen, report.reason)
    compiled = Compiled(
        captured=captured, model=model, plan=chosen, report=report,
        cost=dataclasses.replace(cost, saved_for_backward=tuple(build.saved)),
        placements=param_placements(
            captured.gm, model, chosen, build.stages_of, schedule, build.tp_report, build.experts
        ),
        stages=build.stages, schedule=schedule, tp_report=build.tp_report, cp_report=build.cp_report,
        template=template, opt_groups=opt_groups,
        stages_of=build.stages_of, experts=build.experts, master_values=master_values, timeout=float(timeout),
        masks=build.masks,
        rng_state=rng_state, log_every=log_every or 0, torch_compile=request, check_data=check_data,
        analysis_log=[f"capture: {captured}"] + [str(r) for r in [*results, *build.log]],
    )  # fmt: skip
    return Program(compiled, optimizer)
