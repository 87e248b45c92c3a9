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

from autoshard.ir.meta import get_shape
from autoshard.ir.placements import Partial, Placement, Replicate, Shard

__all__ = [
    "P",
    "R",
    "RULES",
    "Decision",
    "RuleInput",
    "norm_dim",
    "register",
    "replicate_all",
    "sequence_dim",
    "view_groups",
]

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
    note: str = ""  # for people
    bias: str = ""  # a row-parallel matmul's bias: meta.BIAS_AFTER_REDUCE or meta.BIAS_SPLIT
    fallback: bool = False  # the rule's answer named a dimension its tensors lack; replicated instead


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


def _ndims(node: fx.Node) -> list[int | None]:
    """The rank of each tensor a node makes (None for a non-tensor output)."""
    shape = get_shape(node)
    if shape.scalar is not None:
        return []
    return [None if t is None else len(t.sizes) for t in shape.tensors]


def _fits_rank(placement: object, ndim: int | None) -> bool:
    return not isinstance(placement, Shard) or (ndim is not None and 0 <= placement.dim < ndim)


def fits_ranks(node: fx.Node, decision: Decision) -> bool:
    """Whether every shard a rule chose names a dimension its tensor has (a rule's blind spot otherwise)."""
    ranks = _ndims(node)
    outs = decision.out if isinstance(decision.out, tuple) else (decision.out,) * max(len(ranks), 1)
    if any(isinstance(p, Shard) for p in outs) and len(outs) != len(ranks):
        return False
    if not all(_fits_rank(p, nd) for p, nd in zip(outs, ranks)):
        return False
    for source, placement in decision.want.items():
        ranks = _ndims(source)
        if isinstance(placement, Shard) and (len(ranks) != 1 or not _fits_rank(placement, ranks[0])):
            return False
    return True


def norm_dim(dim: int, ndim: int) -> int:
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


def _moves_shard(rule: Callable[[RuleInput, fx.Node, Shard], Decision]) -> Callable[[RuleInput], Decision]:
    """A rule for ops that only rearrange dimensions: a value that is not sharded keeps its placement,
    and ``rule(ctx, x, shard)`` says where a sharded input's dimension goes."""

    def wrapped(ctx: RuleInput) -> Decision:
        x = ctx.node.args[0]
        p = ctx.p(x)
        return rule(ctx, x, p) if isinstance(p, Shard) else Decision(p)

    wrapped.__name__ = rule.__name__
    return wrapped


@_moves_shard
def _view(ctx: RuleInput, x: fx.Node, p: Shard) -> Decision:
    in_sizes, out_sizes = ctx.sizes(x), ctx.out_sizes()
    for ins, outs in view_groups(in_sizes, out_sizes):
        if p.dim not in ins:
            continue
        if len(ins) == 1 and len(outs) == 1:
            return Decision(Shard(outs[0], p.blocks))
        if p.blocks == 1 and p.dim == ins[0] and outs and ctx.divisible(out_sizes[outs[0]]):
            return Decision(Shard(outs[0]))  # split or merge: the outermost dimension carries the shard
    return replicate_all(ctx)


@_moves_shard
def _transpose(ctx: RuleInput, x: fx.Node, p: Shard) -> Decision:
    nd = ctx.ndim(x)
    d0, d1 = (norm_dim(d, nd) for d in ctx.node.args[1:3])
    return Decision(Shard(d1 if p.dim == d0 else d0 if p.dim == d1 else p.dim, p.blocks))


@_moves_shard
def _t(ctx: RuleInput, x: fx.Node, p: Shard) -> Decision:
    return Decision(Shard(1 - p.dim, p.blocks))


@_moves_shard
def _permute(ctx: RuleInput, x: fx.Node, p: Shard) -> Decision:
    dims = [norm_dim(d, ctx.ndim(x)) for d in ctx.node.args[1]]
    return Decision(Shard(dims.index(p.dim), p.blocks))


@_moves_shard
def _unsqueeze(ctx: RuleInput, x: fx.Node, p: Shard) -> Decision:
    dim = norm_dim(ctx.node.args[1], ctx.ndim(x) + 1)
    return Decision(Shard(p.dim + (p.dim >= dim), p.blocks))


@_moves_shard
def _squeeze_dim(ctx: RuleInput, x: fx.Node, p: Shard) -> Decision:
    dim = norm_dim(ctx.node.args[1], ctx.ndim(x))
    return Decision(Shard(p.dim - (p.dim > dim), p.blocks))


@_moves_shard
def _expand(ctx: RuleInput, x: fx.Node, p: Shard) -> Decision:
    return Decision(Shard(p.dim + len(ctx.out_sizes()) - ctx.ndim(x), p.blocks))


def _slice(ctx: RuleInput) -> Decision:
    x = ctx.node.args[0]
    p = ctx.p(x)
    nd = ctx.ndim(x)
    dim = norm_dim(ctx.arg(1, "dim", 0), nd)
    if not isinstance(p, Shard) or p.dim != dim:
        return Decision(p)
    start, end, step = ctx.arg(2, "start"), ctx.arg(3, "end"), ctx.arg(4, "step", 1)
    whole = start in (None, 0) and step == 1 and (end is None or (isinstance(end, int) and end >= 2**62))
    return Decision(p) if whole else replicate_all(ctx)


@_moves_shard
def _select(ctx: RuleInput, x: fx.Node, p: Shard) -> Decision:
    dim = norm_dim(ctx.node.args[1], ctx.ndim(x))
    return replicate_all(ctx) if p.dim == dim else Decision(Shard(p.dim - (p.dim > dim), p.blocks))


def _split(ctx: RuleInput) -> Decision:
    x = ctx.node.args[0]
    p = ctx.p(x)
    n = len(get_shape(ctx.node).tensors)
    nd = ctx.ndim(x)
    dim = norm_dim(ctx.arg(2, "dim", 0), nd)
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
    nd = len(ctx.out_sizes())
    # cat skips 1-D empty tensors of any other rank (the legacy ``torch.cat([torch.tensor([]), k], -2)``
    # of a key/value cache): they hold nothing to shard and stay as they are.
    tensors = [t for t in ctx.node.args[0] if not (ctx.ndim(t) != nd and ctx.sizes(t) == (0,))]
    if any(ctx.ndim(t) != nd for t in tensors):
        return replicate_all(ctx)
    dim = norm_dim(ctx.arg(1, "dim", 0), nd)
    placements = [ctx.p(t) for t in tensors]
    if all(isinstance(p, Partial) for p in placements):
        return Decision(P)
    shard = next((p for p in placements if isinstance(p, Shard)), None)
    if shard is None or shard.dim == dim or shard.blocks != 1:
        return replicate_all(ctx)
    return Decision(shard, {t: shard for t, p in zip(tensors, placements) if p != shard})


def _sym_size(ctx: RuleInput) -> Decision:
    return Decision(R)  # a size of the full tensor; the rewrite keeps it global


RULES: dict[Any, Callable[[RuleInput], Decision]] = {}


def register(rule: Callable[[RuleInput], Decision], *ops: Any) -> None:
    """Make ``rule`` the rule of every overload in ``ops``."""
    for op in ops:
        RULES[op] = rule


register(
    _pointwise(linear=True),
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.neg.default,
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.contiguous.default,
    aten.clone.default, aten.alias.default, aten.type_as.default,
)  # fmt: skip
register(
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
register(_view, aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints)
register(_transpose, aten.transpose.int)
register(_t, aten.t.default)
register(_permute, aten.permute.default)
register(_unsqueeze, aten.unsqueeze.default)
register(_squeeze_dim, aten.squeeze.dim)
register(_expand, aten.expand.default)
register(_slice, aten.slice.Tensor)
register(_select, aten.select.int)
register(_split, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
register(_getitem, operator.getitem)
register(_cat, aten.cat.default)
register(_sym_size, aten.sym_size.int)
register(
    _no_output,
    aten._assert_tensor_metadata.default, aten.arange.default, aten.arange.start, aten.full.default,
    aten.zeros.default, aten.ones.default, aten.empty.memory_format, aten.scalar_tensor.default,
)  # fmt: skip

# The compute ops' rules (matmuls, embedding, attention, norms, reductions, loss) register themselves.
