"""What a sharding rule reads and answers: ``RuleInput`` (the node, its inputs' placements, the degree)
and ``Decision`` (the output placement, the placements it wants its inputs in), and the helpers the
families share. The rules themselves live one op family a module (autoshard/sharding/*.py).
"""

from __future__ import annotations

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
    "Decision",
    "Rule",
    "RuleInput",
    "fits_ranks",
    "norm_dim",
    "replicate_all",
    "sequence_dim",
    "table",
]

aten = torch.ops.aten
R = Replicate()
P = Partial()
Out = Placement | tuple[Placement, ...]


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


Rule = Callable[[RuleInput], Decision]


def table(*entries: tuple[Rule, tuple[Any, ...]]) -> dict[Any, Rule]:
    """A family's rules by overload: (rule, the overloads it decides) pairs."""
    return {op: rule for rule, ops in entries for op in ops}
