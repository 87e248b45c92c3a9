"""Per-node costs: forward and backward FLOPs, parameter bytes and activation bytes, as sympy.

Reads:  autoshard.shape
Writes: autoshard.ir.cost (meta.NodeCost) on every node but the output

FLOPs follow the convention of ``torch.utils.flop_counter``: matrix-multiply class work only
(mm, addmm, bmm, baddbmm, matmul, linear, convolution, scaled-dot-product attention, and the grouped
matmuls of mixture-of-experts layers: aten._grouped_mm and the fallback op transformers registers),
two FLOPs a multiply-add. Elementwise work is memory bound and shows up as activation bytes instead.
Backward FLOPs: one forward-sized product per operand that needs a gradient (dX = dY Wᵀ and
dW = Xᵀ dY), and twice the forward for attention (dP, dQ, dK, dV). Activation bytes are the bytes
of every non-view tensor the forward computes on the gradient path: an upper bound of what
autograd saves. Parameter bytes are counted once per parameter, at its first get_attr.
"""

from __future__ import annotations

from collections.abc import Callable

import sympy
import torch
from torch import fx

from autoshard.ir.meta import COST, SHAPE, NodeCost, TensorShape, get_shape
from autoshard.ir.ops import ALIASING, packet

from .infra import Need, Pass, PassResult

__all__ = ["FLOP_RULES", "NAMED_FLOP_RULES", "PASS", "run"]

aten = torch.ops.aten

Operands = list[TensorShape | None]
FlopRule = Callable[[fx.Node, Operands, TensorShape], tuple[sympy.Expr, sympy.Expr]]


def _operand_shapes(node: fx.Node) -> Operands:
    shapes: Operands = []
    for arg in node.args:
        if isinstance(arg, fx.Node):
            s = get_shape(arg)
            shapes.append(s.tensors[0] if len(s.tensors) == 1 else None)
        else:
            shapes.append(None)
    return shapes


def _grad_factor(*operands: TensorShape | None) -> int:
    return sum(1 for t in operands if t is not None and t.requires_grad)


def _contracted(out: TensorShape, k: sympy.Expr, *grad_operands: TensorShape | None) -> tuple[sympy.Expr, sympy.Expr]:
    fwd = 2 * out.numel * k
    return fwd, fwd * _grad_factor(*grad_operands)


def _mm(node: fx.Node, ops: Operands, out: TensorShape) -> tuple[sympy.Expr, sympy.Expr]:
    a, b = ops[0], ops[1]  # mm/bmm/matmul: (a, b); contraction over a's last dim
    return _contracted(out, a.sizes[-1], a, b)


def _addmm(node: fx.Node, ops: Operands, out: TensorShape) -> tuple[sympy.Expr, sympy.Expr]:
    a, b = ops[1], ops[2]  # addmm/baddbmm: (bias, a, b)
    return _contracted(out, a.sizes[-1], a, b)


def _linear(node: fx.Node, ops: Operands, out: TensorShape) -> tuple[sympy.Expr, sympy.Expr]:
    x, w = ops[0], ops[1]
    return _contracted(out, w.sizes[-1], x, w)


def _conv(node: fx.Node, ops: Operands, out: TensorShape) -> tuple[sympy.Expr, sympy.Expr]:
    x, w = ops[0], ops[1]  # w: [C_out, C_in / groups, *kernel]
    return _contracted(out, sympy.Mul(*w.sizes[1:]), x, w)


def _attention(node: fx.Node, ops: Operands, out: TensorShape) -> tuple[sympy.Expr, sympy.Expr]:
    q, k, v = ops[0], ops[1], ops[2]  # [..., L, E], [..., S, E], [..., S, Ev]
    length_q, e = q.sizes[-2], q.sizes[-1]
    length_kv, ev = k.sizes[-2], v.sizes[-1]
    batch_heads = sympy.Mul(*q.sizes[:-2])
    fwd = 2 * batch_heads * length_q * length_kv * (e + ev)
    needs_grad = any(t is not None and t.requires_grad for t in (q, k, v))
    return fwd, 2 * fwd if needs_grad else sympy.Integer(0)


def _grouped_mm(node: fx.Node, ops: Operands, out: TensorShape) -> tuple[sympy.Expr, sympy.Expr]:
    """A grouped matmul (x[rows, K] by weights[E, K, N], rows sorted by group, ``offs`` their ends): each row
    meets its own group's matrix, so the work is that of x @ one [K, N] matrix, whatever the groups' sizes
    (a mixture of experts costs its active experts only). Both operands 2-D (the output [E, K, N], one
    product a group over its rows): K x N x rows."""
    a, b = ops[0], ops[1]
    if len(a.sizes) == 2 and len(b.sizes) == 2:
        fwd = 2 * out.sizes[-2] * out.sizes[-1] * a.sizes[-1]
        return fwd, fwd * _grad_factor(a, b)
    return _contracted(out, a.sizes[-1], a, b)


FLOP_RULES: dict[object, FlopRule] = {
    aten.mm: _mm,
    aten.bmm: _mm,
    aten.matmul: _mm,
    aten.addmm: _addmm,
    aten.baddbmm: _addmm,
    aten.linear: _linear,
    aten.conv1d: _conv,
    aten.conv2d: _conv,
    aten.conv3d: _conv,
    aten.convolution: _conv,
    aten.scaled_dot_product_attention: _attention,
    aten._scaled_dot_product_flash_attention: _attention,
    aten._scaled_dot_product_efficient_attention: _attention,
    aten._scaled_dot_product_flash_attention_for_cpu: _attention,
    aten._grouped_mm: _grouped_mm,
}
# Ops of other libraries, by qualified name (importing the library to key them by object is not this
# pass's business): transformers' grouped matmul for weights _grouped_mm does not take (fp32, CPU).
NAMED_FLOP_RULES: dict[str, FlopRule] = {"transformers::grouped_mm_fallback": _grouped_mm}


def run(gm: fx.GraphModule) -> PassResult:
    zero = sympy.Integer(0)
    seen_params: set[int] = set()
    total_fwd = zero
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        shape = get_shape(node)
        flops_fwd = flops_bwd = zero
        param_bytes = 0
        activation_bytes = zero
        if node.op == "get_attr":
            try:
                param = gm.get_parameter(node.target)
            except AttributeError:
                param = None
            if param is not None and id(param) not in seen_params:
                seen_params.add(id(param))
                param_bytes = param.numel() * param.element_size()
        elif node.op == "call_function":
            op = packet(node.target)
            rule = FLOP_RULES.get(op) or NAMED_FLOP_RULES.get(getattr(op, "_qualified_op_name", ""))
            if rule is not None:
                flops_fwd, flops_bwd = rule(node, _operand_shapes(node), shape.tensors[0])
            if op not in ALIASING and isinstance(node.target, torch._ops.OpOverload):
                activation_bytes = sympy.Add(*(t.nbytes for t in shape.tensors if t is not None and t.requires_grad))
        node.meta[COST] = NodeCost(
            flops_fwd=sympy.expand(flops_fwd),
            flops_bwd=sympy.expand(flops_bwd),
            param_bytes=param_bytes,
            activation_bytes=sympy.expand(activation_bytes),
        )
        total_fwd += flops_fwd
    return PassResult("cost_model", False, f"forward FLOPs {sympy.expand(total_fwd)}")


PASS = Pass("cost_model", reads=(Need(SHAPE),), writes=(Need(COST),), run=run)
