"""The planner: enumerate plans for a world size, predict per-rank memory and step time, pick one.

The cost model is the usual first-order one: compute time is FLOPs over achievable throughput,
communication follows the alpha-beta model per mesh dimension (intra-node bandwidth while a group
fits in one node, inter-node otherwise), memory follows the ZeRO paper's accounting
(weights + gradients + K bytes of optimizer state per parameter byte, divided by the shards each
ZeRO stage introduces) plus activations of the local batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from autoshard.cost import ModelCost
from autoshard.errors import PlanError
from autoshard.mesh import Mesh
from autoshard.plan import Plan, is_mixed_precision

__all__ = ["Candidate", "DeviceSpec", "PlanReport", "choose_plan", "default_microbatches", "estimate"]


@dataclass(frozen=True)
class DeviceSpec:
    """What the planner assumes about each device and its links."""

    name: str = "80 GiB accelerator"
    memory_bytes: int = 80 * 2**30
    flops_per_s: float = 300e12
    intra_node_bytes_per_s: float = 150e9
    inter_node_bytes_per_s: float = 25e9
    latency_s: float = 20e-6
    ranks_per_node: int = 8
    optimizer_bytes_per_param_byte: float = 2.0  # Adam(W): exp_avg and exp_avg_sq
    kernels: str = "cuda"  # whose kernels run, "cuda" or "cpu": what autograd keeps differs (passes.saved_tensors)


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    memory_bytes: int
    step_seconds: float
    fits: bool


@dataclass(frozen=True)
class PlanReport:
    """The planner's decision: the winner, every candidate with its prediction, and why."""

    winner: Plan
    reason: str
    sizes: dict[str, int] = field(hash=False)
    device: DeviceSpec
    candidates: tuple[Candidate, ...]

    @property
    def chosen(self) -> Candidate:
        return next(c for c in self.candidates if c.plan == self.winner)

    def table(self, top: int = 8) -> str:
        lines = [f"{'plan':<52} {'memory/rank':>12} {'step time':>11}  note"]
        ranked = sorted(self.candidates, key=lambda c: (not c.fits, c.step_seconds))
        for c in ranked[:top]:
            note = "chosen" if c.plan == self.winner else ""
            if not c.fits:
                note = (note + "; " if note else "") + "does not fit"
            lines.append(f"{str(c.plan):<52} {_gib(c.memory_bytes):>12} {c.step_seconds * 1e3:>9.3f}ms  {note}")
        if len(ranked) > top:
            lines.append(f"... and {len(ranked) - top} more candidates")
        return "\n".join(lines)


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB"


def _bandwidth(mesh: Mesh, dim: str, device: DeviceSpec) -> float:
    # Ranks of one group along dim lie `stride` apart; the group spans stride * degree ranks.
    stride = {"tp": 1, "dp": mesh.tp, "pp": mesh.tp * mesh.dp}[dim]
    span = stride * mesh.degree(dim)
    return device.intra_node_bytes_per_s if span <= device.ranks_per_node else device.inter_node_bytes_per_s


def estimate(plan: Plan, cost: ModelCost, device: DeviceSpec) -> tuple[int, float]:
    """Predicted (bytes per rank, seconds per step) for ``plan``; ``cost`` evaluated at the global batch."""
    mesh = plan.mesh
    model_shards = plan.tp * plan.pp
    weights = cost.param_bytes / model_shards
    grads = weights
    optimizer = weights * device.optimizer_bytes_per_param_byte
    if plan.zero >= 1:
        optimizer /= plan.dp
    if plan.zero >= 2:
        grads /= plan.dp
    if plan.zero >= 3:
        weights /= plan.dp
    activations = int(cost.activation_bytes) / (plan.dp * model_shards)
    if plan.pp > 1 and plan.schedule != "gpipe":
        # 1F1B keeps at most pp microbatches in flight; GPipe keeps all of them (the whole local batch).
        activations *= min(plan.pp, plan.microbatches) / plan.microbatches
    memory = int(weights + grads + optimizer + activations)

    compute = (int(cost.flops_fwd) + int(cost.flops_bwd)) / (mesh.size * device.flops_per_s)
    if plan.pp > 1:
        compute *= (plan.microbatches + plan.pp - 1) / plan.microbatches
    comm = 0.0
    if plan.dp > 1:
        volume = 2 * (plan.dp - 1) / plan.dp * cost.param_bytes / model_shards
        if plan.zero >= 3:
            volume *= 1.5
        buckets = max(1, math.ceil(cost.param_bytes / model_shards / plan.bucket_bytes))
        comm += volume / _bandwidth(mesh, "dp", device) + 2 * buckets * device.latency_s
    if plan.tp > 1:
        # Megatron: two all-reduces of the block's activations forward, two backward, per layer.
        per_layer = int(cost.activation_bytes) / max(1, len(cost.layers)) / plan.dp / 8
        volume = 4 * 2 * (plan.tp - 1) / plan.tp * per_layer * len(cost.layers)
        comm += volume / _bandwidth(mesh, "tp", device) + 4 * len(cost.layers) * device.latency_s
    if plan.pp > 1:
        # Each rank sends its stage's boundary activation forward and its gradient back, per microbatch;
        # estimated like one layer's output (as for tp above). Not overlapped with compute.
        boundary = int(cost.activation_bytes) / max(1, len(cost.layers)) / plan.dp / 8
        comm += 2 * boundary / _bandwidth(mesh, "pp", device) + 2 * plan.microbatches * device.latency_s
    # Most data-parallel communication hides behind backward; count the part that cannot.
    step = compute + max(0.0, comm - 0.5 * compute)
    return memory, step


def default_microbatches(local_rows: int, pp: int, schedule: Any) -> int:
    """The most microbatches up to 4 x pp that divide a dp rank's rows (bubble (pp-1)/(m+pp-1) shrinks with m).

    Interleaved 1F1B needs a multiple of pp; when none divides the rows, pp itself (compile then says why).
    """
    step = pp if schedule == "interleaved_1f1b" else 1
    options = [m for m in range(step, 4 * pp + 1, step) if local_rows % m == 0]
    return max(options) if options else step


def _factorizations(world: int) -> list[tuple[int, int, int]]:
    out = []
    for tp in range(1, world + 1):
        if world % tp:
            continue
        for pp in range(1, world // tp + 1):
            if (world // tp) % pp:
                continue
            out.append((world // (tp * pp), tp, pp))
    return out


def choose_plan(
    world_or_mesh: int | Mesh,
    overrides: dict[str, Any],
    cost: ModelCost,
    sizes: dict[str, int],
    device: DeviceSpec,
) -> PlanReport:
    """Pick the fastest plan that fits; explain the choice."""
    Plan.check_overrides(overrides)
    if isinstance(world_or_mesh, Mesh):
        mesh = world_or_mesh
        for dim in ("dp", "tp", "pp"):
            if dim in overrides and overrides[dim] != mesh.degree(dim):
                raise PlanError(
                    f"plan asks for {dim}={overrides[dim]} but the mesh has {dim}={mesh.degree(dim)}; "
                    f"drop {dim} from the plan or change the mesh"
                )
        shapes = [(mesh.dp, mesh.tp, mesh.pp)]
    else:
        shapes = _factorizations(world_or_mesh)
        shapes = [s for s in shapes if all(overrides.get(d, v) == v for d, v in zip(("dp", "tp", "pp"), s))]
        if not shapes:
            raise PlanError(
                f"no dp x tp x pp factorization of world size {world_or_mesh} matches the plan's fixed degrees "
                f"{ {k: overrides[k] for k in ('dp', 'tp', 'pp') if k in overrides} }"
            )
    needs_zero = overrides.get("offload") or is_mixed_precision(overrides.get("param_dtype"))
    zeros = [overrides["zero"]] if "zero" in overrides else [1, 2, 3] if needs_zero else [0, 1, 2, 3]
    evaluated = cost.evaluate(**sizes)
    candidates = []
    for dp, tp, pp in shapes:
        for zero in zeros:
            if zero > 0 and dp == 1 and "zero" not in overrides:
                continue
            if overrides.get("sequence_parallel") and tp == 1 and len(shapes) > 1:
                continue  # sequence parallelism shards over tp: only meshes with tp > 1 qualify
            fields = {**overrides, "dp": dp, "tp": tp, "pp": pp, "zero": zero}
            if pp > 1 and "microbatches" not in overrides:
                schedule = fields.get("schedule", "1f1b")
                fields["microbatches"] = default_microbatches(sizes.get("B", 1) // dp, pp, schedule)
            plan = Plan(**fields)
            memory, seconds = estimate(plan, evaluated, device)
            candidates.append(Candidate(plan, memory, seconds, memory <= device.memory_bytes))
    fitting = [c for c in candidates if c.fits]
    # The rule of thumb: a model that fits one device with plain data parallelism trains data-parallel
    # (ZeRO at most); splitting it by stages or tensors pays bubbles and activation traffic instead.
    data_parallel = [c for c in fitting if c.plan.pp == 1 and c.plan.tp == 1]
    if any(c.plan.zero == 0 for c in data_parallel):
        winner = min(data_parallel, key=lambda c: c.step_seconds)
        reason = (
            f"the model fits {_gib(device.memory_bytes)} per rank with plain data parallelism, so data parallel: "
            f"fastest predicted step among {len(data_parallel)} data-parallel candidate(s) "
            f"({len(candidates) - 1} other candidate(s) considered)"
        )
    elif fitting:
        winner = min(fitting, key=lambda c: c.step_seconds)
        others = len(candidates) - 1
        reason = (
            f"fastest predicted step among the {len(fitting)} candidate(s) that fit "
            f"{_gib(device.memory_bytes)} per rank ({others} other candidate(s) considered)"
        )
    else:
        winner = min(candidates, key=lambda c: c.memory_bytes)
        reason = (
            f"no candidate fits {_gib(device.memory_bytes)} per rank; chose the one needing "
            f"the least memory ({_gib(winner.memory_bytes)})"
        )
    return PlanReport(
        winner=winner.plan,
        reason=reason,
        sizes=dict(sizes),
        device=device,
        candidates=tuple(candidates),
    )
