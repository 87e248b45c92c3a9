"""Sharding rules of ops that move, cut and join dimensions: views, transposes, slices, splits, cat, pad.

A view groups its input's and output's dimensions into runs of equal products (``view_groups``); a
shard moves with its run when the run keeps its outermost dimension.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence

import sympy
import torch
from torch import fx

from autoshard.ir.meta import get_shape
from autoshard.ir.placements import Partial, Shard
from autoshard.sharding.rule import Decision, P, R, RuleInput, norm_dim, replicate_all, table

__all__ = ["RULES", "view_groups"]

aten = torch.ops.aten

# Symbols take these stand-in values when view dimensions are grouped by size (any distinct primes
# larger than every static size would do: they only decide which products are equal).
_PROBE = tuple(p * 2**12 for p in (1000003, 1000033, 1000037, 1000039))  # (x 2^12: S / cp stays whole)


def view_groups(a: Sequence[sympy.Expr], b: Sequence[sympy.Expr]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Group the dimensions of a view's input ``a`` and output ``b`` into runs of equal products."""
    return list(_view_groups(tuple(a), tuple(b)))


@functools.lru_cache(maxsize=1 << 14)
def _view_groups(a: tuple[sympy.Expr, ...], b: tuple[sympy.Expr, ...]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    # A pure function of the sizes, and a model's blocks repeat the same few views: a large model's placement
    # evaluated the same sympy substitutions hundreds of thousands of times.
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
    return tuple(groups)


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
    if ctx.sizes(x)[dim] != 1:  # nothing to squeeze: the op keeps every dimension, unless a rank's part is 1
        return replicate_all(ctx) if p.dim == dim else Decision(p)
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
    return Decision(R)  # the full tensor's size: passes.tp_rewrite scales a sharded dimension's back up


def _no_output(ctx: RuleInput) -> Decision:
    return Decision(R)  # metadata checks and creation ops: nothing to shard, nothing wanted


def _pad(ctx: RuleInput) -> Decision:
    x, pads = ctx.node.args[:2]
    p = ctx.p(x)
    nd = ctx.ndim(x)
    padded = {nd - 1 - i // 2 for i in range(len(pads))}
    if isinstance(p, Shard) and p.dim not in padded:
        return Decision(p)
    return replicate_all(ctx) if p != R else Decision(R)


RULES = table(
    (_view, (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints)),
    (_transpose, (aten.transpose.int,)),
    (_t, (aten.t.default,)),
    (_permute, (aten.permute.default,)),
    (_unsqueeze, (aten.unsqueeze.default,)),
    (_squeeze_dim, (aten.squeeze.dim,)),
    (_expand, (aten.expand.default,)),
    (_slice, (aten.slice.Tensor,)),
    (_select, (aten.select.int,)),
    (_split, (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)),
    (_getitem, (operator.getitem,)),
    (_cat, (aten.cat.default,)),
    (_sym_size, (aten.sym_size.int,)),
    (_pad, (aten.pad.default, aten.constant_pad_nd.default)),
    (
        _no_output,
        (
            aten._assert_tensor_metadata.default, aten.arange.default, aten.arange.start, aten.full.default,
            aten.zeros.default, aten.ones.default, aten.empty.memory_format, aten.scalar_tensor.default,
        ),
    ),
)  # fmt: skip
