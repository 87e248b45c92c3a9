"""Pipeline stage cuts: split the graph into pp contiguous stages of balanced cost.

Reads:  autoshard.layer, autoshard.ir.cost, autoshard.shape
Writes: autoshard.stage (int) on every node but the output

Cuts fall only where a repeated block begins (a layer whose name ends in an index, such as
``transformer.h.3``), so a stage is a run of whole blocks plus what comes before the first block
(embeddings: stage 0) or after the last (final norm, head, loss: the last stage). Among all such
cuts the pass picks the ones that minimize the costliest stage (forward plus backward FLOPs at the
example sizes, then parameter bytes to break ties), and among equally balanced cuts the one with
the fewest tensors crossing a cut. ``cuts`` fixes the cuts by the names of the blocks that start
stages 1..pp-1 (``["transformer.h.6"]``), or of graph nodes (``["addmm_14"]``), which may cut inside
a block.

Stage assignment is monotone in graph order, so a value only flows to the same or a later stage:
every boundary is a set of tensors sent forward (and their gradients sent back).
"""

from __future__ import annotations

import functools

from torch import fx
from torch.fx.passes.split_module import split_module

from autoshard.errors import PlanError
from autoshard.ir.meta import COST, LAYER, STAGE, evaluate_expr, get_cost, get_layer, get_stage

from .infra import Need, Pass, PassResult

__all__ = ["PASS", "block_starts", "crossing_values", "run", "split_stages"]


def _is_block(layer: str) -> bool:
    return layer.rsplit(".", 1)[-1].isdigit()


def block_starts(gm: fx.GraphModule) -> list[tuple[str, int]]:
    """(layer name, index of its first compute node) for every repeated block, in graph order."""
    starts: list[tuple[str, int]] = []
    seen: set[str] = set()
    for i, node in enumerate(gm.graph.nodes):
        if node.op != "call_function":
            continue
        layer = get_layer(node)
        if _is_block(layer) and layer not in seen:
            seen.add(layer)
            starts.append((layer, i))
    return starts


def crossing_values(nodes: list[fx.Node], cut: int) -> int:
    """How many computed values made before position ``cut`` are used at or after it."""
    position = {n: i for i, n in enumerate(nodes)}
    return sum(
        1
        for n in nodes[:cut]
        if n.op == "call_function" and any(position[u] >= cut for u in n.users if u.op != "output")
    )


def run(gm: fx.GraphModule, pp: int, sizes: dict[str, int], cuts: list[str] | None = None) -> PassResult:
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    starts = block_starts(gm)
    if pp < 1:
        raise PlanError(f"pp={pp} must be at least 1")
    if pp > 1 and len(starts) < pp:
        raise PlanError(
            f"{pp} pipeline stages (pp x virtual_stages) need at least {pp} repeated blocks to cut between, "
            f"but the graph has {len(starts)}; use at most {max(1, len(starts))} stages"
        )
    costs = []
    for n in nodes:
        c = get_cost(n)
        costs.append((evaluate_expr(c.flops_fwd + c.flops_bwd, sizes), c.param_bytes))
    prefix = [(0, 0)]
    for flops, params in costs:
        prefix.append((prefix[-1][0] + flops, prefix[-1][1] + params))

    def span(a: int, b: int) -> tuple[int, int]:
        return prefix[b][0] - prefix[a][0], prefix[b][1] - prefix[a][1]

    candidates = [pos for _, pos in starts[1:]]  # cutting before the first block would leave a stage of embeddings
    if cuts is not None:
        # A cut names a block (the stage starts with it) or a compute node (the stage starts at it).
        by_name = dict(starts[1:])
        for i, node in enumerate(nodes):
            if node.op == "call_function" and i > 0:
                by_name.setdefault(node.name, i)
        unknown = [c for c in cuts if c not in by_name]
        if len(cuts) != pp - 1 or unknown:
            raise PlanError(
                f"pp_cuts must name {pp - 1} block(s) or node(s) that start stages 1..{pp - 1}, in order; "
                f"{unknown or cuts} not usable; the blocks are {[name for name, _ in starts[1:]]}"
            )
        chosen = [by_name[c] for c in cuts]
        if chosen != sorted(set(chosen)):
            raise PlanError(f"pp_cuts {cuts} are not in graph order (or cut twice at one place)")
    else:
        crossings = {pos: crossing_values(nodes, pos) for pos in candidates}
        chosen = _balanced_cuts(candidates, pp, len(nodes), span, crossings)
    bounds = [0, *chosen, len(nodes)]
    for stage, (a, b) in enumerate(zip(bounds, bounds[1:])):
        for n in nodes[a:b]:
            n.meta[STAGE] = stage
    loads = [span(a, b)[0] for a, b in zip(bounds, bounds[1:])]
    summary = ", ".join(f"stage {s}: {load:.3g} FLOPs" for s, load in enumerate(loads))
    return PassResult("pipeline_split", False, f"{pp} stages ({summary})")


def _balanced_cuts(candidates: list[int], pp: int, end: int, span, crossings: dict[int, int]) -> list[int]:
    """Exact min-max partition over the candidate positions (dynamic programming)."""
    points = [0, *candidates]

    @functools.cache
    def best(i: int, stages: int) -> tuple[tuple[int, int, int], tuple[int, ...]]:
        """Best split of nodes[points[i]:end] into ``stages`` stages: ((max flops, max params, crossings), cuts)."""
        start = points[i]
        if stages == 1:
            flops, params = span(start, end)
            return (flops, params, 0), ()
        options = []
        for j in range(i + 1, len(points) - stages + 2):
            flops, params = span(start, points[j])
            (rest_flops, rest_params, rest_cross), rest_cuts = best(j, stages - 1)
            score = (max(flops, rest_flops), max(params, rest_params), rest_cross + crossings[points[j]])
            options.append((score, (points[j], *rest_cuts)))
        return min(options)

    return list(best(0, pp)[1])


def split_stages(gm: fx.GraphModule) -> fx.GraphModule:
    """One submodule per stage (``submod_0`` ... ), called in order by the returned top-level module."""
    for node in gm.graph.nodes:
        if node.op != "output":
            get_stage(node)
    return split_module(gm, gm, lambda node: get_stage(node), keep_original_order=True)


PASS = Pass("pipeline_split", reads=(Need(LAYER), Need(COST)), writes=(Need(STAGE),), run=run)
