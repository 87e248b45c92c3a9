"""Expert parallelism: each mixture-of-experts layer's experts split over the ep ranks, tokens sent to them.

Reads:  autoshard.shape, autoshard.layer
Writes: autoshard.expert (meta.ExpertLayer) on each split layer's expert weights (get_attr), on its expert
        region (values of the rows routed to this rank's experts) and on the nodes it inserts; updates
        autoshard.shape of the expert weights to the rank's E / ep experts (so gradient buckets size them);
        autoshard.shape, autoshard.layer and autoshard.cost (no FLOPs) on the nodes it inserts; a loop's
        slot regions' autoshard.shape holds ep times the rows (every ep rank's, in expectation)

An MoE layer is found by its grouped matmuls: calls of ``aten._grouped_mm`` (or the fallback op that
transformers registers) that take rows sorted by expert, weights stacked along a first dimension of E
experts (a parameter, through transposes and casts), and ``offs``, where each expert's rows end. The
grouped matmuls that share one ``offs`` are one layer; its *expert region* is everything on the way from
the rows the first one reads to the output of the last (the activation between them, the split of a
fused gate/up projection). The router, the permutation of tokens and the weighted combine stay where
they are: they are per token, and every rank computes them for its own tokens.

The rewrite puts ``experts.dispatch`` before the region (rows and offs for this rank's experts, from
every ep rank) and ``experts.combine`` after it (the rows back in their order), and shards the expert
weights along dim 0. Every value in the region must be per row: grouped matmuls, elementwise ops, a
split along the features. Anything else (an op that mixes rows, a value read outside the region, a
weight that is not stacked by expert) refuses ep with the node named: never a silent replication.

A layer written as a Python loop over its experts (each expert its own weights, its rows gathered with
``x[where(ids == e)[0]]``) is split by passes/expert_loops.py: each rank runs its experts in the places of
the first E / ep, and the pass returns which weights a rank reads in each place (meta.ExpertSplit).
"""

from __future__ import annotations

import operator

import sympy
import torch
from torch import fx

from autoshard.errors import PlanError
from autoshard.graph_ops import experts as ep_ops
from autoshard.ir.meta import EXPERT, LAYER, SHAPE, ExpertLayer, ExpertSplit, NodeShape, TensorShape, get_shape
from autoshard.ir.ops import packet
from autoshard.sharding.pointwise import RULES as POINTWISE_RULES

from .expert_loops import CHECKS, ELEMENTWISE, SPLITS, WEIGHT_VIEWS, feature_dim, find_loops, rewrite_loop
from .infra import Need, Pass, PassResult, calls_to, mark_inserted, runtime_attr

__all__ = ["GROUPED_MATMULS", "PASS", "RUNTIME_ATTR", "find_layers", "find_loops", "is_grouped_mm", "run"]

RUNTIME_ATTR = "ep"
aten = torch.ops.aten
# transformers' op is keyed by name: importing transformers is not this pass's business.
GROUPED_MATMULS = ("aten::_grouped_mm", "transformers::grouped_mm_fallback")


def is_grouped_mm(node: fx.Node) -> bool:
    op = packet(node.target) if node.op == "call_function" else None
    return getattr(op, "_qualified_op_name", "") in GROUPED_MATMULS


def _offs(node: fx.Node) -> fx.Node | None:
    offs = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
    return offs if isinstance(offs, fx.Node) else None


class Layer:
    """One MoE layer as found: its grouped matmuls, their rows and offs, the weights, the region."""

    def __init__(self, gm: fx.GraphModule, offs: fx.Node, matmuls: list[fx.Node]) -> None:
        self.gm, self.offs, self.matmuls = gm, offs, matmuls
        self.rows = matmuls[0].args[0]
        self.last = matmuls[-1]
        self.name = str(matmuls[0].meta.get(LAYER, matmuls[0].name))
        self.experts = int(get_shape(offs).tensor.sizes[0])
        self.weights: list[fx.Node] = []  # get_attr nodes of the stacked expert weights
        self.chains: list[fx.Node] = []  # the views between them and the matmuls
        for mm in matmuls:
            self._weight(mm)
        self.region = self._region()

    def refuse(self, node: fx.Node, why: str) -> PlanError:
        return PlanError(
            f"ep cannot split the experts of {self.name}: {node.name} ({node.target}) {why}; expert parallelism "
            f"needs each expert's rows computed apart from the others' (grouped matmuls, elementwise ops, splits "
            f"along the features). Use ep=1 for this model"
        )

    def _weight(self, mm: fx.Node) -> None:
        node = mm.args[1]
        while isinstance(node, fx.Node) and node.op == "call_function":
            op = packet(node.target)
            if op not in WEIGHT_VIEWS or (op is aten.transpose and 0 in {d % 3 for d in node.args[1:3]}):
                raise self.refuse(mm, f"reads weights through {node.name} ({node.target}), not a stacked expert weight")
            self.chains.append(node)
            node = node.args[0]
        if not isinstance(node, fx.Node) or node.op != "get_attr" or not get_shape(node).requires_grad:
            raise self.refuse(mm, "reads weights that are not a trained parameter")
        sizes = get_shape(node).tensor.sizes
        if len(sizes) != 3 or sizes[0] != self.experts:
            raise self.refuse(mm, f"reads weights of shape {tuple(sizes)}, not stacked by its {self.experts} experts")
        self.weights.append(node)

    def _region(self) -> list[fx.Node]:
        ancestors: set[fx.Node] = set()
        stack = [self.last]
        while stack:
            node = stack.pop()
            if node in ancestors or node is self.rows:
                continue
            ancestors.add(node)
            stack.extend(node.all_input_nodes)
        descendants: set[fx.Node] = set()
        stack = list(self.rows.users)
        while stack:
            node = stack.pop()
            if node not in descendants and node in ancestors:
                descendants.add(node)
                stack.extend(node.users)
        inside = descendants
        inside |= {u for n in inside for u in n.users if packet(u.target) in CHECKS}
        order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        region = sorted(inside, key=order.__getitem__)
        allowed = {self.rows, *inside, *self.chains, *self.weights}
        for node in region:
            op = packet(node.target)
            if node.op != "call_function" or not (
                is_grouped_mm(node) or op in CHECKS or op is operator.getitem or op in SPLITS and feature_dim(node)
                or (node.target in POINTWISE_RULES or op in ELEMENTWISE) and not _broadcasts_rows(node)
            ):  # fmt: skip
                raise self.refuse(node, "is not computed row by row")
            for arg in node.all_input_nodes:
                if arg not in allowed and not (arg is self.offs and is_grouped_mm(node)):
                    raise self.refuse(node, f"reads {arg.name}, a value from outside the experts")
            if node is not self.last and any(u not in inside for u in node.users):
                outside = next(u for u in node.users if u not in inside)
                raise self.refuse(node, f"is read by {outside.name} outside the experts")
        return region


def _broadcasts_rows(node: fx.Node) -> bool:
    """An elementwise op with a tensor operand that has no row dimension of its own (it would be every row's)."""
    out = len(get_shape(node).tensors[0].sizes)
    return any(len(get_shape(a).tensor.sizes) < out for a in node.all_input_nodes)


def find_layers(gm: fx.GraphModule) -> list[Layer]:
    """Every MoE layer of the graph (grouped matmuls sharing an ``offs``), in graph order."""
    by_offs: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if is_grouped_mm(node):
            offs = _offs(node)
            if offs is None:
                raise PlanError(f"ep cannot split {node.name}: a grouped matmul without offs (rows per expert)")
            by_offs.setdefault(offs, []).append(node)
    return [Layer(gm, offs, mms) for offs, mms in by_offs.items()]


def _local(shape: TensorShape, ep: int) -> TensorShape:
    return TensorShape((sympy.Integer(int(shape.sizes[0]) // ep), *shape.sizes[1:]), shape.dtype, shape.requires_grad)


def _mark(node: fx.Node, shape: NodeShape, layer: str, record: ExpertLayer) -> fx.Node:
    mark_inserted(node, shape, layer).meta[EXPERT] = record
    return node


def _rewrite(gm: fx.GraphModule, layer: Layer, ep: int, runtime: fx.Node) -> None:
    graph = gm.graph
    record = ExpertLayer(layer.name, layer.experts, ep)
    order = {n: i for i, n in enumerate(graph.nodes)}
    after = max(layer.rows, layer.offs, key=order.__getitem__)
    if order[after] > order[layer.region[0]]:
        raise layer.refuse(layer.region[0], f"runs before {after.name}, which the dispatch of its rows needs")
    rows, offs = get_shape(layer.rows), get_shape(layer.offs).tensor
    local_offs = TensorShape((sympy.Integer(layer.experts // ep),), offs.dtype, False)
    routing = TensorShape((sympy.Integer(2), sympy.Integer(ep), sympy.Integer(layer.experts // ep)), torch.int64, False)
    with graph.inserting_after(after):
        dispatch = graph.call_function(ep_ops.dispatch, (runtime, layer.rows, layer.offs, layer.name))
    with graph.inserting_after(dispatch):
        parts = [graph.call_function(operator.getitem, (dispatch, i)) for i in range(3)]
    name = str(layer.region[0].meta.get(LAYER, "(top)"))
    _mark(dispatch, NodeShape(tensors=(rows.tensor, local_offs, routing)), name, record)
    for part, shape in zip(parts, (rows.tensor, local_offs, routing)):
        _mark(part, NodeShape(tensors=(shape,)), name, record)
    for node in layer.region:
        node.meta[EXPERT] = record  # its rows are those routed to this rank's experts, from every ep rank
        node.replace_input_with(layer.rows, parts[0])
        if is_grouped_mm(node):
            node.replace_input_with(layer.offs, parts[1])
    outside = [u for u in layer.last.users if u not in layer.region]
    with graph.inserting_after(layer.last):
        combine = graph.call_function(ep_ops.combine, (runtime, layer.last, parts[2]))
    _mark(combine, get_shape(layer.last), str(layer.last.meta.get(LAYER, name)), record)
    for user in outside:
        user.replace_input_with(layer.last, combine)
    for node in dict.fromkeys([*layer.weights, *layer.chains]):
        if EXPERT not in node.meta:  # a weight two layers read (tied experts) is split once
            node.meta[SHAPE] = NodeShape(tensors=(_local(get_shape(node).tensor, ep),))
            node.meta[EXPERT] = record


def run(gm: fx.GraphModule, ep: int) -> PassResult:
    layers = find_layers(gm)
    loops = find_loops(gm)
    if not layers and not loops:
        raise PlanError(
            f"ep={ep} splits the experts of mixture-of-experts layers, and this model has none that autoshard "
            f"recognises (grouped matmuls over experts stacked in one weight: torch._grouped_mm, or transformers' "
            f"experts_implementation='grouped_mm'; or a loop over the experts taking x[where(ids == e)[0]]); use ep=1"
        )
    for name, experts in [(la.name, la.experts) for la in layers] + [(lo.name, lo.num_experts) for lo in loops]:
        if experts % ep:
            raise PlanError(
                f"ep={ep} does not divide the {experts} experts of {name}; choose an ep that divides {experts}"
            )
    runtime = runtime_attr(gm, RUNTIME_ATTR, ep_ops.UnboundExpertParallel(ep))
    for layer in layers:
        _rewrite(gm, layer, ep, runtime)
    slots: dict[str, tuple[str, ...]] = {}
    for loop in loops:
        slots.update(rewrite_loop(gm, loop, ep, runtime))
    gm.graph.lint()
    gm.recompile()
    weights = sum(len(layer.weights) for layer in layers)
    split = ExpertSplit(frozenset(w.target for layer in layers for w in layer.weights), slots)
    summary = f"{len(layers)} expert layers over ep={ep}, {weights} weights split"
    if loops:
        summary += f"; {len(loops)} loops over experts, {len(slots)} slot weights a rank"
    return PassResult("expert_parallel", True, summary, split)


PASS = Pass(
    "expert_parallel",
    reads=(Need(SHAPE), Need(LAYER)),
    writes=(Need(EXPERT, calls_to("expert dispatch and combine", *ep_ops.EXCHANGES)),),
    run=run,
)
