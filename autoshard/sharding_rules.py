"""Sharding propagation rules: per ATen overload, how its inputs' placements along ``tp`` decide its output's.

A rule reads the node and the placements its tensor inputs arrive in and returns a ``Decision``:
the output placement (a tuple for ops with several outputs) and, where the inputs as they arrive
cannot give a sharded result, the placements it wants them in instead. The TP passes insert those
redistributions (Partial->Replicate: all-reduce; Shard->Replicate: all-gather; Replicate->Shard: a
local slice) and weigh their cost. Families share helpers: one for pointwise ops (broadcasting
from the right), one for views (grouping input and output dimensions by size), one for every
matrix multiply (linear, addmm, mm, bmm, matmul), and so on.

An op with no rule gets every input replicated: always correct, and passes.tp_placement lists it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch import fx

from autoshard.meta import get_shape
from autoshard.placements import Partial, Placement, Replicate, Shard

__all__ = ["RULES", "Decision", "RuleInput", "matmul_dims", "sequence_dim", "view_groups"]

aten = torch.ops.aten
R = Replicate()
P = Partial()
Out = Placement | tuple[Placement, ...]

# Symbols take these stand-in values when view dimensions are grouped by size (any distinct primes
# larger than every static size would do: they only decide which products are equal).
_PROBE = (1000003, 1000033, 1000037, 1000039)


@dataclass(frozen=True)
class Decision:
    """A rule's answer: the output placement(s), the inputs it wants in other placements, and why."""

    out: Out
    want: dict[fx.Node, Placement] = field(default_factory=dict)
    note: str = ""


@dataclass
class RuleInput:
    """What a rule may read: the node, the placement of every value computed so far, and the degree."""

    node: fx.Node
    placements: dict[fx.Node, Out]
    degree: int
    sequence_parallel: bool = False
    example_sizes: dict[str, int] | None = None  # symbol values of the example batch

    def p(self, arg: Any) -> Placement:
        if not isinstance(arg, fx.Node):
            return R
        placement = self.placements.get(arg, R)
        return R if isinstance(placement, tuple) else placement

    def sizes(self, arg: fx.Node) -> tuple[sympy.Expr, ...]:
        return get_shape(arg).tensor.sizes

    def ndim(self, arg: fx.Node) -> int:
        return len(self.sizes(arg))

    def out_sizes(self) -> tuple[sympy.Expr, ...]:
        return get_shape(self.node).tensor.sizes

    def divisible(self, size: sympy.Expr, blocks: int = 1) -> bool:
        """Whether a size splits into ``blocks`` x degree equal parts.

        A symbolic size (the sequence length) is judged at the example's value, and only with sequence
        parallelism: the runtime checks every step's length again.
        """
        if size.is_Integer:
            return int(size) % (blocks * self.degree) == 0
        if self.sequence_parallel and self.example_sizes is not None:
            value = size.subs({s: self.example_sizes.get(s.name, 0) for s in size.free_symbols})
            return value.is_Integer and int(value) > 0 and int(value) % (blocks * self.degree) == 0
        return False

    def tensor_inputs(self) -> list[fx.Node]:
        return [a for a in self.node.all_input_nodes if _is_tensor(a)]

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        if len(self.node.args) > index:
            return self.node.args[index]
        return self.node.kwargs.get(name, default)


def _is_tensor(node: fx.Node) -> bool:
    shape = get_shape(node)
    return shape.scalar is None and len(shape.tensors) == 1 and shape.tensors[0] is not None


def _norm(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def replicate_all(ctx: RuleInput) -> Decision:
    """The fallback: every tensor input replicated, every output replicated."""
    want = {a: R for a in ctx.tensor_inputs() if ctx.p(a) != R}
    tensors = get_shape(ctx.node).tensors
    out = tuple(R for _ in tensors) if len(tensors) > 1 else R
    return Decision(out, want)


def sequence_dim(sizes: Sequence[sympy.Expr]) -> int | None:
    """The dimension whose size is the sequence symbol S, if any."""
    return next((i for i, size in enumerate(sizes) if isinstance(size, sympy.Symbol) and size.name == "S"), None)


def _no_output(ctx: RuleInput) -> Decision:
    return Decision(R)  # metadata checks and creation ops: nothing to shard, nothing wanted


def _pointwise(linear: bool) -> Callable[[RuleInput], Decision]:
    """Elementwise ops, broadcasting from the right. ``linear``: a sum of partial values stays partial."""

    def rule(ctx: RuleInput) -> Decision:
        inputs = ctx.tensor_inputs()
        out_nd = len(ctx.out_sizes())
        placements = [ctx.p(a) for a in inputs]
        want: dict[fx.Node, Placement] = {}
        if any(isinstance(p, Partial) for p in placements):
            if linear and _linear_in_partials(ctx, inputs, placements):
                return Decision(P)
            want.update({a: R for a, p in zip(inputs, placements) if isinstance(p, Partial)})
            placements = [R if isinstance(p, Partial) else p for p in placements]
        target = None
        for a, p in zip(inputs, placements):
            if isinstance(p, Shard):
                target = (p.dim + out_nd - ctx.ndim(a), p.blocks)
                break
        if target is None:
            return Decision(R, want)
        dim, blocks = target
        if not ctx.divisible(ctx.out_sizes()[dim], blocks):
            return replicate_all(ctx)
        for a, p in zip(inputs, placements):
            local_dim = dim - (out_nd - ctx.ndim(a))
            if local_dim < 0 or ctx.sizes(a)[local_dim] == 1:
                if isinstance(p, Shard):
                    want[a] = R
                continue  # broadcast along the sharded dimension
            if p != Shard(local_dim, blocks):
                want[a] = Shard(local_dim, blocks)
        return Decision(Shard(dim, blocks), want)

    return rule


def _linear_in_partials(ctx: RuleInput, inputs: list[fx.Node], placements: list[Placement]) -> bool:
    """Whether the op maps partial values to partial values: a sum of partials, or a partial scaled."""
    target = ctx.node.target
    args = ctx.node.args
    tensor_args = [a for a in args if isinstance(a, fx.Node)]
    if target in (aten.add.Tensor, aten.sub.Tensor):
        return len(tensor_args) == len(args) == 2 and all(isinstance(p, Partial) for p in placements)
    if target in (aten.mul.Tensor, aten.div.Tensor):
        return len(tensor_args) == 1 and (target == aten.mul.Tensor or tensor_args[0] is args[0])
    return len(inputs) == 1  # unary: neg, dtype casts, contiguous, clone


def view_groups(a: Sequence[sympy.Expr], b: Sequence[sympy.Expr]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Group the dimensions of a view's input ``a`` and output ``b`` into runs of equal products."""
    probe = {}

    def value(size: sympy.Expr | int) -> int:
        size = sympy.sympify(size)
        for sym in sorted(size.free_symbols, key=str):
            probe.setdefault(sym, _PROBE[len(probe) % len(_PROBE)])
        return int(size.subs(probe)) if size.free_symbols else int(size)

    va, vb = [value(s) for s in a], [value(s) for s in b]
    groups, i, j = [], 0, 0
    while i < len(va) or j < len(vb):
        if i < len(va) and va[i] == 1 and (j >= len(vb) or vb[j] != 1):
            groups.append(((i,), ()))
            i += 1
            continue
        if j < len(vb) and vb[j] == 1 and (i >= len(va) or va[i] != 1):
            groups.append(((), (j,)))
            j += 1
            continue
        ins, outs = [i], [j]
        pa, pb = va[i], vb[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ins.append(i)
                pa *= va[i]
                i += 1
            else:
                outs.append(j)
                pb *= vb[j]
                j += 1
        groups.append((tuple(ins), tuple(outs)))
    return groups


def _view(ctx: RuleInput) -> Decision:
    x = ctx.node.args[0]
    p = ctx.p(x)
    if not isinstance(p, Shard):
        return Decision(p)
    in_sizes, out_sizes = ctx.sizes(x), ctx.out_sizes()
    for ins, outs in view_groups(in_sizes, out_sizes):
        if p.dim not in ins:
            continue
        if len(ins) == 1 and len(outs) == 1:
            return Decision(Shard(outs[0], p.blocks))
        if p.blocks == 1 and p.dim == ins[0] and outs and ctx.divisible(out_sizes[outs[0]]):
            return Decision(Shard(outs[0]))  # split or merge: the outermost dimension carries the shard
    return replicate_all(ctx)


def _transpose(ctx: RuleInput) -> Decision:
    x, d0, d1 = ctx.node.args[:3]
    p = ctx.p(x)
    if not isinstance(p, Shard):
        return Decision(p)
    nd = ctx.ndim(x)
    d0, d1 = _norm(d0, nd), _norm(d1, nd)
    dim = d1 if p.dim == d0 else d0 if p.dim == d1 else p.dim
    return Decision(Shard(dim, p.blocks))


def _t(ctx: RuleInput) -> Decision:
    p = ctx.p(ctx.node.args[0])
    return Decision(Shard(1 - p.dim, p.blocks) if isinstance(p, Shard) else p)


def _permute(ctx: RuleInput) -> Decision:
    x, dims = ctx.node.args[:2]
    p = ctx.p(x)
    if not isinstance(p, Shard):
        return Decision(p)
    nd = ctx.ndim(x)
    return Decision(Shard([_norm(d, nd) for d in dims].index(p.dim), p.blocks))


def _unsqueeze(ctx: RuleInput) -> Decision:
    x, dim = ctx.node.args[:2]
    p = ctx.p(x)
    if not isinstance(p, Shard):
        return Decision(p)
    dim = _norm(dim, ctx.ndim(x) + 1)
    return Decision(Shard(p.dim + (p.dim >= dim), p.blocks))


def _squeeze_dim(ctx: RuleInput) -> Decision:
    x, dim = ctx.node.args[:2]
    p = ctx.p(x)
    if not isinstance(p, Shard):
        return Decision(p)
    dim = _norm(dim, ctx.ndim(x))
    return Decision(Shard(p.dim - (p.dim > dim), p.blocks))


def _expand(ctx: RuleInput) -> Decision:
    x = ctx.node.args[0]
    p = ctx.p(x)
    if not isinstance(p, Shard):
        return Decision(p)
    return Decision(Shard(p.dim + len(ctx.out_sizes()) - ctx.ndim(x), p.blocks))


def _slice(ctx: RuleInput) -> Decision:
    x = ctx.node.args[0]
    p = ctx.p(x)
    nd = ctx.ndim(x)
    dim = _norm(ctx.arg(1, "dim", 0), nd)
    if not isinstance(p, Shard) or p.dim != dim:
        return Decision(p)
    start, end, step = ctx.arg(2, "start"), ctx.arg(3, "end"), ctx.arg(4, "step", 1)
    whole = start in (None, 0) and step == 1 and (end is None or (isinstance(end, int) and end >= 2**62))
    return Decision(p) if whole else replicate_all(ctx)


def _select(ctx: RuleInput) -> Decision:
    x, dim = ctx.node.args[:2]
    p = ctx.p(x)
    if not isinstance(p, Shard):
        return Decision(p)
    dim = _norm(dim, ctx.ndim(x))
    if p.dim == dim:
        return replicate_all(ctx)
    return Decision(Shard(p.dim - (p.dim > dim), p.blocks))


def _split(ctx: RuleInput) -> Decision:
    x = ctx.node.args[0]
    p = ctx.p(x)
    n = len(get_shape(ctx.node).tensors)
    nd = ctx.ndim(x)
    dim = _norm(ctx.arg(2, "dim", 0), nd)
    if not isinstance(p, Shard):
        return Decision(tuple(p for _ in range(n)))
    if p.dim != dim:
        return Decision(tuple(p for _ in range(n)))
    sizes = [t.sizes[dim] for t in get_shape(ctx.node).tensors]
    equal = len(set(sizes)) == 1 and all(ctx.divisible(s) for s in sizes)
    if equal and p.blocks == n:
        return Decision(tuple(Shard(dim) for _ in range(n)), note="fused projection split into its parts")
    if equal and n > 1:
        return Decision(tuple(Shard(dim) for _ in range(n)), want={x: Shard(dim, n)})
    return replicate_all(ctx)


def _getitem(ctx: RuleInput) -> Decision:
    source, index = ctx.node.args
    placement = ctx.placements.get(source, R)
    return Decision(placement[index] if isinstance(placement, tuple) else R)


def _cat(ctx: RuleInput) -> Decision:
    tensors = ctx.node.args[0]
    nd = len(ctx.out_sizes())
    dim = _norm(ctx.arg(1, "dim", 0), nd)
    placements = [ctx.p(t) for t in tensors]
    if all(isinstance(p, Partial) for p in placements):
        return Decision(P)
    shard = next((p for p in placements if isinstance(p, Shard)), None)
    if shard is None or shard.dim == dim or shard.blocks != 1:
        return replicate_all(ctx)
    return Decision(shard, {t: shard for t, p in zip(tensors, placements) if p != shard})


def matmul_dims(target: Any) -> tuple[int, int, int] | None:
    """(index of x, index of the weight, weight's output-feature dim) for the matmul-like ops."""
    return {
        aten.linear.default: (0, 1, 0),
        aten.addmm.default: (1, 2, 1),
        aten.mm.default: (0, 1, 1),
    }.get(target)


def _matmul_weight(ctx: RuleInput) -> Decision:
    """linear(x, W[n,k], b), addmm(b, x, W[k,n]), mm(x, W[k,n]): column- or row-parallel by W's shard."""
    xi, wi, n_dim = matmul_dims(ctx.node.target)
    k_dim = 1 - n_dim
    x, w = ctx.node.args[xi], ctx.node.args[wi]
    bias = ctx.node.args[0] if ctx.node.target == aten.addmm.default else ctx.arg(2, "bias")
    px, pw = ctx.p(x), ctx.p(w)
    last = ctx.ndim(x) - 1
    want: dict[fx.Node, Placement] = {}
    if isinstance(px, Partial):
        want[x], px = R, R
    if isinstance(pw, Partial):
        want[w], pw = R, R
    if isinstance(pw, Shard) and pw.dim == n_dim:  # column-parallel
        if px != R:
            want[x] = R
        if isinstance(bias, fx.Node) and ctx.p(bias) != Shard(0, pw.blocks):
            want[bias] = Shard(0, pw.blocks)
        return Decision(Shard(last, pw.blocks), want, "column-parallel")
    if isinstance(pw, Shard) and pw.dim == k_dim and pw.blocks == 1:  # row-parallel
        if px != Shard(last):
            want[x] = Shard(last)
        if isinstance(bias, fx.Node):
            if ctx.p(bias) != R:
                want[bias] = R
            if ctx.sequence_parallel:  # each rank adds bias / tp: the reduce-scatter sums them to the bias
                return Decision(P, want, "row-parallel, bias split over the ranks")
            return Decision(R, want, "row-parallel, bias added after the all-reduce")
        return Decision(P, want, "row-parallel")
    if isinstance(pw, Shard):
        return replicate_all(ctx)
    if isinstance(px, Shard) and px.dim != last:
        if isinstance(bias, fx.Node) and ctx.p(bias) != R:
            want[bias] = R
        return Decision(px, want)  # rows (batch or sequence) sharded, the weight whole
    if isinstance(px, Shard):
        want[x] = R
    if isinstance(bias, fx.Node) and ctx.p(bias) != R:
        want[bias] = R
    return Decision(R, want)


def _bmm(ctx: RuleInput) -> Decision:
    """bmm / matmul of two activations [..., m, k] @ [..., k, n] with equal ranks."""
    a, b = ctx.node.args[:2]
    if ctx.ndim(a) != ctx.ndim(b) or ctx.ndim(a) < 2:
        return replicate_all(ctx)
    nd = ctx.ndim(a)
    pa, pb = ctx.p(a), ctx.p(b)
    if isinstance(pa, Partial) or isinstance(pb, Partial):
        return replicate_all(ctx)
    if isinstance(pa, Shard) and pa.dim < nd - 2:  # batch dims (heads) sharded alike
        return Decision(pa, {} if pb == pa else {b: pa})
    if isinstance(pb, Shard) and pb.dim < nd - 2:
        return Decision(pb, {a: pb})
    if pa == Shard(nd - 1) and pb == Shard(nd - 2):
        return Decision(P)
    if isinstance(pa, Shard) and pa.dim == nd - 2 and pb == R:
        return Decision(pa)
    if pa == R and pb == Shard(nd - 1):
        return Decision(pb)
    return replicate_all(ctx)


def _embedding(ctx: RuleInput) -> Decision:
    w, ids = ctx.node.args[:2]
    pw, pi = ctx.p(w), ctx.p(ids)
    out_nd = len(ctx.out_sizes())
    if pw == Shard(0):
        return Decision(P, {} if pi == R else {ids: R}, "vocab-parallel")
    if pw == Shard(1):
        return Decision(Shard(out_nd - 1), {} if pi == R else {ids: R})
    if isinstance(pi, Shard):
        return Decision(pi, {} if pw == R else {w: R})
    return replicate_all(ctx)


def _sdpa(ctx: RuleInput) -> Decision:
    """scaled_dot_product_attention(q, k, v, mask) on [B, H, S, D]: heads sharded, or batch."""
    q, k, v = ctx.node.args[:3]
    mask = ctx.arg(3, "attn_mask")
    placements = [ctx.p(t) for t in (q, k, v)]
    if any(isinstance(p, Shard) and p.dim == 1 for p in placements):
        heads = [ctx.sizes(t)[1] for t in (q, k, v)]
        if all(ctx.divisible(h) for h in heads) and ctx.sizes(q)[1] == ctx.sizes(k)[1]:
            want = {t: Shard(1) for t, p in zip((q, k, v), placements) if p != Shard(1)}
            if isinstance(mask, fx.Node):
                per_head = ctx.ndim(mask) == 4 and ctx.sizes(mask)[1] != 1
                target = Shard(1) if per_head else R
                if ctx.p(mask) != target:
                    want[mask] = target
            return Decision(Shard(1), want, "attention sharded by heads")
    return replicate_all(ctx)


def _layer_norm(ctx: RuleInput) -> Decision:
    x, normalized = ctx.node.args[:2]
    p = ctx.p(x)
    params = [a for a in ctx.node.args[2:4] if isinstance(a, fx.Node)]
    if isinstance(p, Shard) and p.dim < ctx.ndim(x) - len(normalized):
        return Decision(p, {a: R for a in params if ctx.p(a) != R})
    return replicate_all(ctx)


def _reduce_dims(ctx: RuleInput) -> Decision:
    """mean.dim / sum.dim_IntList / amax: fine while the sharded dimension is not reduced."""
    x = ctx.node.args[0]
    p = ctx.p(x)
    nd = ctx.ndim(x)
    dims = ctx.arg(1, "dim")
    dims = list(range(nd)) if dims is None else [_norm(d, nd) for d in (dims if isinstance(dims, list) else [dims])]
    keepdim = ctx.arg(2, "keepdim", False)
    if isinstance(p, Shard) and p.dim not in dims:
        return Decision(Shard(p.dim if keepdim else p.dim - sum(d < p.dim for d in dims), p.blocks))
    if isinstance(p, Partial) and ctx.node.target in (aten.sum.dim_IntList, aten.mean.dim):
        return Decision(P)
    return replicate_all(ctx) if p != R else Decision(R)


def _softmax(ctx: RuleInput) -> Decision:
    x, dim = ctx.node.args[:2]
    p = ctx.p(x)
    if isinstance(p, Shard) and p.dim != _norm(dim, ctx.ndim(x)):
        return Decision(p)
    return replicate_all(ctx)


def _cross_entropy(ctx: RuleInput) -> Decision:
    """cross_entropy_loss(logits [N, C], target [N]): with classes sharded, Megatron's vocab-parallel loss."""
    logits, target = ctx.node.args[:2]
    plain = (
        ctx.arg(2, "weight") is None
        and ctx.arg(5, "label_smoothing", 0.0) == 0.0
        and ctx.arg(3, "reduction", 1) in (0, 1, 2)
        and ctx.ndim(logits) == 2
    )
    if plain and ctx.p(logits) == Shard(1):
        return Decision(R, {} if ctx.p(target) == R else {target: R}, "vocab-parallel cross-entropy")
    return replicate_all(ctx)


def _pad(ctx: RuleInput) -> Decision:
    x, pads = ctx.node.args[:2]
    p = ctx.p(x)
    nd = ctx.ndim(x)
    padded = {nd - 1 - i // 2 for i in range(len(pads))}
    if isinstance(p, Shard) and p.dim not in padded:
        return Decision(p)
    return replicate_all(ctx) if p != R else Decision(R)


def _sym_size(ctx: RuleInput) -> Decision:
    return Decision(R)  # a size of the full tensor; the rewrite keeps it global


RULES: dict[Any, Callable[[RuleInput], Decision]] = {}


def _register(rule: Callable[[RuleInput], Decision], *ops: Any) -> None:
    for op in ops:
        RULES[op] = rule


_register(
    _pointwise(linear=True),
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.neg.default,
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.contiguous.default,
    aten.clone.default, aten.alias.default, aten.type_as.default,
)  # fmt: skip
_register(
    _pointwise(linear=False),
    aten.gelu.default, aten.silu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default,
    aten.exp.default, aten.log.default, aten.sqrt.default, aten.rsqrt.default, aten.pow.Tensor_Scalar,
    aten.pow.Tensor_Tensor, aten.erf.default, aten.cos.default, aten.sin.default, aten.abs.default,
    aten.dropout.default, aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
    aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.le.Tensor, aten.le.Scalar,
    aten.lt.Tensor, aten.lt.Scalar, aten.ge.Tensor, aten.ge.Scalar, aten.gt.Tensor, aten.gt.Scalar,
    aten.__and__.Tensor, aten.__or__.Tensor, aten.bitwise_not.default, aten.logical_not.default,
    aten.detach.default, aten.maximum.default, aten.minimum.default, aten.clamp.default,
)  # fmt: skip
_register(_view, aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints)
_register(_transpose, aten.transpose.int)
_register(_t, aten.t.default)
_register(_permute, aten.permute.default)
_register(_unsqueeze, aten.unsqueeze.default)
_register(_squeeze_dim, aten.squeeze.dim)
_register(_expand, aten.expand.default)
_register(_slice, aten.slice.Tensor)
_register(_select, aten.select.int)
_register(_split, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
_register(_getitem, operator.getitem)
_register(_cat, aten.cat.default)
_register(_matmul_weight, aten.linear.default, aten.addmm.default, aten.mm.default)
_register(_bmm, aten.bmm.default, aten.matmul.default)
_register(_embedding, aten.embedding.default)
_register(_sdpa, aten.scaled_dot_product_attention.default)
_register(_layer_norm, aten.layer_norm.default)
_register(_reduce_dims, aten.mean.dim, aten.sum.dim_IntList, aten.amax.default)
_register(_softmax, aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
_register(_cross_entropy, aten.cross_entropy_loss.default)
_register(_pad, aten.pad.default, aten.constant_pad_nd.default)
_register(_sym_size, aten.sym_size.int)
_register(
    _no_output,
    aten._assert_tensor_metadata.default, aten.arange.default, aten.arange.start, aten.full.default,
    aten.zeros.default, aten.ones.default, aten.empty.memory_format, aten.scalar_tensor.default,
)  # fmt: skip
