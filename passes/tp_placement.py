"""Tensor-parallel placements: which weights to shard and how, and every value's placement along ``tp``.

Reads:  autoshard.shape
Writes: autoshard.tp (meta.TpPlacement) on every node but the output; returns a TpReport

The search shards every matrix weight it can without a forward all-gather, and so finds Megatron's
layout rather than being told it:

1. Weights are seeds in order of first use. A linear's weight is tried column-parallel (output
   features sharded), an embedding's table vocab-parallel (rows sharded).
2. The rules (autoshard.sharding) propagate placements through the whole graph; where an op
   wants an input in another placement, that is a redistribution. Redistributions the seed made
   are fixed where a weight not yet decided can absorb them:
   - a linear whose input arrives sharded on its features becomes row-parallel (its output is
     Partial, one all-reduce later, where something needs it whole);
   - an op that wants a replicated input sharded (attention wanting k and v split by heads like q,
     the SwiGLU product wanting the up projection split like the gate) pulls the linears that
     produce it into the region as column-parallel, unless that makes things worse (too few heads);
   - a split of a column-sharded value into equal parts (fused QKV) makes the seed's shard strided
     (``Shard(dim, blocks)``), so every rank holds its own q, k and v heads;
   - a bias or other parameter wanted sharded is sharded.
3. The region is kept if it needs no forward all-gather (an all-reduce or a local slice is fine);
   otherwise its seed stays replicated and the report says which op stopped it. A table not
   indexed by a model input (positions, token types) is kept only if it adds no all-reduce: small
   tables are worth sharding only where their partial sums share the token embedding's reduction.

A Partial value that one reader needs reduced is reduced once, for every later reader. With
sequence parallelism the weights are the same; a final propagation prefers reduce-scattering a
Partial value over the sequence wherever its reader works on sequence shards (norms, dropout,
residual adds), and the next column-parallel region all-gathers it.

An op with no rule gets its inputs replicated; the report lists those ops. So does an op whose rule
answers with a shard its tensors do not have (a dimension past their rank): it is replicated, and the
report lists it under ``fallbacks``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from autoshard.ir.meta import SHAPE, TP, TpPlacement, get_shape
from autoshard.ir.ops import GRAD_PATH_ELEMENTWISE, SHARD_PRESERVING
from autoshard.ir.placements import Placement, Replicate, Shard
from autoshard.sharding import rule_of
from autoshard.sharding.matmul import matmul_dims
from autoshard.sharding.propagate import Propagation, Redistribution, propagate

from . import expert_parallel
from .infra import Need, Pass, PassResult

__all__ = ["PASS", "Redistribution", "TpReport", "run"]

aten = torch.ops.aten
R = Replicate()
_TRANSPARENT_LIMIT = 64  # nodes walked back from a wanted input when looking for linears to pull in


@dataclass
class TpReport:
    """What the search decided: each weight's placement, the seeds it left whole and why, unruled ops."""

    degree: int
    sequence_parallel: bool = False
    weights: dict[str, Placement] = field(default_factory=dict)
    replicated: dict[str, str] = field(default_factory=dict)  # weight target -> why it stays whole
    unruled: dict[str, int] = field(default_factory=dict)  # op -> how many nodes
    fallbacks: dict[str, int] = field(default_factory=dict)  # op -> nodes whose rule chose an impossible shard
    partial_grad_params: tuple[str, ...] = ()  # replicated weights summed over tp after backward (tp_rewrite)
    redistributions: list[Redistribution] = field(default_factory=list)


def _indexed_by_input(embedding: fx.Node) -> bool:
    """Whether an embedding's indices are a model input (token ids), through views only."""
    node = embedding.args[1]
    for _ in range(_TRANSPARENT_LIMIT):
        if node.op == "placeholder":
            return True
        if node.op != "call_function" or node.target not in SHARD_PRESERVING:
            return False
        node = node.args[0]
    return False


def _trainable_matrix(gm: fx.GraphModule, node: object) -> bool:
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return False
    shape = get_shape(node)
    return shape.requires_grad and len(shape.tensor.sizes) == 2


def _expert_matmul(node: fx.Node) -> tuple[fx.Node, int, int] | None:
    """A grouped matmul's stacked expert weight (get_attr, trainable, [E, ., .]) through its transposes and
    casts, and which of its dims are the matmul's output and input features (None: not one)."""
    if node.op != "call_function" or not expert_parallel.is_grouped_mm(node):
        return None
    weight, dims = node.args[1], [0, 1, 2]  # dims[i]: the weight's dim that is mat_b's dim i
    while isinstance(weight, fx.Node) and weight.op == "call_function":
        if weight.target == aten.transpose.int:
            a, b = (d % 3 for d in weight.args[1:3])
            dims[a], dims[b] = dims[b], dims[a]
        elif weight.target not in (aten.to.dtype, aten._to_copy.default, aten.contiguous.default, aten.alias.default):
            return None
        weight = weight.args[0]
    if not isinstance(weight, fx.Node) or weight.op != "get_attr" or not get_shape(weight).requires_grad:
        return None
    return (weight, dims[2], dims[1]) if len(get_shape(weight).tensor.sizes) == 3 else None


def _matmul(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(input, weight get_attr) of a linear-like op or grouped matmul with a trainable weight; else None."""
    dims = matmul_dims(node.target) if node.op == "call_function" else None
    if dims and _trainable_matrix(gm, node.args[dims[1]]):
        return node.args[dims[0]], node.args[dims[1]]
    experts = _expert_matmul(node)
    return (node.args[0], experts[0]) if experts else None


def _seeds(gm: fx.GraphModule) -> list[fx.Node]:
    """Linear-like, grouped-matmul and embedding nodes whose weight is a trainable matrix (or stack of them)."""
    seeds = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        embedding = node.target == aten.embedding.default and _trainable_matrix(gm, node.args[0])
        if embedding or _matmul(gm, node):
            seeds.append(node)
    return seeds


def _weight_of(node: fx.Node) -> fx.Node:
    dims = matmul_dims(node.target)
    experts = _expert_matmul(node)
    return node.args[dims[1]] if dims else experts[0] if experts else node.args[0]


def _bias_of(node: fx.Node) -> fx.Node | None:
    if node.target == aten.addmm.default:
        bias = node.args[0]
    elif node.target == aten.linear.default:
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    else:
        bias = None
    return bias if isinstance(bias, fx.Node) and bias.op == "get_attr" else None


def _column(node: fx.Node, blocks: int = 1) -> Placement:
    dims, experts = matmul_dims(node.target), _expert_matmul(node)
    return Shard(dims[2] if dims else experts[1] if experts else 0, blocks)  # an embedding: rows (the vocabulary)


def _row(node: fx.Node) -> Placement:
    experts = _expert_matmul(node)
    return Shard(experts[2] if experts else 1 - matmul_dims(node.target)[2])


def _fits(node: fx.Node, placement: Shard, degree: int) -> bool:
    size = get_shape(_weight_of(node)).tensor.sizes[placement.dim]
    return size.is_Integer and int(size) % (placement.blocks * degree) == 0


class _Search:
    def __init__(self, gm: fx.GraphModule, degree: int) -> None:
        self.gm = gm
        self.degree = degree
        self.committed: dict[str, Placement] = {}
        self.n_weights = sum(1 for n in gm.graph.nodes if n.op == "get_attr")

    def seed_placement(self, trial: dict[str, Placement], node: fx.Node, placement: Shard) -> None:
        trial[_weight_of(node).target] = placement
        bias = _bias_of(node)
        if bias is not None and matmul_dims(node.target) and placement.dim == matmul_dims(node.target)[2]:
            trial[bias.target] = Shard(0, placement.blocks)

    def undecided(self, trial: dict[str, Placement], target: str) -> bool:
        return target not in self.committed and target not in trial

    def pull_candidates(self, prop: Propagation, start: fx.Node, trial: dict[str, Placement]) -> list[fx.Node]:
        """Linears with undecided weights that make ``start`` through shape and elementwise ops."""
        found, stack, seen = [], [start], set()
        while stack and len(seen) < _TRANSPARENT_LIMIT:
            node = stack.pop()
            if node in seen or node.op != "call_function":
                continue
            seen.add(node)
            matmul = _matmul(self.gm, node)
            if matmul:
                if self.undecided(trial, matmul[1].target) and prop.out.get(matmul[0]) == R:
                    found.append(node)
                continue
            if node.target in _TRANSPARENT:
                stack.extend(a for a in node.all_input_nodes if get_shape(a).requires_grad)
        return found

    def col_ancestor(self, start: fx.Node, trial: dict[str, Placement]) -> fx.Node | None:
        """The tentatively column-parallel linear a value comes from through view-like ops."""
        node, steps = start, 0
        while node.op == "call_function" and steps < _TRANSPARENT_LIMIT:
            dims = matmul_dims(node.target)
            if dims or _expert_matmul(node):
                weight = _weight_of(node)
                ok = isinstance(weight, fx.Node) and weight.target in trial and weight.target not in self.committed
                return node if ok else None
            if node.target not in SHARD_PRESERVING:
                return None
            node, steps = node.args[0], steps + 1
        return None

    def fix(self, prop: Propagation, trial: dict[str, Placement], banned: set[fx.Node]) -> bool:
        """Let undecided weights absorb one redistribution the trial caused; False when none can."""
        for consumer, source, src, dst in prop.wants:
            matmul = _matmul(self.gm, consumer)
            # A linear (or an expert's) fed features sharded: row-parallel.
            if (
                matmul
                and source is matmul[0]
                and isinstance(src, Shard)
                and src.blocks == 1
                and src.dim == len(get_shape(source).tensor.sizes) - 1
                and dst == R
                and self.undecided(trial, matmul[1].target)
                and _fits(consumer, _row(consumer), self.degree)
            ):
                trial[matmul[1].target] = _row(consumer)
                return True
            if not isinstance(dst, Shard):
                continue
            # A fused projection split into equal parts: the seed's shard strided by the parts.
            if isinstance(src, Shard) and src.dim == dst.dim and src.blocks != dst.blocks:
                linear = self.col_ancestor(source, trial)
                if linear is not None and _fits(linear, _column(linear, dst.blocks), self.degree):
                    self.seed_placement(trial, linear, _column(linear, dst.blocks))
                    return True
                continue
            if src != R:
                continue
            # A parameter wanted sharded (a column-parallel linear's bias, an embedding's partner).
            if source.op == "get_attr" and get_shape(source).requires_grad and self.undecided(trial, source.target):
                trial[source.target] = dst
                return True
            # A replicated activation wanted sharded: pull its linears in as column-parallel.
            if get_shape(source).requires_grad:
                pulled = [
                    n
                    for n in self.pull_candidates(prop, source, trial)
                    if n not in banned and _fits(n, _column(n), self.degree)
                ]
                if pulled:
                    before = prop.bad()
                    for n in pulled:
                        self.seed_placement(trial, n, _column(n))
                    after = propagate(self.gm, {**self.committed, **trial}, self.degree)
                    if after.bad() - before:  # it made things worse (e.g. too few KV heads): slice instead
                        for n in pulled:
                            trial.pop(_weight_of(n).target, None)
                            bias = _bias_of(n)
                            if bias is not None:
                                trial.pop(bias.target, None)
                        banned.update(pulled)
                        continue
                    return True
        return False

    def run(self, report: TpReport) -> Propagation:
        base = propagate(self.gm, self.committed, self.degree)
        for seed in _seeds(self.gm):
            weight = _weight_of(seed)
            if weight.target in self.committed:
                continue
            placement = _column(seed)
            if not _fits(seed, placement, self.degree):
                size = get_shape(weight).tensor.sizes[placement.dim]
                report.replicated[weight.target] = f"{size} rows/features not divisible by tp={self.degree}"
                continue
            trial: dict[str, Placement] = {}
            self.seed_placement(trial, seed, placement)
            banned: set[fx.Node] = set()
            prop = propagate(self.gm, {**self.committed, **trial}, self.degree)
            for _ in range(4 * self.n_weights + 8):  # each fix decides a weight (or its blocks): a safe bound
                if not self.fix(prop, trial, banned):
                    break
                prop = propagate(self.gm, {**self.committed, **trial}, self.degree)
            new_bad = prop.bad() - base.bad()
            if not new_bad and seed.target == aten.embedding.default and not _indexed_by_input(seed):
                # A position or type table is small: worth sharding only where its sum is reduced anyway.
                added = prop.all_reduces() - base.all_reduces()
                if len(prop.all_reduces()) > len(base.all_reduces()):
                    consumer, source = next(iter(added))
                    report.replicated[weight.target] = (
                        f"not indexed by a model input; sharding it would add an all-reduce of {source.name}"
                    )
                    continue
            if new_bad:
                consumer, source, _ = min(new_bad, key=lambda b: list(self.gm.graph.nodes).index(b[0]))
                report.replicated[weight.target] = (
                    f"sharding it would make {consumer.name} ({consumer.target}) gather {source.name}"
                )
                continue
            self.committed.update(trial)
            base = prop
        return base


# Ops a column shard passes through unchanged and, for pulling linears in, also elementwise ones.
_TRANSPARENT = SHARD_PRESERVING | GRAD_PATH_ELEMENTWISE


def run(
    gm: fx.GraphModule, degree: int, sequence_parallel: bool = False, example_sizes: dict[str, int] | None = None
) -> PassResult:
    """``example_sizes``: symbol values of the example batch (sequence parallel checks S divides by tp)."""
    report = TpReport(degree, sequence_parallel)
    search = _Search(gm, degree)
    prop = search.run(report)
    if sequence_parallel:  # the same weights; activations between the sharded regions on sequence shards
        prop = propagate(gm, search.committed, degree, True, example_sizes)
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if node.op == "call_function":
            decision = prop.decisions[node]
            inputs = prop.reads[node]
            has_rule = rule_of(node.target) is not None
            if not has_rule:
                name = str(node.target)
                report.unruled[name] = report.unruled.get(name, 0) + 1
            elif decision.fallback:
                name = str(node.target)
                report.fallbacks[name] = report.fallbacks.get(name, 0) + 1
            node.meta[TP] = TpPlacement(
                out=prop.out[node],
                inputs=tuple(inputs.get(a, R) for a in node.all_input_nodes),
                note=decision.note,
                bias=decision.bias,
            )
        else:
            node.meta[TP] = TpPlacement(out=prop.out[node], inputs=())
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.users and get_shape(node).requires_grad:
            report.weights[node.target] = prop.out[node]
    report.redistributions = [Redistribution(u.name, a.name, src, dst) for u, a, src, dst in prop.wants if src != dst]
    sharded = sum(isinstance(p, Shard) for p in report.weights.values())
    kinds: dict[str, int] = {}
    for r in report.redistributions:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    summary = (
        f"tp={degree}: {sharded} of {len(report.weights)} parameters sharded; redistributions "
        f"{dict(sorted(kinds.items())) or 'none'}; {sum(report.unruled.values())} nodes of "
        f"{len(report.unruled)} ops without a rule (replicated)"
    )
    if report.fallbacks:
        summary += f"; {sum(report.fallbacks.values())} nodes replicated where their rule found no valid placement"
    return PassResult("tp_placement", False, summary, value=report)


PASS = Pass("tp_placement", reads=(Need(SHAPE),), writes=(Need(TP),), run=run)
