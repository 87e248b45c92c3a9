"""What compile() hands a Program: the plan, every stage's graph, and where each tensor lives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from autoshard.ir.meta import ExpertSplit

if TYPE_CHECKING:
    from autoshard.capture import Captured
    from autoshard.ir.cost import ModelCost
    from autoshard.ir.meta import MaskSpec
    from autoshard.ir.placements import ParamPlacement
    from autoshard.passes.context_parallel import CpReport
    from autoshard.passes.pipeline_stages import StageGraph
    from autoshard.passes.tp_placement import TpReport
    from autoshard.planner.report import PlanReport
    from autoshard.spec.plan import Plan
    from autoshard.spec.schedules import Schedule
    from autoshard.spec.torch_compile import TorchCompile

__all__ = ["Compiled"]


@dataclass
class Compiled:
    """The compiler's product, the same on every rank (a Program builds its rank's runtime from it)."""

    captured: Captured
    model: nn.Module
    plan: Plan
    report: PlanReport
    cost: ModelCost
    placements: dict[str, ParamPlacement]  # the model's state-dict key -> its placement on the mesh
    stages: list[StageGraph]  # pp > 1: one per stage; else empty (the captured graph runs whole)
    schedule: Schedule | None
    tp_report: TpReport | None  # tp > 1: what the placement search decided
    template: torch.optim.Optimizer | None  # the user's optimizer over the original parameters
    opt_groups: dict[int, int]  # id(parameter) -> the user's param group holding it
    stages_of: dict[int, frozenset[int]]  # id(tensor) -> the pipeline stages that read it
    master_values: dict[int, torch.Tensor] | None  # fp32 starting values under mixed precision
    analysis_log: list[str]
    # dropout_masks="single_device": the model's dropout ops in draw order, and the generator state when
    # compile began (what single-device training would draw its first mask from)
    masks: tuple[MaskSpec, ...] = ()
    rng_state: torch.Tensor | None = None
    timeout: float = 300.0  # seconds any collective or point-to-point wait may take before the step fails
    log_every: int = 0  # steps between progress lines through logging (0: none)
    torch_compile: TorchCompile | None = None  # how each rank graph is compiled (None: run eagerly)
    check_data: int = 3  # first steps in which step() checks which ranks were handed the same rows
    experts: ExpertSplit = field(default_factory=ExpertSplit)  # the expert weights ep splits (slots re-pointed)
    cp_report: CpReport | None = None  # cp > 1: the inputs cut, the rings, the values cut to each rank's tokens
