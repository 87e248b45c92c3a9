"""Mixture-of-experts layers written as a Python loop over their experts: found and split for the
expert_parallel pass (its second form, beside the grouped matmuls; not a pass of its own).

Older Hugging Face models and hand-written ones run, for each expert e of a layer,

    token = where(ids == e)[0]         (or where(select(one_hot_mask, 0, e)))
    y_e = expert_e(x[token])           the expert's *region*: computed row by row on its own weights
    out = out.index_add(0, token, y_e * weight[token, slot])

A layer is the ``x[token]`` row gathers of one ``x`` whose tokens are selected from one routing tensor,
for experts 0 .. E-1. Each expert's region must match the others op for op (the same ops, on weights of
the same shapes, read by that expert alone): under ep it is a *slot* that runs whichever expert a rank holds.

The rewrite keeps the regions of the first E / ep experts (the slots) and removes the others':

    dispatch_rows(ep, [x[token_0], ..., x[token_E-1]]) -> (rows of local expert 0, .., routing)
    slot j's region, on its rows
    combine_rows(ep, [slot outputs], routing) -> (y_0, ..., y_E-1), each back in its gather's order

and every rank re-points slot j's weights at those of its own j-th expert (rank k of the ep group holds
experts k * E/ep .. (k+1) * E/ep - 1): ``slots`` maps each slot weight's get_attr target to the targets
ep rank 0, 1, .. reads there. Each expert's weights live whole on the rank that runs it.
"""

from __future__ import annotations

import heapq
import operator

import sympy
import torch
from torch import fx

from autoshard.errors import PlanError
from autoshard.graph_ops import experts as ep_ops
from autoshard.ir.meta import EXPERT, LAYER, SHAPE, ExpertLayer, NodeShape, TensorShape, get_shape
from autoshard.ir.ops import packet
from autoshard.sharding.pointwise import RULES as POINTWISE_RULES

from .infra import mark_inserted

__all__ = ["CHECKS", "ELEMENTWISE", "SPLITS", "WEIGHT_VIEWS", "LoopLayer", "feature_dim", "find_loops", "rewrite_loop"]

aten = torch.ops.aten
# What both forms (expert_parallel.py's grouped matmuls, and loops here) take as computed row by row.
# Ops a weight passes through on its way to the experts' matmuls, as long as its leading dimension stays first.
WEIGHT_VIEWS = {aten.transpose, aten.to, aten._to_copy, aten.contiguous, aten.clone, aten.alias}
SPLITS = {aten.chunk, aten.split, aten.split_with_sizes, aten.unsafe_split, aten.unsafe_chunk}
CHECKS = {aten._assert_tensor_metadata}
# Elementwise ops without a sharding rule that experts' activations use (squared ReLU: Nemotron-H).
ELEMENTWISE = {aten.square, aten.relu_, aten.silu_, aten.gelu_}
# Ops that take rows of the region first and weights after: each output row reads one input row.
ROW_MATMULS = {aten.linear: 0, aten.mm: 0, aten.matmul: 0, aten.addmm: 1}


def _expert_of(token: object) -> tuple[fx.Node, int] | None:
    """(the routing tensor, the expert) a row index selects: getitem(where(ids == e) or where(select(mask, 0, e)))."""
    if not (isinstance(token, fx.Node) and token.op == "call_function" and token.target is operator.getitem):
        return None
    where = token.args[0]
    if not (isinstance(where, fx.Node) and where.target is aten.where.default and len(where.args) == 1):
        return None
    select = where.args[0]
    if isinstance(select, fx.Node) and select.target is aten.eq.Scalar and isinstance(select.args[1], int):
        return select.args[0], select.args[1]
    if isinstance(select, fx.Node) and select.target is aten.select.int and select.args[1] == 0:
        return select.args[0], int(select.args[2])
    return None


def _weight(node: fx.Node) -> fx.Node | None:
    """The trainable get_attr a value reads through views, or None."""
    while node.op == "call_function" and packet(node.target) in WEIGHT_VIEWS | {aten.t}:  # a 2-D weight's t()
        node = node.args[0]
    return node if node.op == "get_attr" and get_shape(node).requires_grad else None


class Expert:
    """One expert's region: the nodes computed from its rows alone (and its weights), its output, its weights."""

    def __init__(self, layer: LoopLayer, expert: int, rows: fx.Node) -> None:
        self.expert, self.rows = expert, rows
        inside: list[fx.Node] = []
        members = {rows}
        self.weights: list[fx.Node] = []  # get_attr nodes, in the order the region first reads them
        self.views: list[fx.Node] = []
        node = rows.next
        while node.op != "output":
            if any(a in members for a in node.all_input_nodes) and self._row_wise(node, members):
                inside.append(node)
                members.add(node)
            node = node.next
        if not self.weights:
            raise layer.refuse(rows, f"expert {expert} computes nothing on weights of its own from its rows")
        outputs = [n for n in inside if any(u not in members for u in n.users)]
        if len(outputs) != 1:
            names = ", ".join(n.name for n in outputs) or "none"
            raise layer.refuse(rows, f"expert {expert}'s rows leave its computation at {names}, not at one value")
        self.nodes, self.out = inside, outputs[0]
        for weight in [*self.weights, *self.views]:
            outside = [u for u in weight.users if u not in members and u not in self.views]
            if outside:
                raise layer.refuse(outside[0], f"reads {weight.name}, a weight of expert {expert} alone")

    def _row_wise(self, node: fx.Node, members: set[fx.Node]) -> bool:
        """Whether ``node`` computes each output row from one row of the region (and weights); records its weights."""
        if node.op != "call_function":
            return False
        op = packet(node.target)
        weights = {a: _weight(a) for a in node.all_input_nodes if a not in members}
        if any(w is None for w in weights.values()):
            return False  # reads an activation from outside the expert
        if op in ROW_MATMULS:  # the rows times weights: a second operand from the rows would mix them
            rows = ROW_MATMULS[op]
            if len(node.args) <= rows or node.args[rows] not in members:
                return False
            if any(a in members for i, a in enumerate(node.args) if i != rows and isinstance(a, fx.Node)):
                return False
        elif op is operator.getitem or op in CHECKS or op in SPLITS and feature_dim(node):
            pass
        elif node.target in POINTWISE_RULES or op in ELEMENTWISE:
            ndim = len(get_shape(node).tensors[0].sizes)
            if any(len(get_shape(a).tensor.sizes) < ndim for a in node.all_input_nodes if a in members):
                return False  # a value with no rows of its own would be every row's
        else:
            return False
        for view, weight in weights.items():
            if weight is not None and weight not in self.weights:
                self.weights.append(weight)
            chain = view
            while chain is not weight and chain not in self.views:
                self.views.append(chain)
                chain = chain.args[0]
        return True

    def signature(self) -> list[tuple]:
        """What the slot re-pointing relies on: the same ops on the same kinds of values, weights alike."""
        index = {n: i for i, n in enumerate([self.rows, *self.nodes])}
        weights = {w: i for i, w in enumerate(self.weights)}

        def arg(a: object) -> object:
            if isinstance(a, fx.Node):
                if a in index:
                    return ("row", index[a])
                w = _weight(a)
                return ("weight", weights[w], tuple(get_shape(w).tensor.sizes), str(get_shape(w).tensor.dtype))
            return tuple(arg(x) for x in a) if isinstance(a, (list, tuple)) else a

        return [(n.target, arg(n.args), arg(dict(n.kwargs).items())) for n in self.nodes]


def feature_dim(node: fx.Node) -> bool:
    """Whether a split runs along the features (each row split apart), not along the rows."""
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    ndim = len(get_shape(node.args[0]).tensor.sizes)
    return ndim >= 2 and dim % ndim != 0


class LoopLayer:
    """One MoE layer run as a loop: the row gathers of its experts, in expert order, and their regions."""

    def __init__(self, gm: fx.GraphModule, rows: dict[int, fx.Node]) -> None:
        self.gm = gm
        first = min(rows.values(), key=lambda n: list(gm.graph.nodes).index(n))
        self.name = str(first.meta.get(LAYER, first.name))
        self.num_experts = len(rows)
        if sorted(rows) != list(range(len(rows))):
            raise self.refuse(first, f"selects experts {sorted(rows)}, not each of 0 .. {len(rows) - 1} once")
        self.experts = [Expert(self, e, rows[e]) for e in range(len(rows))]
        reference = self.experts[0].signature()
        for expert in self.experts[1:]:
            if expert.signature() != reference:
                raise self.refuse(
                    expert.rows, f"runs expert {expert.expert} differently from expert 0 (other ops or weight shapes)"
                )

    def refuse(self, node: fx.Node, why: str) -> PlanError:
        return PlanError(
            f"ep cannot split the experts of {self.name}, a loop over experts: at {node.name} ({node.target}) {why}; "
            f"expert parallelism runs a rank's experts in the places of the first ones, so every expert must "
            f"compute the same ops row by row on weights of its own. Use ep=1 for this model"
        )


def find_loops(gm: fx.GraphModule) -> list[LoopLayer]:
    """Every MoE layer of the graph that loops over its experts, in graph order."""
    by_source: dict[tuple[fx.Node, fx.Node], dict[int, fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.target is aten.index.Tensor and len(node.args[1]) == 1:
            selected = _expert_of(node.args[1][0])
            if selected is not None:
                by_source.setdefault((node.args[0], selected[0]), {}).setdefault(selected[1], node)
    return [LoopLayer(gm, rows) for rows in by_source.values() if len(rows) > 1]


def _scaled_rows(node: fx.Node, rows: sympy.Expr, ep: int) -> None:
    """A slot's values hold the rows of its expert from every ep rank: ep times one rank's, in expectation."""
    shape = get_shape(node)
    tensors = tuple(
        TensorShape((ep * t.sizes[0], *t.sizes[1:]), t.dtype, t.requires_grad) if t.sizes and t.sizes[0] == rows else t
        for t in shape.tensors
    )
    node.meta[SHAPE] = NodeShape(tensors=tensors)


def rewrite_loop(gm: fx.GraphModule, layer: LoopLayer, ep: int, runtime: fx.Node) -> dict[str, tuple[str, ...]]:
    """Dispatch, the slots, combine (see the module doc); the slot weights' targets on each ep rank."""
    graph, experts = gm.graph, layer.experts
    local = len(experts) // ep
    record = ExpertLayer(layer.name, len(experts), ep)
    order = {n: i for i, n in enumerate(graph.nodes)}
    last_rows = max((e.rows for e in experts), key=order.__getitem__)
    name = str(experts[0].nodes[0].meta.get(LAYER, layer.name))
    with graph.inserting_after(last_rows):
        dispatch = graph.call_function(ep_ops.dispatch_rows, (runtime, [e.rows for e in experts], layer.name))
    routing = TensorShape((sympy.Integer(2), sympy.Integer(ep), sympy.Integer(local)), torch.int64, False)
    shapes = [get_shape(e.rows).tensor for e in experts[:local]]
    shapes = [TensorShape((ep * t.sizes[0], *t.sizes[1:]), t.dtype, t.requires_grad) for t in shapes]
    mark_inserted(dispatch, NodeShape(tensors=(*shapes, routing)), name).meta[EXPERT] = record
    parts = _items(graph, dispatch, local + 1)
    for part, shape in zip(parts, (*shapes, routing)):
        mark_inserted(part, NodeShape(tensors=(shape,)), name).meta[EXPERT] = record
    for slot, expert in enumerate(experts[:local]):
        rows = get_shape(expert.rows).tensor.sizes[0]
        for node in expert.nodes:
            node.replace_input_with(expert.rows, parts[slot])
            node.meta[EXPERT] = record  # rows routed to this rank's slot-th expert, from every ep rank
            _scaled_rows(node, rows, ep)
    with graph.inserting_after(parts[-1]):
        combine = graph.call_function(ep_ops.combine_rows, (runtime, [e.out for e in experts[:local]], parts[-1]))
    outs = tuple(get_shape(e.out).tensor for e in experts)
    mark_inserted(combine, NodeShape(tensors=outs), name).meta[EXPERT] = record
    backs = _items(graph, combine, len(experts))
    for back, shape in zip(backs, outs):
        mark_inserted(back, NodeShape(tensors=(shape,)), name).meta[EXPERT] = record
    for expert, back in zip(experts, backs):
        for user in [u for u in expert.out.users if u not in expert.nodes and u is not combine]:
            user.replace_input_with(expert.out, back)
    for expert in experts[local:]:  # the other ranks' experts: their slots run them there
        for node in [*reversed(expert.nodes), *expert.views, *expert.weights]:
            if not node.users:
                graph.erase_node(node)
    slots = {}
    for slot, expert in enumerate(experts[:local]):
        for i, weight in enumerate(expert.weights):
            slots[weight.target] = tuple(experts[k * local + slot].weights[i].target for k in range(ep))
            weight.meta[EXPERT] = record
    _topological_order(graph)
    return slots


def _items(graph: fx.Graph, node: fx.Node, count: int) -> list[fx.Node]:
    """getitem 0 .. count-1 of ``node``, in order right after it."""
    items, last = [], node
    for i in range(count):
        with graph.inserting_after(last):
            last = graph.call_function(operator.getitem, (node, i))
        items.append(last)
    return items


def _topological_order(graph: fx.Graph) -> None:
    """Reorder the nodes so each follows its inputs, otherwise keeping their order (the slots moved after the
    dispatch that feeds them, the combine's users after it)."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    waiting = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [position[n] for n in nodes if not waiting[n]]
    heapq.heapify(ready)
    placed = []
    while ready:
        node = nodes[heapq.heappop(ready)]
        placed.append(node)
        for user in node.users:
            waiting[user] -= 1
            if not waiting[user]:
                heapq.heappush(ready, position[user])
    if len(placed) != len(nodes):
        raise RuntimeError("expert loop rewrite left a cycle in the graph")
    for before, node in zip(placed, placed[1:]):
        before.append(node)
