"""recompute's budget solver (Plan.recompute as a share, e.g. 0.4): which spans of each block to recompute so
that at most that share of the bytes autograd keeps stays kept, at the least work repeated.

Not a pass of its own: passes/recompute.py outlines what ``choose`` returns. The candidate spans of a block
start at its start or just after a kept matmul and end just before or at a kept matmul or at its end (the
runs between matmuls, halves of a block, the whole block). A block's choices are its sets of disjoint spans;
each block contributes its Pareto front of (bytes freed, cost), and a knapsack over the blocks
(bytes on a grid, rounded down so the budget holds) finds the least work repeated that frees enough:
FLOPs, and bytes moved weighed by the device's FLOPs per byte. Checkmate (Jain et
al. 2020) solves the same problem over single ops as an ILP; spans between matmuls lose little (a run of
pointwise ops between two kept matmuls is worth recomputing whole or not at all) and keep it polynomial.

A span that ends just before a kept matmul frees nothing, though: the matmul keeps its input for the weight's
gradient. So a block's choices also hold ``InputRecipe``s: a matmul's saved input made again by the op that made
it (a norm, an activation, a gate's product) from what that op keeps anyway (graph_ops.recompute
.input_recomputed), the matmul itself not repeated; for a GPT block the two norms' and the GELU's outputs,
6 of the 15 sbh Korthikanti et al. count, at pointwise cost. Each is a span from its producer to its last
matmul in the block's order, so that it and the spans the choice holds are disjoint.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx

from autoshard.graph_ops import zero
from autoshard.ir.meta import COST, SHAPE, USER_RECOMPUTE, evaluate_expr, get_shape
from autoshard.ir.ops import ALIASING, RANDOM, packet, storage_root

from . import saved_tensors

__all__ = ["Deals", "InputRecipe", "choose", "is_gathered", "recipes"]

# Bytes on the knapsack's grid: at least this many cells, more with more blocks (each block's rounding down
# costs at most one cell), at most the cap (the table is blocks x cells).
_CELLS, _CELLS_PER_BLOCK, _MAX_CELLS = 2000, 100, 20000
# What one more region costs besides its work: a call and its inputs kept; it breaks ties between choices of
# equal work towards fewer regions.
_REGION = 1.0
# How many times the knapsack is solved again for what neighbouring blocks free together.
_RESOLVES = 3
# A repeated op costs its FLOPs and the bytes it reads and writes (a softmax, a dropout or a norm repeats no
# matmul FLOPs but moves its tensors through memory), a byte weighed as the FLOPs a device computes in the time
# it moves one: on CUDA, dense bf16 peak x what a large GEMM reaches over the HBM bandwidth elementwise kernels
# reach (A100 SXM: 0.8 x 312 TFLOP/s over 0.8 x 2.04 TB/s, about 150; H100 SXM about 280); on CPU, measured on
# two cores of a Xeon here: a matmul at 83 GFLOP/s, softmax and tanh-GELU at 2.1-2.3 GB/s read and written
# (transcendentals bound them, not memory), an add at 6.3 GB/s.
FLOPS_PER_BYTE = {"cuda": 150.0, "cpu": 40.0}


@dataclass(frozen=True)
class InputRecipe:
    """Kept matmuls (``consumers``) whose saved input, ``producer``'s output, is made again in backward."""

    producer: fx.Node
    consumers: tuple[fx.Node, ...]

    def repeated(self) -> list[fx.Node]:
        """The work repeated: the producer, once (the matmuls share what it makes again)."""
        return [self.producer]


class Deals:
    """What recomputing a set of nodes frees for backward and what it repeats, from what each op really saves
    (passes/saved_tensors.py) and its FLOPs (passes/cost_model.py), symbolic in B and S."""

    def __init__(self, gm: fx.GraphModule, device_type: str) -> None:
        self.saves = {n: pairs or [] for n, pairs in saved_tensors.node_saves(gm, device_type).items()}
        self.savers: dict[Any, set[fx.Node]] = {}
        self.size: dict[Any, sympy.Expr] = {}
        for node, pairs in self.saves.items():
            for key, nbytes in pairs:
                self.savers.setdefault(key, set()).add(node)
                self.size.setdefault(key, nbytes)

    def freed(self, nodes: Any) -> sympy.Expr:
        """Bytes no longer kept once ``nodes`` recompute: what only they keep, less their inputs (now kept)."""
        return self.freed_apart([nodes])

    def freed_apart(self, regions: list[list[fx.Node]]) -> sympy.Expr:
        """The same for several regions, each keeping its own inputs (another region's output among them)."""
        return sympy.expand(_freed(self, regions, self.size, saved_tensors.activation, sympy.Integer(0)))

    def total(self) -> sympy.Expr:
        """Every byte the graph keeps for backward, each value once."""
        return sympy.expand(sympy.Add(*self.size.values()))

    @staticmethod
    def flops(nodes: Any) -> sympy.Expr:
        nodes = nodes.repeated() if isinstance(nodes, InputRecipe) else nodes
        return sympy.expand(sympy.Add(*(n.meta[COST].flops_fwd for n in nodes if COST in n.meta)))

    @staticmethod
    def moved(nodes: list[fx.Node]) -> sympy.Expr:
        """Bytes the ops that compute (not views) read and write."""
        values = [(n, *n.all_input_nodes) for n in nodes if packet(n.target) not in ALIASING]
        return sympy.expand(sympy.Add(*(v.meta[SHAPE].nbytes for vs in values for v in vs if SHAPE in v.meta)))


class _Priced:
    """Deals in numbers at one set of sizes: what sets of nodes free and cost, from each value's and each node's
    figures evaluated once (a block's spans share them: building an expression per span is what was slow)."""

    def __init__(self, deals: Deals, sizes: dict[str, int], per_byte: float) -> None:
        self.deals, self.sizes, self.per_byte = deals, sizes, per_byte
        self.size = {key: self.at(nbytes) for key, nbytes in deals.size.items()}
        self._inputs: dict[fx.Node, tuple | None] = {}
        self._costs: dict[fx.Node, float] = {}

    def at(self, expr: Any) -> float:
        return float(evaluate_expr(expr, self.sizes))

    def freed(self, regions: list[list[fx.Node]]) -> float:
        """``Deals.freed_apart``, in bytes."""
        return _freed(self.deals, regions, self.size, self._input, 0.0)

    def cost(self, nodes: Any) -> float:
        """FLOPs repeated and bytes moved, weighed, and one region's worth."""
        nodes = nodes.repeated() if isinstance(nodes, InputRecipe) else nodes
        for node in nodes:
            if node not in self._costs:
                self._costs[node] = self.at(Deals.flops([node])) + self.per_byte * self.at(Deals.moved([node]))
        return sum(self._costs[node] for node in nodes) + _REGION

    def _input(self, arg: fx.Node) -> tuple | None:
        if arg not in self._inputs:
            kept = saved_tensors.activation(arg)
            self._inputs[arg] = None if kept is None else (kept[0], self.at(kept[1]))
        return self._inputs[arg]


def _freed(deals: Deals, regions: list[list[fx.Node]], size: dict, kept_input: Callable, zero: Any) -> Any:
    """What only the regions' nodes keep, less what their inputs keep from now on: ``size`` of each kept value
    (expressions or numbers), ``kept_input`` the (key, bytes) an input keeps or None."""
    members = {node for region in regions if not isinstance(region, InputRecipe) for node in region}
    inputs, unsaved = {}, {}  # unsaved: a recipe's value, no longer kept by the matmuls that read it again
    for region in regions:
        if isinstance(region, InputRecipe):
            made = kept_input(region.producer)
            if made is not None:
                unsaved.setdefault(made[0], set()).update(region.consumers)
        own = {region.producer} if isinstance(region, InputRecipe) else set(region)
        for node in own:
            for arg in node.all_input_nodes:
                kept = kept_input(arg) if arg not in own else None
                if kept is not None:
                    inputs[kept[0]] = kept[1]
    total = zero
    for key in {key for node in members for key, _ in deals.saves.get(node, ())} | set(inputs) | set(unsaved):
        before = key in deals.savers
        after = bool(deals.savers.get(key, set()) - members - unsaved.get(key, set())) or key in inputs
        total += (int(before) - int(after)) * size.get(key, inputs.get(key, zero))
    return total


def _front(run: list[fx.Node], kept: Callable[[fx.Node], bool], priced: _Priced, made: list) -> list[tuple]:
    """One block's Pareto front of (bytes freed, cost, choices) over its sets of disjoint choices, each a span
    (a (first, last) index pair) or one of ``made`` (its InputRecipes); disjoint choices' bytes add (what two
    both keep, or both read, is counted apart: ``choose`` settles the chosen set exactly)."""
    matmuls = [i for i, n in enumerate(run) if kept(n)]
    starts = sorted({0, *(i + 1 for i in matmuls if i + 1 < len(run))})
    ends = sorted({*matmuls, *(i - 1 for i in matmuls if i > 0), len(run) - 1})
    options: dict[int, list[tuple[Any, int, float, float]]] = {}
    for lo in starts:
        for hi in ends:
            nodes = run[lo : hi + 1]
            if lo <= hi and not any(USER_RECOMPUTE in n.meta for n in nodes):
                gain = priced.freed([nodes])
                if gain > 0:
                    options.setdefault(lo, []).append(((lo, hi), hi, gain, priced.cost(nodes)))
    at = {node: i for i, node in enumerate(run)}
    for recipe in made:
        gain = priced.freed([recipe])
        if gain > 0:
            last = max(at[c] for c in recipe.consumers)
            options.setdefault(at[recipe.producer], []).append((recipe, last, gain, priced.cost(recipe)))
    points = sorted({*starts, *options, len(run)})
    fronts: dict[int, list[tuple]] = {len(run): [(0.0, 0.0, ())]}
    after = lambda i: next(p for p in points if p > i)  # noqa: E731  (the next place a choice may start past i)
    for lo in reversed(points[:-1]):  # the best sets of choices that start at ``lo`` or later
        best = list(fronts[after(lo)])
        for choice, last, gain, cost in options.get(lo, ()):
            best += [(gain + f, cost + c, (choice, *rest)) for f, c, rest in fronts[after(last)]]
        fronts[lo] = _pareto(best)
    return fronts[points[0]]


def recipes(run: list[fx.Node], kept: Callable[[fx.Node], bool], deals: Deals) -> list[InputRecipe]:
    """The block's values that only kept matmuls keep and that their producer can make again from what it keeps
    anyway: one fresh tensor of a deterministic op (not a matmul, not communication, not random), whose inputs
    are parameters (not ZeRO-3 gathered: freed after forward) or activations something keeps."""
    made = []
    members = set(run)
    for node in run:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) or kept(node):
            continue
        if node.target in RANDOM or packet(node.target) in ALIASING or USER_RECOMPUTE in node.meta:
            continue
        shape = get_shape(node)
        if len(shape.tensors) != 1 or shape.tensors[0] is None or storage_root(node) is not node:
            continue
        savers = deals.savers.get(node, set())
        if not savers or not all(s in members and kept(s) and USER_RECOMPUTE not in s.meta for s in savers):
            continue
        if not all(_remade_from(arg, deals) for arg in node.all_input_nodes):
            continue
        made.append(InputRecipe(node, tuple(n for n in run if n in savers)))
    return made


def is_gathered(node: Any) -> bool:
    """Whether ``node`` is a ZeRO-3 gathered parameter (an output of zero.gather)."""
    return (
        isinstance(node, fx.Node)
        and node.target is operator.getitem
        and getattr(node.args[0], "target", None) is zero.gather
    )


def _remade_from(arg: fx.Node, deals: Deals) -> bool:
    """Whether the producer can read ``arg`` again in backward with nothing more kept."""
    if is_gathered(storage_root(arg)):
        return False  # a ZeRO-3 gathered parameter: freed after its last use in forward
    kept = saved_tensors.activation(arg)
    return kept is None or kept[0] in deals.savers


def _pareto(options: list[tuple]) -> list[tuple]:
    """Those no other option beats on both counts (more bytes freed, less cost)."""
    best: list[tuple] = []
    for option in sorted(options, key=lambda o: (-o[0], o[1])):
        if not best or option[1] < best[-1][1]:
            best.append(option)
    return best


def choose(
    runs: list[list[fx.Node]],
    user: list[list[fx.Node]],
    deals: Deals,
    budget: float,
    sizes: dict[str, int],
    kept: Callable[[fx.Node], bool],
    device_type: str,
    remade_inputs: bool = True,
) -> list[Any]:
    """The spans of ``runs`` (each block's nodes, what "full" recomputes of it) and InputRecipes to recompute
    besides ``user`` (the model's own checkpointed regions, which stay) so that at most ``budget`` of the kept
    bytes stay kept, at the least work repeated (FLOPs and bytes moved, ``FLOPS_PER_BYTE`` of ``device_type``'s
    kernels); everything recomputable where the budget cannot be met."""
    priced = _Priced(deals, sizes, FLOPS_PER_BYTE[device_type])
    need = sum(priced.size.values()) * (1.0 - budget)
    fronts = [_front(run, kept, priced, recipes(run, kept, deals) if remade_inputs else []) for run in runs]
    user_freed = priced.freed(user) if user else 0.0
    gap = need - user_freed
    picks = _knapsack(fronts, gap)

    def regions() -> list[Any]:  # the choices the current picks make
        return [
            c if isinstance(c, InputRecipe) else run[c[0] : c[1] + 1]
            for run, f, p in zip(runs, fronts, picks)
            for c in f[p][2]
        ]

    # The fronts add each block's bytes apart, but neighbouring blocks recomputed together free more (the value
    # between them is kept once, as the later region's input): where the chosen set frees more than its sum
    # says, solve again for a need lowered by that surplus, and keep the cheaper set while it meets the need.
    for _ in range(_RESOLVES):
        surplus = priced.freed([*user, *regions()]) - user_freed - sum(f[p][0] for f, p in zip(fronts, picks))
        retry = _knapsack(fronts, gap - surplus) if surplus > 0 else picks
        if _cost(fronts, retry) >= _cost(fronts, picks):
            break
        picks, tried = retry, picks
        if priced.freed([*user, *regions()]) < need:
            picks = tried
            break
    # What the chosen set frees, counted once, settles it: short of the need, the block whose next point costs
    # least for its bytes frees more, until the need is met.
    while priced.freed([*user, *regions()]) < need and any(picks):
        steps = [(_per_byte(fronts[i][p], fronts[i][p - 1]), i) for i, p in enumerate(picks) if p > 0]
        picks[min(steps)[1]] -= 1
    return [*user, *regions()]


def _cost(fronts: list[list[tuple]], picks: list[int]) -> float:
    return sum(front[p][1] for front, p in zip(fronts, picks))


def _per_byte(point: tuple, richer: tuple) -> float:
    """What moving to the next point of a front (more bytes freed, at more cost) costs a byte."""
    return (richer[1] - point[1]) / (richer[0] - point[0])


def _knapsack(fronts: list[list[tuple]], need: float) -> list[int]:
    """Per block, which point of its front: the least total cost whose bytes freed (rounded down to the grid)
    reach ``need``; each block's most bytes freed where no choice does."""
    if need <= 0:
        return [len(front) - 1 for front in fronts]  # each front's last point frees least: nothing at all
    cells = min(_MAX_CELLS, max(_CELLS, _CELLS_PER_BLOCK * len(fronts)))
    cost = torch.full((cells + 1,), float("inf"), dtype=torch.float64)  # the least cost of freeing j cells
    cost[0] = 0.0  # (cost[cells]: at least that many)
    back = []  # per block, per cell reached: (the front's point, the cell it came from)
    for front in fronts:
        new = torch.full((cells + 1,), float("inf"), dtype=torch.float64)
        point, came = torch.zeros(cells + 1, dtype=torch.int64), torch.zeros(cells + 1, dtype=torch.int64)
        for index, (gain, price, _) in enumerate(front):
            step = cells if gain >= need else int(gain * cells / need)  # cells it surely fills
            tried = cost + price
            if step < cells:  # below the top cell: each reached cell moves up by ``step``
                better = tried[: cells - step] < new[step:cells]
                new[step:cells] = torch.where(better, tried[: cells - step], new[step:cells])
                point[step:cells] = torch.where(better, index, point[step:cells])
                came[step:cells] = torch.where(better, torch.arange(cells - step), came[step:cells])
            top = int(torch.argmin(tried[cells - step :])) + cells - step  # the cells that reach the top
            if tried[top] < new[cells]:
                new[cells], point[cells], came[cells] = tried[top], index, top
        cost = new
        back.append((point, came))
    if not torch.isfinite(cost[cells]):
        return [0 for _ in fronts]  # the budget cannot be met: each block's most bytes freed
    picks, cell = [], cells
    for point, came in reversed(back):
        picks.append(int(point[cell]))
        cell = int(came[cell])
    return picks[::-1]
