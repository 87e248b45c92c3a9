"""The transform pipeline: what compile() runs on the captured graph once the planner chose a plan.

Each step is a pass and the condition under which it runs, in the order the graph needs them; the
pass manager (passes/infra.py ``run_steps``) runs them and logs each result:

    autocast_asserts              the plan computes under autocast: drop export's dtype checks
    context_parallel              cp > 1: each rank's tokens, ring attention, the loss over every token
    expert_parallel               ep > 1: split the experts, dispatch and combine each layer's rows
    batch_statistics              dp > 1: statistics of the batch that reach only the loss, over every dp rank
    tp_placement, tp_rewrite      tp > 1: shard the weights, insert the collectives and local sizes
    dropout_masks                 dropout_masks="single_device": each dropout reads one device's mask
    pipeline_split                pp > 1: cut the graph into stages of balanced cost
    zero_groups | grad_buckets    ZeRO-3: one flat group a layer | otherwise gradient buckets
    pipeline_stages               pp > 1: one graph a stage, its boundaries recv and send nodes
    and on each graph (each stage's):
      zero3_gather_free           ZeRO-3: gather a layer's parameters before use, free them after
      weight_grad_split           a zero-bubble schedule: matmuls hold their weight gradients for W; any
                                  other eager pipeline: B adds them into .grad in place (runtime/pipeline.py)
      recompute                   the plan's recomputation regions
      saved_tensors               what autograd keeps for backward (explain(), the report)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import fx

from autoshard import passes
from autoshard.compiler.placements import partition, stages_reading
from autoshard.errors import PlanError
from autoshard.ir.meta import MODEL_PREFIX, ExpertSplit
from autoshard.ir.placements import Shard
from autoshard.passes.infra import PassResult, Step, run_pass
from autoshard.spec.plan import splits_backward

if TYPE_CHECKING:
    from autoshard.ir.meta import MaskSpec
    from autoshard.passes.context_parallel import CpReport
    from autoshard.passes.pipeline_stages import StageGraph
    from autoshard.passes.saved_tensors import ActivationMemory
    from autoshard.passes.tp_placement import TpReport
    from autoshard.spec.plan import Plan
    from autoshard.spec.schedules import Schedule

__all__ = ["STEPS", "Build"]


@dataclass
class Build:
    """What the pipeline carries from step to step: the graph, the plan and the facts the steps read, and
    what earlier steps produced."""

    gm: fx.GraphModule
    plan: Plan
    sizes: dict[str, int]  # symbol values of the example batch
    kernels: str  # whose kernels run ("cuda" or "cpu"): what autograd keeps differs
    model_name: str
    opt_groups: dict[int, int]  # id(parameter) -> the user's optimizer group
    log: list[PassResult] = field(default_factory=list)
    tp_report: TpReport | None = None
    masks: tuple[MaskSpec, ...] = ()
    stages_of: dict[int, frozenset[int]] = field(default_factory=dict)  # id(tensor) -> stages reading it
    stages: list[StageGraph] = field(default_factory=list)
    saved: list[tuple[str, ActivationMemory]] = field(default_factory=list)
    schedule: Schedule | None = None  # the pipeline's (None without one)
    experts: ExpertSplit = field(default_factory=ExpertSplit)  # the expert weights that ep splits
    cp_report: CpReport | None = None
    eager: bool = True  # the rank graphs run as they are (no torch.compile)

    def graphs(self) -> list[fx.GraphModule]:
        """The graphs the per-graph steps run on: each stage's once the graph is cut, else the whole."""
        return [s.gm for s in self.stages] or [self.gm]


def _context_parallel(b: Build, gm: fx.GraphModule) -> PassResult:
    result = run_pass(passes.context_parallel.PASS, gm, b.plan.cp, b.sizes, b.plan.cp_attention)
    b.cp_report = result.value
    return result


def _expert_parallel(b: Build, gm: fx.GraphModule) -> PassResult:
    result = run_pass(passes.expert_parallel.PASS, gm, b.plan.ep)
    b.experts = result.value
    return result


def _tp_placement(b: Build, gm: fx.GraphModule) -> PassResult:
    result = run_pass(passes.tp_placement.PASS, gm, b.plan.tp, b.plan.sequence_parallel, b.sizes)
    b.tp_report = result.value
    if not any(isinstance(p, Shard) for p in b.tp_report.weights.values()):
        reasons = "; ".join(f"{t.removeprefix(MODEL_PREFIX)}: {why}" for t, why in b.tp_report.replicated.items())
        raise PlanError(
            f"tp={b.plan.tp} shards none of {b.model_name}'s weights ({reasons or 'no matrix weights'}); "
            f"use tp=1, or a tp degree that divides the model's heads and hidden sizes"
        )
    return result


def _tp_rewrite(b: Build, gm: fx.GraphModule) -> PassResult:
    result = run_pass(passes.tp_rewrite.PASS, gm, b.plan.tp, b.plan.sequence_parallel)
    b.tp_report.partial_grad_params = result.value
    return result


def _dropout_masks(b: Build, gm: fx.GraphModule) -> PassResult:
    b.masks = passes.dropout_masks.catalog(gm, b.plan.tp)
    return run_pass(passes.dropout_masks.PASS, gm, b.masks)


def _pipeline_split(b: Build, gm: fx.GraphModule) -> PassResult:
    cuts = list(b.plan.pp_cuts) if b.plan.pp_cuts is not None else None
    return run_pass(passes.pipeline_split.PASS, gm, b.plan.pp * b.plan.virtual_stages, b.sizes, cuts)


def _flat_groups(b: Build, gm: fx.GraphModule) -> PassResult:
    # Flat groups never mix what must stay apart: the stages that read a parameter (so a group is complete
    # when one stage's backward ends, and a group of weights tied across pipeline ranks is laid out alike
    # on each of them), and the user's optimizer group (a ZeRO shard steps with one group's settings).
    b.stages_of = stages_reading(gm, b.plan.pp)
    for slot, targets in b.experts.slots.items():  # another rank's expert in the slot: read where the slot is
        for target in targets:
            b.stages_of[id(gm.get_parameter(target))] = b.stages_of[id(gm.get_parameter(slot))]
    groups = partition(gm, b.stages_of, b.opt_groups, b.experts.targets)
    if b.plan.zero == 3:
        return run_pass(passes.zero_groups.PASS, gm, groups)
    return run_pass(passes.grad_buckets.PASS, gm, b.plan.bucket_bytes, groups, b.plan.first_bucket_bytes)


def _pipeline_stages(b: Build, gm: fx.GraphModule) -> PassResult:
    result = run_pass(passes.pipeline_stages.PASS, gm, b.plan.pp * b.plan.virtual_stages)
    b.stages = result.value
    return result


def _weight_grad_split(b: Build, gm: fx.GraphModule) -> PassResult:
    # A parameter that two stages of one rank read (a tied embedding at both ends of a V) gets gradient
    # from each; it keeps its own in B, so that it arrives whole at one stage's last backward.
    assert b.schedule is not None
    shared = {pid for pid, stages in b.stages_of.items() if len({b.schedule.rank_of(s) for s in stages}) < len(stages)}
    return run_pass(passes.weight_grad_split.PASS, gm, shared)


def _saved_tensors(b: Build, gm: fx.GraphModule) -> PassResult:
    result = run_pass(passes.saved_tensors.PASS, gm, b.kernels, False, b.plan.autocast)
    b.saved.append((f"stage {len(b.saved)}" if b.stages else "graph", result.value))
    return result


STEPS: tuple[Step[Build], ...] = (
    Step(passes.autocast_asserts.PASS, lambda b: b.plan.autocast is not None,
         lambda b, gm: run_pass(passes.autocast_asserts.PASS, gm)),
    Step(passes.context_parallel.PASS, lambda b: b.plan.cp > 1, _context_parallel),
    Step(passes.expert_parallel.PASS, lambda b: b.plan.ep > 1, _expert_parallel),
    Step(passes.batch_statistics.PASS, lambda b: b.plan.dp > 1,
         lambda b, gm: run_pass(passes.batch_statistics.PASS, gm, b.plan.dp)),
    Step(passes.tp_placement.PASS, lambda b: b.plan.tp > 1, _tp_placement),
    Step(passes.tp_rewrite.PASS, lambda b: b.plan.tp > 1, _tp_rewrite),
    Step(passes.dropout_masks.PASS, lambda b: b.plan.dropout_masks == "single_device", _dropout_masks),
    Step(passes.pipeline_split.PASS, lambda b: b.plan.pp > 1, _pipeline_split),
    Step(passes.zero_groups.PASS, lambda b: b.plan.zero == 3, _flat_groups),
    Step(passes.grad_buckets.PASS, lambda b: b.plan.zero != 3, _flat_groups),
    Step(passes.pipeline_stages.PASS, lambda b: b.plan.pp > 1, _pipeline_stages),
    Step(passes.zero3_gather_free.PASS, lambda b: b.plan.zero == 3,
         lambda b, gm: run_pass(passes.zero3_gather_free.PASS, gm), per_graph=True),
    Step(passes.weight_grad_split.PASS, lambda b: splits_backward(b.plan) or (b.plan.pp > 1 and b.eager),
         _weight_grad_split, per_graph=True),
    Step(passes.recompute.PASS, lambda b: True,
         lambda b, gm: run_pass(passes.recompute.PASS, gm, b.plan.recompute, b.kernels, b.sizes,
                                b.plan.autocast is None), per_graph=True),
    Step(passes.saved_tensors.PASS, lambda b: True, _saved_tensors, per_graph=True),
)  # fmt: skip
