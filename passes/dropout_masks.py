"""Single-device dropout masks: each dropout op reads its mask from the rank's SingleDeviceMasks module.

Reads:  autoshard.shape; autoshard.tp on dropout nodes (when tp > 1)
Writes: autoshard.dropout_mask (meta.MaskSpec) on every dropout node it rewrites; autoshard.shape,
        autoshard.layer and autoshard.ir.cost (nothing) on the get_attr of the masks module

``catalog(gm, tp)`` lists the model's dropout ops in graph order, the order single-device training
draws their masks, with the global shape of each (a tp shard's dimension times tp) and the dimension
holding the batch rows; it refuses random ops whose draws it cannot reproduce (the dropout inside
scaled_dot_product_attention, bernoulli, rand_like). ``PASS`` then rewrites each of those ops, on the
whole captured graph before it is cut into pipeline stages or recompute regions:

    dropout_3 = torch.ops.aten.dropout.default(add_5, 0.1, True)
becomes
    dropout_3 = autoshard_graph_ops_masks_dropout(masks, 2, add_5, 0.1, True)   # op 2 of the draw order

On tp-sharded values the op was ``tp.sharded_random(tp, aten.dropout, x, p, train)``; it becomes the
same call (the rank's shard of the single-device mask replaces the rank's own stream).
"""

from __future__ import annotations

import sympy
import torch
from torch import fx

from autoshard.errors import PlanError
from autoshard.graph_ops import masks as mask_ops
from autoshard.ir.meta import COST, LAYER, MASK, SHAPE, MaskSpec, NodeCost, NodeShape, get_shape, get_tp
from autoshard.ir.ops import RANDOM, attention_dropout, runs
from autoshard.ir.placements import Shard

from .infra import Need, Pass, PassResult, calls_to

__all__ = ["MASKS_ATTR", "PASS", "catalog", "run"]

aten = torch.ops.aten
MASKS_ATTR = "masks"  # the graphs' get_attr name of the rank's SingleDeviceMasks module
BATCH = sympy.Symbol("B", positive=True, integer=True)


def _dropout_args(node: fx.Node) -> tuple | None:
    """(x, p, train) of a dropout node, plain or on tp shards; None for other nodes."""
    if node.op != "call_function" or node.target is mask_ops.dropout:
        return None
    target, args = runs(node)
    if target is not aten.dropout.default:
        return None
    return args[0], args[1] if len(args) > 1 else node.kwargs.get("p", 0.5), args[2] if len(args) > 2 else True


def _refuse_other_random(node: fx.Node) -> None:
    target, args = runs(node)
    if target not in RANDOM or target is aten.dropout.default:
        return
    if target is aten.scaled_dot_product_attention.default:
        p = attention_dropout(args, node.kwargs)
        if not p:
            return
        why = "scaled_dot_product_attention draws its dropout mask inside the kernel"
        fix = "build the model with eager attention (Hugging Face: attn_implementation='eager') or attention dropout 0"
    else:
        why, fix = f"{target} draws random numbers that are not a dropout mask", "remove it or use dropout"
    raise PlanError(
        f'dropout_masks="single_device" reproduces the dropout masks of one device, but node {node.name} '
        f'({node.format_node()}): {why}; {fix}, or keep dropout_masks="per_rank"'
    )


def _batch_dim(node: fx.Node, sizes: tuple[sympy.Expr, ...]) -> int | None:
    dims = [d for d, s in enumerate(sizes) if BATCH in sympy.sympify(s).free_symbols]
    if not dims:
        return None
    quotient = sympy.simplify(sympy.sympify(sizes[dims[0]]) / BATCH)
    if len(dims) > 1 or BATCH in quotient.free_symbols:
        raise PlanError(
            f'dropout_masks="single_device": dropout node {node.name} has shape {list(sizes)}, whose batch rows '
            f'are not one dimension of B x (rows per sample); keep dropout_masks="per_rank" for this model'
        )
    return dims[0]


def catalog(gm: fx.GraphModule, tp: int) -> tuple[MaskSpec, ...]:
    """The model's dropout ops that draw a mask, in the order one device draws them."""
    specs = []
    for node in gm.graph.nodes:
        _refuse_other_random(node)
        args = _dropout_args(node)
        if args is None:
            continue
        _, p, train = args
        if not isinstance(p, (int, float)) or not isinstance(train, bool):
            raise PlanError(f"dropout node {node.name} has a probability or train flag computed in the graph")
        if not train or not 0 < p < 1:
            continue  # draws nothing on one device either
        sizes = list(get_shape(node).tensor.sizes)
        shard = get_tp(node).out if tp > 1 else None
        shard = Shard(shard.dim % len(sizes), shard.blocks) if isinstance(shard, Shard) else None
        if shard is not None:
            sizes[shard.dim] = sizes[shard.dim] * tp  # the global shape the mask is drawn in
        sizes = tuple(sizes)
        specs.append(MaskSpec(len(specs), node.name, float(p), sizes, _batch_dim(node, sizes), shard))
    return tuple(specs)


def run(gm: fx.GraphModule, specs: tuple[MaskSpec, ...]) -> PassResult:
    by_name = {spec.node: spec for spec in specs}
    nodes = [n for n in gm.graph.nodes if n.name in by_name and _dropout_args(n) is not None]
    if nodes:
        gm.add_submodule(MASKS_ATTR, mask_ops.UnboundMasks())
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        with gm.graph.inserting_after(placeholders[-1]):
            module = gm.graph.get_attr(MASKS_ATTR)
        module.meta.update({SHAPE: NodeShape(), LAYER: "(top)", COST: NodeCost(*(sympy.Integer(0),) * 2, 0, 0)})
    for node in nodes:
        spec = by_name[node.name]
        x, p, train = _dropout_args(node)
        node.target, node.args, node.kwargs = mask_ops.dropout, (module, spec.index, x, p, train), {}
        node.meta[MASK] = spec
    gm.graph.lint()
    gm.recompile()
    return PassResult("dropout_masks", bool(nodes), f"{len(nodes)} dropout ops draw single-device masks")


PASS = Pass(
    name="dropout_masks",
    reads=(Need(SHAPE),),
    writes=(
        Need(MASK, calls_to("every single-device dropout op", mask_ops.dropout)),
        Need(SHAPE),
        Need(LAYER),
        Need(COST),
    ),
    run=run,
)
