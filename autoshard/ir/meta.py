"""The node.meta contract: namespaced keys, frozen records, and accessors that fail loudly.

Analysis passes write these keys; later passes and the runtime read them only through the
accessors below, which say which pass to run when a key is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch import fx

from autoshard.errors import MissingMetaError
from autoshard.ir.placements import Shard

__all__ = [
    "MASK",
    "MODEL_ATTR",
    "MODEL_PREFIX",
    "MaskSpec",
    "RECOMPUTE",
    "SAVED",
    "NodeSaves",
    "USER_RECOMPUTE",
    "RecomputeRegion",
    "BIAS_AFTER_REDUCE",
    "BIAS_SPLIT",
    "COST",
    "PRODUCERS",
    "GRAD_BUCKET",
    "LAYER",
    "SHAPE",
    "STAGE",
    "TP",
    "TP_COMM",
    "TpCollective",
    "TpPlacement",
    "ZERO3",
    "ZERO_GROUP",
    "FlatSlot",
    "EXPERT",
    "CP",
    "CpPlacement",
    "ExpertLayer",
    "ExpertSplit",
    "get_expert",
    "NO_COST",
    "NodeCost",
    "NodeShape",
    "PIPE",
    "PipeSlot",
    "TensorShape",
    "Zero3Gather",
    "evaluate_expr",
    "get_cost",
    "get_grad_bucket",
    "get_layer",
    "get_shape",
    "get_stage",
    "get_tp",
    "get_zero3_gather",
    "get_zero_group",
]

# Every captured graph is the capture wrapper's (capture._ModelWithLoss), which holds the user's model as
# its submodule ``model``: the model's parameters are get_attr targets ``model.<name>`` and its module
# paths in nn_module_stack start with ``model``.
MODEL_ATTR = "model"
MODEL_PREFIX = MODEL_ATTR + "."

# The node.meta keys, each written by one pass (PRODUCERS below).
(
    SHAPE,
    LAYER,
    COST,
    GRAD_BUCKET,
    ZERO_GROUP,
    ZERO3,
    STAGE,
    PIPE,
    TP,
    TP_COMM,
    RECOMPUTE,
    SAVED,
    USER_RECOMPUTE,
    MASK,
    EXPERT,
    CP,
) = (
    "autoshard.shape",
    "autoshard.layer",
    "autoshard.cost",
    "autoshard.grad_bucket",
    "autoshard.zero_group",
    "autoshard.zero3",
    "autoshard.stage",
    "autoshard.pipe",
    "autoshard.tp",
    "autoshard.tp_comm",
    "autoshard.recompute",
    "autoshard.saved",
    "autoshard.user_recompute",
    "autoshard.dropout_mask",
    "autoshard.expert",
    "autoshard.cp",
)

# Who writes each key (torch.export writes "val" and "nn_module_stack" at capture).
PRODUCERS = {
    "val": "autoshard.capture",
    "nn_module_stack": "autoshard.capture",
    SHAPE: "passes.shape_prop",
    LAYER: "passes.layer_assign",
    COST: "passes.cost_model",
    GRAD_BUCKET: "passes.grad_buckets",
    ZERO_GROUP: "passes.zero_groups",
    ZERO3: "passes.zero3_gather_free",
    STAGE: "passes.pipeline_split",
    PIPE: "passes.pipeline_stages",
    TP: "passes.tp_placement",
    TP_COMM: "passes.tp_rewrite",
    RECOMPUTE: "passes.recompute",
    USER_RECOMPUTE: "autoshard.capture",
    SAVED: "passes.saved_tensors",
    MASK: "passes.dropout_masks",
    EXPERT: "passes.expert_parallel",
    CP: "passes.context_parallel",
}


def evaluate_expr(expr: sympy.Expr | int, sizes: dict[str, int | float]) -> int:
    """Evaluate a size expression for concrete symbol values (``{"B": 8, "S": 128}``)."""
    expr = sympy.sympify(expr)
    free = {s.name for s in expr.free_symbols}
    missing = sorted(free - set(sizes))
    if missing:
        raise ValueError(f"cannot evaluate {expr}: give a value for {', '.join(missing)}")
    # xreplace, not subs: a plain swap of the symbols for their values, which the rebuilt expression then
    # evaluates; subs's matching and simplification took about 8x longer (the planner evaluates thousands).
    # sympify keeps a fractional size (the planner's share of a row) a Float: Integer would truncate it.
    return int(expr.xreplace({s: sympy.sympify(sizes[s.name]) for s in expr.free_symbols}))


@dataclass(frozen=True)
class TensorShape:
    """Shape (sympy expressions in the batch and sequence symbols), dtype and gradient flag of a tensor."""

    sizes: tuple[sympy.Expr, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def numel(self) -> sympy.Expr:
        return sympy.Mul(*self.sizes) if self.sizes else sympy.Integer(1)

    @property
    def nbytes(self) -> sympy.Expr:
        return self.numel * _itemsize(self.dtype)

    def __str__(self) -> str:
        dims = ", ".join(str(s) for s in self.sizes)
        return f"{str(self.dtype).removeprefix('torch.')}[{dims}]{'*' if self.requires_grad else ''}"


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


@dataclass(frozen=True)
class NodeShape:
    """What a node produces: its tensor outputs (flattened; None for non-tensor leaves), or a size."""

    tensors: tuple[TensorShape | None, ...] = ()
    scalar: sympy.Expr | None = None

    @property
    def tensor(self) -> TensorShape:
        if len(self.tensors) != 1 or self.tensors[0] is None:
            raise ValueError(f"expected exactly one tensor output, found {self}")
        return self.tensors[0]

    @property
    def nbytes(self) -> sympy.Expr:
        return sympy.Add(*(t.nbytes for t in self.tensors if t is not None))

    @property
    def requires_grad(self) -> bool:
        """Whether any tensor output requires grad (for a get_attr: a trainable parameter)."""
        return any(t is not None and t.requires_grad for t in self.tensors)

    def __str__(self) -> str:
        if self.scalar is not None:
            return f"size {self.scalar}"
        return ", ".join(str(t) for t in self.tensors)


@dataclass(frozen=True)
class NodeCost:
    """Costs of one node; FLOPs count matrix-multiply class work (mm, linear, attention, conv)."""

    flops_fwd: sympy.Expr
    flops_bwd: sympy.Expr
    param_bytes: int
    activation_bytes: sympy.Expr


# What a node a transformation inserts costs the planner (a collective, a runtime module's get_attr): nothing.
NO_COST = NodeCost(sympy.Integer(0), sympy.Integer(0), 0, sympy.Integer(0))


@dataclass(frozen=True)
class ExpertLayer:
    """A mixture-of-experts layer that expert parallelism splits: on its expert weights (sharded along dim 0,
    the expert dimension, over the ep ranks) and on its dispatch and combine nodes."""

    layer: str  # the layer's name (its router's module path)
    experts: int  # E, every rank's count before the split
    ep: int  # the expert-parallel degree: each rank holds experts // ep of them


@dataclass(frozen=True)
class ExpertSplit:
    """The expert weights ep splits, by get_attr target: those stacked by expert (cut along dim 0), and the slot
    weights of loops over experts, each with the targets ep rank 0, 1, .. reads in its place."""

    stacked: frozenset[str] = frozenset()
    slots: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def targets(self) -> frozenset[str]:
        """Every expert weight the graph reads."""
        return self.stacked | frozenset(self.slots)


def get_expert(node: fx.Node) -> ExpertLayer | None:
    """The expert layer a node belongs to (written by passes.expert_parallel), or None."""
    return node.meta.get(EXPERT)


@dataclass(frozen=True)
class FlatSlot:
    """Where a parameter lives in a flat group: gradient buckets (DP, ZeRO 1/2) or gather groups (ZeRO-3)."""

    group: int
    offset: int
    numel: int


@dataclass(frozen=True)
class Zero3Gather:
    """A ZeRO-3 gather node's group: its parameters (get_attr targets) in flat order."""

    group: int
    targets: tuple[str, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]


@dataclass(frozen=True)
class NodeSaves:
    """The bytes (in B and S) a call keeps for backward that no earlier call kept already, and their kind."""

    category: str
    nbytes: sympy.Expr
    probed: bool = True  # False: an op the meta device could not run; its saves are not counted


@dataclass(frozen=True)
class RecomputeRegion:
    """A region whose activations are recomputed in backward: its submodule, layer, size and kept inputs."""

    name: str
    layer: str
    nodes: int
    inputs: tuple[str, ...]
    freed: sympy.Expr = sympy.Integer(0)  # bytes no longer kept for backward (passes.recompute.Deals), in B and S
    flops: sympy.Expr = sympy.Integer(0)  # forward FLOPs repeated in backward
    remade: str = ""  # not a region: the node whose output matmuls no longer keep (recompute.input_recomputed)


@dataclass(frozen=True)
class MaskSpec:
    """A dropout op's mask as single-device training draws it: its place in the model's draw order, its
    probability, its global shape (in B and S), the dimension that holds the batch rows (None: a mask
    every dp rank uses whole) and its placement along tp (a Shard, or None when tp ranks hold it whole)."""

    index: int
    node: str
    p: float
    sizes: tuple[sympy.Expr, ...]
    batch_dim: int | None
    tp: Shard | None = None


@dataclass(frozen=True)
class PipeSlot:
    """A recv or send node of a stage graph: which boundary tensor, from or to which stage."""

    stage: int
    peer: int
    slot: int
    direction: str  # "recv" or "send"


def _require(node: fx.Node, key: str) -> Any:
    try:
        return node.meta[key]
    except KeyError:
        raise MissingMetaError(
            f"node {node.format_node()} has no {key!r}; run {PRODUCERS[key]} on this graph first"
        ) from None


def _accessor(key: str) -> Callable[[fx.Node], Any]:
    def get(node: fx.Node) -> Any:
        return _require(node, key)

    get.__doc__ = f"The node's {key!r} record; raises MissingMetaError naming {PRODUCERS[key]} when absent."
    return get


get_shape: Callable[[fx.Node], NodeShape] = _accessor(SHAPE)
get_layer: Callable[[fx.Node], str] = _accessor(LAYER)
get_cost: Callable[[fx.Node], NodeCost] = _accessor(COST)
get_grad_bucket: Callable[[fx.Node], FlatSlot] = _accessor(GRAD_BUCKET)
get_zero_group: Callable[[fx.Node], FlatSlot] = _accessor(ZERO_GROUP)
get_zero3_gather: Callable[[fx.Node], Zero3Gather] = _accessor(ZERO3)
get_stage: Callable[[fx.Node], int] = _accessor(STAGE)


@dataclass(frozen=True)
class TpPlacement:
    """A value's placement along the tp mesh dimension, and the placements its op reads its inputs in.

    ``out`` is a Placement, or a tuple of them for ops with several outputs (split); ``inputs`` follows
    ``node.all_input_nodes``. Where an input's own ``out`` differs, a redistribution goes between.
    """

    out: Any
    inputs: tuple[Any, ...]
    note: str = ""  # for people: why the rule chose this
    bias: str = ""  # a row-parallel matmul's bias: BIAS_AFTER_REDUCE or BIAS_SPLIT (else "")


@dataclass(frozen=True)
class CpPlacement:
    """A value's placement along the cp mesh dimension: ``Shard(d)`` (this rank's tokens along d; ``merged``:
    d is several dimensions flattened, the sequence innermost, as logits flattened to [batch x tokens, vocab]),
    ``Replicate()`` (every token, or no sequence at all) or ``Partial()`` (a sum over tokens, each rank its
    own tokens' part); and what the pass did there, for people."""

    out: Any
    merged: bool = False
    note: str = ""


# How a row-parallel matmul adds its bias (TpPlacement.bias): once after the all-reduce, or bias/tp on
# each rank before a reduce-scatter (sequence parallel).
BIAS_AFTER_REDUCE = "after_reduce"
BIAS_SPLIT = "split"


@dataclass(frozen=True)
class TpCollective:
    """A collective the TP rewrite inserted: what it does in forward and in backward (None: no communication)."""

    forward: str | None
    backward: str | None
    layer: str
    reason: str


get_tp: Callable[[fx.Node], TpPlacement] = _accessor(TP)
