"""Every value's placement along cp: the shard of each rank's tokens carried through the graph by the sharding
rules (the same rules tensor parallelism propagates with), and what each op wants of its inputs. Read by
passes/context_parallel.py, which rewrites the graph to it.

A value is ``Shard(d)`` (this rank's tokens along d; ``merged`` when d is several dimensions flattened with the
sequence innermost, as logits flattened to [batch x tokens, vocab]), ``Replicate()`` (every token, or no
sequence: computed whole on every rank, as on one device) or ``Partial()`` (a sum over tokens, each rank its
own tokens' part). Where an op reads a whole value with a sharded one, the rules want the whole one cut to
this rank's tokens; where an op would need a sharded value whole, it mixes tokens, and cp refuses it.
"""

from __future__ import annotations

import torch
from torch import fx

from autoshard.errors import PlanError
from autoshard.ir.meta import LAYER, SHAPE, get_shape
from autoshard.ir.placements import Partial, Placement, Replicate, Shard
from autoshard.sharding import rule_of
from autoshard.sharding.rule import Decision, RuleInput, fits_ranks, replicate_all, sequence_dim
from autoshard.sharding.views import view_groups

__all__ = ["SEQUENCE_SUMS", "Propagation", "is_tensor", "sequence_input"]

aten = torch.ops.aten
R, P = Replicate(), Partial()
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
SEQUENCE_SUMS = {aten.sum.dim_IntList: False, aten.mean.dim: True, aten.sum.default: False, aten.mean.default: True}
_SDPA = aten.scaled_dot_product_attention.default
_CROSS_ENTROPY = aten.cross_entropy_loss.default


def is_tensor(node: object) -> bool:
    if not isinstance(node, fx.Node):
        return False
    shape = node.meta.get(SHAPE)
    return shape is not None and shape.scalar is None and len(shape.tensors) == 1 and shape.tensors[0] is not None


def _seed(node: fx.Node) -> int | None:
    """The sequence dimension of a float input cut to this rank's tokens where it enters (embeddings passed
    in, [batch, sequence, ...]), or None. Token ids stay whole: an embedding reads this rank's of them, and
    whatever else reads them (a label shift) reads every token."""
    if not is_tensor(node):
        return None
    shape = get_shape(node).tensor
    dim = sequence_dim(shape.sizes)
    return dim if dim is not None and shape.dtype.is_floating_point else None


def sequence_input(gm: fx.GraphModule) -> tuple[fx.Node, int] | None:
    """An input with a sequence dimension (whose size is the whole sequence's length), and that dimension."""
    for node in gm.graph.nodes:
        if node.op == "placeholder" and is_tensor(node):
            dim = sequence_dim(get_shape(node).tensor.sizes)
            if dim is not None:
                return node, dim
    return None


class Propagation:
    """Every value's placement along cp, forward through the graph, and what each op wants of its inputs."""

    def __init__(self, gm: fx.GraphModule, degree: int, sizes: dict[str, int], attention: str) -> None:
        self.gm, self.degree, self.sizes, self.attention = gm, degree, sizes, attention
        self.out: dict[fx.Node, object] = {}
        self.merged: set[fx.Node] = set()
        self.wants: list[tuple[fx.Node, fx.Node, Placement]] = []  # consumer, source, wanted placement
        self.seen: dict[fx.Node, object] = {}  # what later readers get (a partial all-reduced once is whole)
        self.seeds: dict[fx.Node, int] = {}  # float inputs cut where they enter
        self.looked_up: list[fx.Node] = []  # indices an embedding reads this rank's tokens of
        self.notes: dict[fx.Node, str] = {}

    def run(self) -> None:
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                dim = _seed(node)
                self.out[node] = R
                if dim is not None:
                    self.seeds[node] = dim
                    self.out[node] = Shard(dim)
            elif node.op == "get_attr":
                self.out[node] = R
            elif node.op == "call_function":
                self.out[node] = self._decide(node)
            else:
                continue
            self.seen[node] = self.out[node]

    def p(self, node: object) -> object:
        return self.seen.get(node, R) if isinstance(node, fx.Node) else R

    def _decide(self, node: fx.Node) -> object:
        inputs = [a for a in node.all_input_nodes if self.p(a) != R]
        if node.target is aten.embedding.default:
            looked_up = self._embedding(node)  # where the tokens start: an embedding reads this rank's indices
            if looked_up is not None:
                return looked_up
        if not inputs:
            return R  # computed whole on every rank, as on one device
        if node.target is aten.sym_size.int:
            return R  # a size: made whole again at the rewrite
        ctx = RuleInput(node, self.seen, self.degree, True, self.sizes)
        decision = self._special(ctx)
        if decision is None:
            rule = rule_of(node.target)
            decision = rule(ctx) if rule is not None else replicate_all(ctx)
            if not fits_ranks(node, decision):
                decision = replicate_all(ctx)
        for source, dst in decision.want.items():
            src = self.p(source)
            if src == dst:
                continue
            if isinstance(src, Shard) or (isinstance(src, Partial) and dst != R):
                self._refuse(node, source, src)
            self.wants.append((node, source, dst))
            if isinstance(src, Partial):
                self.seen[source] = R
        out = decision.out
        if isinstance(out, Shard) and self._keeps_merge(node, out):
            self.merged.add(node)
        if decision.note:
            self.notes[node] = decision.note
        return out

    def _keeps_merge(self, node: fx.Node, out: Shard) -> bool:
        if node in self.merged:
            return True
        nd = len(get_shape(node).tensor.sizes) if is_tensor(node) else -1
        return any(
            a in self.merged and self.p(a) == out and len(get_shape(a).tensor.sizes) == nd
            for a in node.all_input_nodes
            if is_tensor(a)
        )

    def _refuse(self, node: fx.Node, source: fx.Node, src: object) -> None:
        layer = node.meta.get(LAYER, "(top)")
        raise PlanError(
            f"context parallelism: {node.name} ({node.target}) in {layer} needs {source.name} over the whole "
            f"sequence, which cp={self.degree} splits over its ranks ({source.name} is {src} along cp): the op mixes "
            f"tokens outside attention (a cumsum, a convolution over time, a pooled token, attention weights read "
            f"outside the attention), or has no sharding rule that keeps each token's rows apart (a mixture of "
            f"experts' router); train this model with cp=1"
        )

    def _embedding(self, node: fx.Node) -> object:
        weight, ids = node.args[:2]
        if self.p(weight) != R or self.p(ids) != R or not is_tensor(ids):
            return None
        dim = sequence_dim(get_shape(ids).tensor.sizes)
        if dim is None:
            return None
        self.wants.append((node, ids, Shard(dim)))
        self.notes[node] = "an embedding of this rank's tokens"
        self.looked_up.append(ids)
        return Shard(dim)

    # Ops whose placement along cp differs from tensor parallelism's rule.
    def _special(self, ctx: RuleInput) -> Decision | None:
        node = ctx.node
        if node.target is _SDPA:
            return self._attention(ctx)
        if node.target is _CROSS_ENTROPY:
            return self._cross_entropy(ctx)
        if node.target in SEQUENCE_SUMS:
            return self._sum(ctx)
        if node.target in _VIEWS:
            return self._view(ctx)
        if node.target is aten.flatten.using_ints:
            return self._flatten(ctx)
        return None

    def _flatten(self, ctx: RuleInput) -> Decision | None:
        """flatten(x, start, end): the tokens innermost of the merged dimensions stay this rank's, merged."""
        x = ctx.node.args[0]
        p, nd = self.p(x), ctx.ndim(x)
        if not isinstance(p, Shard):
            return None
        start, end = (d % nd for d in (ctx.arg(1, "start_dim", 0), ctx.arg(2, "end_dim", -1)))
        if p.dim < start:
            return Decision(p)
        if p.dim > end:
            return Decision(Shard(p.dim - (end - start)))
        if p.dim == end and x not in self.merged:
            self.merged.add(ctx.node)
            return Decision(Shard(start))
        return None

    def _attention(self, ctx: RuleInput) -> Decision:
        q, k, v = ctx.node.args[:3]
        mask = ctx.arg(3, "attn_mask")
        nd = ctx.ndim(q)
        token = Shard(nd - 2)
        for t in (q, k, v):
            if self.p(t) not in (R, token):
                self._refuse(ctx.node, t, self.p(t))
        want: dict[fx.Node, Placement] = {t: token for t in (q, k, v) if self.p(t) != token}
        if isinstance(mask, fx.Node):
            # the ring reads this rank's query rows of a mask; all-to-all attends every query, whole
            rows = Shard(ctx.ndim(mask) - 2) if sequence_dim(ctx.sizes(mask)[-2:-1]) == 0 else R
            rows = rows if self.attention == "ring" else R
            if self.p(mask) != rows:
                want[mask] = rows
        return Decision(token, want, f"{self.attention.replace('_', '-')} attention")

    def _cross_entropy(self, ctx: RuleInput) -> Decision:
        logits, target = ctx.node.args[:2]
        p = self.p(logits)
        if p != Shard(0):
            return replicate_all(ctx)
        want: dict[fx.Node, Placement] = {target: Shard(0)} if self.p(target) != Shard(0) else {}
        weight = ctx.arg(2, "weight")
        if isinstance(weight, fx.Node) and self.p(weight) != R:
            want[weight] = R
        if logits in self.merged:
            self.merged.add(ctx.node)  # reduction="none": per token, as the logits
        reduction = ctx.arg(3, "reduction", 1)
        return Decision(Shard(0) if reduction == 0 else P, want, "cross-entropy over this rank's tokens")

    def _sum(self, ctx: RuleInput) -> Decision | None:
        x = ctx.node.args[0]
        p = self.p(x)
        if not isinstance(p, Shard):
            return None
        nd = ctx.ndim(x)
        dims = ctx.arg(1, "dim") if ctx.node.target in (aten.sum.dim_IntList, aten.mean.dim) else None
        dims = [d % nd for d in (dims if isinstance(dims, (list, tuple)) else [dims])] if dims else list(range(nd))
        return Decision(P, {}, "a sum over tokens: partial") if p.dim in dims else None

    def _view(self, ctx: RuleInput) -> Decision | None:
        x = ctx.node.args[0]
        p = self.p(x)
        if not isinstance(p, Shard):
            return None
        in_sizes, out_sizes = ctx.sizes(x), ctx.out_sizes()
        for ins, outs in view_groups(in_sizes, out_sizes):
            if p.dim not in ins:
                continue
            if len(ins) == 1 and len(outs) == 1:
                if x in self.merged:
                    self.merged.add(ctx.node)
                return Decision(Shard(outs[0]))
            if x in self.merged and len(ins) == 1 and sequence_dim(out_sizes[outs[-1] :]) == 0:
                return Decision(Shard(outs[-1]))  # [rows x tokens] back to [.., tokens]
            if x not in self.merged and len(outs) == 1 and ins[-1] == p.dim:
                self.merged.add(ctx.node)  # [.., tokens] flattened, the tokens innermost
                return Decision(Shard(outs[0]))
            return None  # the tokens split, or merged with something inside them: the rules decide
        return None
