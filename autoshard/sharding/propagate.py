"""Placements propagated through a whole graph by the rules: given the weights' placements along tp, every
value's, and the redistributions (all-reduce, all-gather, reduce-scatter, slice) where an op wants an input
in another placement than it was made in. passes.tp_placement searches over the weights with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from autoshard.ir.meta import get_shape
from autoshard.ir.placements import Partial, Placement, Replicate, Shard
from autoshard.sharding import rule_of
from autoshard.sharding.rule import Decision, RuleInput, fits_ranks, replicate_all, sequence_dim

__all__ = ["FALLBACK", "Propagation", "Redistribution", "propagate"]

R = Replicate()


@dataclass(frozen=True)
class Redistribution:
    """An input ``source`` that ``consumer`` reads in placement ``dst`` although it was made in ``src``."""

    consumer: str
    source: str
    src: Placement
    dst: Placement

    @property
    def kind(self) -> str:
        if isinstance(self.src, Partial):
            return "all_reduce" if self.dst == R else "reduce_scatter"
        if isinstance(self.src, Shard):
            return "all_gather" if self.dst == R else "all_to_all"
        return "slice"

    def __str__(self) -> str:
        return f"{self.consumer} reads {self.source} as {self.dst}, made {self.src}: {self.kind}"


@dataclass
class Propagation:
    """What one propagation found: each op's output placement, its rule's decision, the redistributions its
    inputs need (consumer, source, made in, read in), and the placement each op reads each input in."""

    out: dict[fx.Node, object]
    decisions: dict[fx.Node, Decision]
    wants: list[tuple[fx.Node, fx.Node, Placement, Placement]]  # consumer, source, src, dst
    reads: dict[fx.Node, dict[fx.Node, object]]

    def bad(self) -> set[tuple[fx.Node, fx.Node, Placement]]:
        """Redistributions that cost a forward all-gather (or worse)."""
        return {(u, a, dst) for u, a, src, dst in self.wants if isinstance(src, Shard)}

    def all_reduces(self) -> set[tuple[fx.Node, fx.Node]]:
        return {(u, a) for u, a, src, dst in self.wants if isinstance(src, Partial)}


def propagate(
    gm: fx.GraphModule,
    weights: dict[str, Placement],
    degree: int,
    sequence_parallel: bool = False,
    example_sizes: dict[str, int] | None = None,
) -> Propagation:
    """Every value's placement along tp, given the weights' (``weights`` by get_attr target).

    A Partial value that one reader needs reduced is reduced once, for every later reader."""
    out: dict[fx.Node, object] = {}  # what each op makes
    seen: dict[fx.Node, object] = {}  # what later readers get: a Partial reduced for one reader is reduced for all
    decisions: dict[fx.Node, Decision] = {}
    reads: dict[fx.Node, dict[fx.Node, object]] = {}  # the placement each op reads each input in
    wants = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            out[node] = R
        elif node.op == "get_attr":
            out[node] = weights.get(node.target, R)
        elif node.op == "call_function":
            ctx = RuleInput(node, seen, degree, sequence_parallel, example_sizes)
            rule = rule_of(node.target)
            decision = rule(ctx) if rule is not None else replicate_all(ctx)
            if sequence_parallel:
                decision = _on_sequence_shards(ctx, rule, decision)
            if not fits_ranks(node, decision):
                fallback = replicate_all(ctx)
                decision = Decision(fallback.out, fallback.want, FALLBACK, fallback=True)
            reads[node] = {a: decision.want.get(a, seen.get(a, R)) for a in node.all_input_nodes}
            for source, dst in decision.want.items():
                src = ctx.p(source)
                if src != dst:
                    wants.append((node, source, src, dst))
                    if isinstance(src, Partial):
                        seen[source] = dst
            decisions[node] = decision
            out[node] = decision.out
        else:
            continue
        seen[node] = out[node]
    return Propagation(out, decisions, wants, reads)


FALLBACK = "no valid placement from its rule: replicated"


def _on_sequence_shards(ctx: RuleInput, rule: object, decision: Decision) -> Decision:
    """Sequence parallel: where a Partial input would be all-reduced, try it reduce-scattered over the sequence."""
    partial = {
        a: sequence_dim(get_shape(a).tensor.sizes)
        for a, dst in decision.want.items()
        if dst == R and isinstance(ctx.p(a), Partial)
    }
    partial = {a: dim for a, dim in partial.items() if dim is not None}
    if not partial or rule is None:
        return decision
    trial = dict(ctx.placements)
    trial.update({a: Shard(dim) for a, dim in partial.items()})
    again = rule(RuleInput(ctx.node, trial, ctx.degree, True, ctx.example_sizes))
    if any(a in again.want for a in partial):
        return decision
    want = {**again.want, **{a: Shard(dim) for a, dim in partial.items()}}
    return Decision(again.out, want, again.note, again.bias)
