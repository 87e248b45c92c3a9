"""Memory and step time of one plan (first-order model; replaced by the graph-based one)."""

from __future__ import annotations

import sympy

from autoshard.cost import ModelCost
from autoshard.hardware import Hardware
from autoshard.plan import Plan
from autoshard.planner.report import Candidate, Memory, StepTime

__all__ = ["Costing"]


class Costing:
    def __init__(self, cost: ModelCost, sizes: dict[str, int], hardware: Hardware) -> None:
        self.cost = cost
        self.sizes = dict(sizes)
        self.hardware = hardware
        self.evaluated = cost.evaluate(**sizes)
        self.blocks = sum(1 for lc in cost.layers if lc.name.rsplit(".", 1)[-1].isdigit()) or 1
        self.heads = 0

    def allows(self, tp: int = 1, pp: int = 1) -> bool:
        return pp <= max(1, self.blocks)

    def candidate(self, plan: Plan) -> Candidate:
        hw, cost = self.hardware, self.evaluated
        shards = plan.tp * plan.pp
        weights = cost.param_bytes / shards
        grads = weights
        optimizer = 2 * weights
        if plan.zero >= 1:
            optimizer /= plan.dp
        if plan.zero >= 2:
            grads /= plan.dp
        if plan.zero >= 3:
            weights /= plan.dp
        activations = int(cost.activation_bytes) / (plan.dp * shards)
        if plan.pp > 1 and plan.schedule != "gpipe":
            activations *= min(plan.pp, plan.microbatches) / plan.microbatches
        memory = Memory(int(weights), int(grads), int(optimizer), 0, int(activations))
        flops = int(cost.flops_fwd) + int(cost.flops_bwd)
        compute = flops / (plan.mesh.size * hw.peak(plan.param_dtype) * hw.matmul_efficiency)
        bubble = compute * (plan.pp - 1) / plan.microbatches if plan.pp > 1 else 0.0
        dp = 0.0
        if plan.dp > 1:
            volume = cost.param_bytes / shards
            dp = hw.collective_seconds("all_reduce", volume, plan.dp, plan.dp * plan.tp)
            dp = max(0.0, dp - 0.5 * compute)
        tp = 0.0
        if plan.tp > 1:  # first order: four all-reduces of an eighth of a layer's activations per layer
            per_layer = int(cost.activation_bytes) / max(1, len(cost.layers)) / plan.dp / 8
            tp = 4 * len(cost.layers) * hw.collective_seconds("all_reduce", per_layer, plan.tp)
        pp = 0.0
        if plan.pp > 1:  # first order: a layer's output each way per microbatch, not overlapped
            boundary = int(cost.activation_bytes) / max(1, len(cost.layers)) / plan.dp / 8
            pp = 2 * plan.microbatches * hw.collective_seconds("send_recv", boundary / plan.microbatches, 2)
        time = StepTime(compute=compute, bubble=bubble, dp_comm=dp, tp_comm=tp, pp_comm=pp)
        step = time.total
        per_device = flops / plan.mesh.size / step
        symbol = sympy.Symbol("B", integer=True, positive=True)
        expr = memory.total - memory.activations + memory.activations * symbol / self.sizes.get("B", 1)
        return Candidate(
            plan=plan, step_time=step, memory=memory, time=time, tflops_per_device=per_device / 1e12,
            mfu=per_device / hw.peak(plan.param_dtype), fits=memory.total <= hw.memory_bytes,
            why=f"compute: {compute / step:.0%} of the step", capacity=hw.memory_bytes, memory_expr=expr,
            batch_multiple=plan.dp * plan.microbatches,
        )  # fmt: skip
