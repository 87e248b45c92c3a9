"""Whole-model costs: the per-node costs of passes.cost_model summed per layer and in total, as sympy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy
from torch import fx

from autoshard.ir.meta import evaluate_expr, get_cost, get_layer

__all__ = ["LayerCost", "ModelCost", "summarize"]


@dataclass(frozen=True)
class LayerCost:
    name: str
    flops_fwd: sympy.Expr
    flops_bwd: sympy.Expr
    param_bytes: int
    activation_bytes: sympy.Expr


@dataclass(frozen=True)
class ModelCost:
    """FLOPs and bytes of one training step of the whole model, in the batch (B) and sequence (S) symbols.

    ``evaluate(B=8, S=128)`` gives the same record with numbers.
    """

    flops_fwd: sympy.Expr
    flops_bwd: sympy.Expr
    param_bytes: int
    activation_bytes: sympy.Expr
    layers: tuple[LayerCost, ...]
    # What autograd keeps for backward per call of each graph this rank runs ("graph", or "stage <i>"),
    # after the plan's rewrites and recomputation (passes.saved_tensors); filled in by compile.
    saved_for_backward: tuple[tuple[str, Any], ...] = ()

    @property
    def symbols(self) -> tuple[str, ...]:
        free = set()
        for expr in (self.flops_fwd, self.flops_bwd, self.activation_bytes):
            free |= {s.name for s in sympy.sympify(expr).free_symbols}
        return tuple(sorted(free))

    def evaluate(self, **sizes: int) -> ModelCost:
        def ev(expr: sympy.Expr) -> sympy.Integer:
            return sympy.Integer(evaluate_expr(expr, sizes))

        return ModelCost(
            flops_fwd=ev(self.flops_fwd),
            flops_bwd=ev(self.flops_bwd),
            param_bytes=self.param_bytes,
            activation_bytes=ev(self.activation_bytes),
            layers=tuple(
                LayerCost(lc.name, ev(lc.flops_fwd), ev(lc.flops_bwd), lc.param_bytes, ev(lc.activation_bytes))
                for lc in self.layers
            ),
        )

    def __str__(self) -> str:
        return (
            f"ModelCost(flops_fwd={self.flops_fwd}, flops_bwd={self.flops_bwd}, "
            f"param_bytes={self.param_bytes}, activation_bytes={self.activation_bytes})"
        )


def summarize(gm: fx.GraphModule) -> ModelCost:
    """Sum node costs per layer (in graph order) and in total; needs layer_assign and cost_model."""
    zero = sympy.Integer(0)
    order: list[str] = []
    acc: dict[str, list] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        cost, layer = get_cost(node), get_layer(node)
        if layer not in acc:
            order.append(layer)
            acc[layer] = [zero, zero, 0, zero]
        a = acc[layer]
        a[0] += cost.flops_fwd
        a[1] += cost.flops_bwd
        a[2] += cost.param_bytes
        a[3] += cost.activation_bytes
    layers = tuple(
        LayerCost(name, sympy.expand(a[0]), sympy.expand(a[1]), a[2], sympy.expand(a[3]))
        for name in order
        for a in [acc[name]]
    )
    return ModelCost(
        flops_fwd=sympy.expand(sum((lc.flops_fwd for lc in layers), zero)),
        flops_bwd=sympy.expand(sum((lc.flops_bwd for lc in layers), zero)),
        param_bytes=sum(lc.param_bytes for lc in layers),
        activation_bytes=sympy.expand(sum((lc.activation_bytes for lc in layers), zero)),
        layers=layers,
    )
