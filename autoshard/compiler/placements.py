"""Where each state tensor lives on the mesh, read off what the passes decided; which stages read it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import fx, nn

from autoshard.ir.meta import ExpertSplit, get_stage
from autoshard.ir.placements import OnRank, OnStages, ParamPlacement, Replicate, Shard

if TYPE_CHECKING:
    from autoshard.passes.tp_placement import TpReport
    from autoshard.spec.plan import Plan
    from autoshard.spec.schedules import Schedule

__all__ = ["param_placements", "partition", "stages_reading"]


def stages_reading(gm: fx.GraphModule, pp: int) -> dict[int, frozenset[int]]:
    """id(tensor) -> the stages whose nodes read it (every tensor read by the graph; {0} without a pipeline)."""
    out: dict[int, set[int]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.users:
            tensor = _state(gm, node.target)
            if tensor is None:
                continue  # a runtime module (tp), not state
            stages = {get_stage(u) for u in node.users} if pp > 1 else {0}
            out.setdefault(id(tensor), set()).update(stages)
    return {key: frozenset(stages) for key, stages in out.items()}


def partition(
    gm: fx.GraphModule, stages_of: dict[int, frozenset[int]], opt_groups: dict[int, int], experts: frozenset[str]
) -> dict[str, tuple[frozenset[int], int | None, bool]]:
    """Each trainable parameter's (stages reading it, the user's optimizer group, whether it is an expert weight
    that ep splits): what a flat group keeps apart."""
    out = {}
    for node in gm.graph.nodes:
        param = _parameter(gm, node.target) if node.op == "get_attr" else None
        if param is not None and id(param) in stages_of:
            out[node.target] = (stages_of[id(param)], opt_groups.get(id(param)), node.target in experts)
    return out


def param_placements(
    compiled_gm: fx.GraphModule,
    model: nn.Module,
    plan: Plan,
    stages_of: dict[int, frozenset[int]],
    schedule: Schedule | None,
    tp_report: TpReport | None,
    experts: ExpertSplit | None = None,
) -> dict[str, ParamPlacement]:
    """Every state tensor's placement per mesh dimension (a loop's expert, that of the slot it runs in)."""
    experts = experts or ExpertSplit()
    param = compiled_gm.get_parameter
    tp_of = {id(param(t)): p for t, p in (tp_report.weights if tp_report else {}).items()}
    partial = {id(param(t)) for t in (tp_report.partial_grad_params if tp_report else ())}
    stacked = {id(param(t)) for t in experts.stacked}
    slot_of = {id(param(t)): (id(param(slot)), k) for slot, ts in experts.slots.items() for k, t in enumerate(ts)}
    out = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        trainable = isinstance(tensor, nn.Parameter) and tensor.requires_grad
        read_by = stages_of.get(id(tensor))
        pp = OnStages(tuple(sorted({schedule.rank_of(s) for s in read_by}))) if schedule and read_by else Replicate()
        dp = Shard(0) if plan.zero == 3 and trainable and read_by else Replicate()
        like, ep = id(tensor), Shard(0) if id(tensor) in stacked else Replicate()
        if id(tensor) in slot_of:  # laid out as the slot it runs in, whole on the ep rank that runs it
            like, ep = slot_of[id(tensor)][0], OnRank(slot_of[id(tensor)][1])
        tp = tp_of.get(like, Replicate())
        tp = tp if isinstance(tp, Shard) else Replicate()
        out[key] = ParamPlacement(key, tuple(tensor.shape), trainable, pp, dp, tp, like in partial, ep)
    return out


def _parameter(gm: fx.GraphModule, target: str) -> nn.Parameter | None:
    try:
        return gm.get_parameter(target)
    except AttributeError:
        return None


def _state(gm: fx.GraphModule, target: str) -> nn.Parameter | None:
    """The parameter or buffer a get_attr reads (None for a runtime module)."""
    param = _parameter(gm, target)
    if param is not None:
        return param
    try:
        return gm.get_buffer(target)
    except AttributeError:
        return None
