"""Symbolic shapes: every value's sizes as sympy expressions in the batch (B) and sequence (S) symbols.

Reads:  node.meta["val"] (the FakeTensor / SymInt values torch.export records on every node)
Writes: autoshard.shape (meta.NodeShape) on every node but the output

torch.export names its symbols after their sources (``s72``); ``rename`` maps them to the names
people read (``B``, ``S``). A size read from the data (``nonzero`` of ``ids == e``: the tokens a loop over
experts routes to expert ``e``) is given its expectation, the mask's elements over the experts compared
against the same ids (balanced routing); the PassResult says so, and the planner sizes such a model by
it. A tensor requires grad when it is a trainable parameter or is computed from one; this decides which
backward work the cost model counts.
"""

from __future__ import annotations

from collections.abc import Mapping

import sympy
import torch
from torch import fx
from torch.utils import _pytree as pytree

from autoshard.ir.meta import SHAPE, NodeShape, TensorShape, get_shape

from .infra import Need, Pass, PassResult

__all__ = ["PASS", "run", "to_expr"]


def to_expr(size: int | torch.SymInt, rename: Mapping[sympy.Symbol, sympy.Symbol]) -> sympy.Expr:
    if isinstance(size, torch.SymInt):
        return sympy.sympify(size.node.expr).xreplace(dict(rename))
    return sympy.Integer(int(size))


def _inputs_require_grad(node: fx.Node) -> bool:
    for arg in node.all_input_nodes:
        if get_shape(arg).requires_grad:
            return True
    return False


def _param_requires_grad(gm: fx.GraphModule, target: str) -> bool:
    try:
        return gm.get_parameter(target).requires_grad
    except AttributeError:
        return False  # a buffer or constant


_NONZERO = (torch.ops.aten.nonzero.default, torch.ops.aten.where.default)


def _expected(node: fx.Node, val: object, rename: dict[sympy.Symbol, sympy.Expr]) -> dict[sympy.Symbol, sympy.Expr]:
    """The expected value of each size ``node`` reads from the data, where it is the count of one of several
    equality masks over the same tensor (``nonzero(ids == e)``, e = 0..E-1): numel(ids) / E. {} otherwise."""
    if node.target not in _NONZERO or len(node.args) != 1 or not isinstance(node.args[0], fx.Node):
        return {}
    mask = node.args[0]
    if mask.target is not torch.ops.aten.eq.Scalar or not isinstance(mask.args[0], fx.Node):
        return {}
    ids = mask.args[0]
    parts = {u.args[1] for u in ids.users if u.target is torch.ops.aten.eq.Scalar}
    numel = get_shape(ids).tensor.numel
    out = {}
    for leaf in pytree.tree_leaves(val):
        for size in leaf.shape if isinstance(leaf, torch.Tensor) else ():
            if isinstance(size, torch.SymInt):
                symbol = sympy.sympify(size.node.expr)
                if isinstance(symbol, sympy.Symbol) and symbol not in rename:
                    out[symbol] = numel / len(parts)
    return out


def run(gm: fx.GraphModule, rename: Mapping[sympy.Symbol, sympy.Symbol] | None = None) -> PassResult:
    rename = dict(rename or {})
    symbols: set[str] = set()
    estimated: list[str] = []
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if "val" not in node.meta:
            raise ValueError(
                f"node {node.format_node()} has no 'val' meta: shape_prop reads the values torch.export "
                f"records; capture the model with autoshard.capture first"
            )
        val = node.meta["val"]
        for symbol, value in _expected(node, val, rename).items():
            rename[symbol] = value
            estimated.append(f"{symbol} ~ {value}")
        if node.op == "get_attr":
            grad_in = _param_requires_grad(gm, node.target)
        elif node.op == "placeholder":
            grad_in = False
        else:
            grad_in = _inputs_require_grad(node)
        if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
            shape = NodeShape(scalar=to_expr(val, rename))
        else:
            leaves = pytree.tree_leaves(val)
            tensors = tuple(
                TensorShape(
                    sizes=tuple(to_expr(s, rename) for s in leaf.shape),
                    dtype=leaf.dtype,
                    requires_grad=grad_in and (leaf.dtype.is_floating_point or leaf.dtype.is_complex),
                )
                if isinstance(leaf, torch.Tensor)
                else None
                for leaf in leaves
            )
            shape = NodeShape(tensors=tensors)
        for t in shape.tensors:
            if t is not None:
                symbols.update(str(s) for size in t.sizes for s in size.free_symbols)
        node.meta[SHAPE] = shape
    line = f"shapes in symbols {sorted(symbols) or 'none (all static)'}"
    if estimated:
        line += f"; sizes read from the data taken at their expectation (balanced routing): {', '.join(estimated)}"
    return PassResult("shape_prop", False, line)


PASS = Pass("shape_prop", reads=(Need("val"),), writes=(Need(SHAPE),), run=run)
