"""What the planner reads off the captured graph: per part of the model (each kind of repeated block, what
comes before the first block, what comes after the last), per tensor-parallel degree, the work of every
node, the collectives the tp rewrite inserts, the parameters each rank holds, and what backward keeps
under each recompute choice.

A part is cut out of the analysed graph as a graph of its own (its inputs become placeholders) and the
compiler's own passes run on it: ``tp_placement`` and ``tp_rewrite`` at each degree (with and without
sequence parallelism), then ``recompute`` and ``saved_tensors`` for each choice. So the traffic is what
the rewrite inserts and the activation bytes are what autograd keeps, not a formula. Blocks whose nodes
match op for op and shape for shape are one kind, profiled once (an 80-layer Llama: one block).
Everything stays symbolic in the model's sizes (B, S); ``PartAtDegree.times`` evaluates at a microbatch
(autoshard/planner/part_times.py).
"""

from __future__ import annotations

import copy
import operator
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import sympy
import torch
from torch import fx

from autoshard import passes
from autoshard.errors import PlanError
from autoshard.ir.meta import evaluate_expr, get_layer, get_shape
from autoshard.ir.ops import attention_dropout
from autoshard.ir.placements import Shard
from autoshard.planner import part_graph
from autoshard.planner.part_times import Comm, PartTimes, Work, part_times, value

if TYPE_CHECKING:
    from autoshard.planner.hardware import Hardware

__all__ = ["ModelProfile", "PartAtDegree", "profile_graph"]

aten = torch.ops.aten


def _is_block(layer: str) -> bool:
    return layer.rsplit(".", 1)[-1].isdigit()


@dataclass
class PartAtDegree:
    """One part of the model at one tp degree (and sequence parallelism or not), symbolic in B and S."""

    works: tuple[Work, ...]
    comms: tuple[Comm, ...]
    param_bytes: int  # what one rank holds (its shards)
    param_elements: int
    largest_param_bytes: int  # the most one ZeRO-3 gather brings at once (this part's local parameters)
    gather_groups: int  # ZeRO-3 flat groups among its parameters (one per layer): a gather and a reduce-scatter each
    sharded: bool  # the rewrite sharded at least one weight
    boundary_bytes: sympy.Expr  # what it hands to the next part (a pipeline send)
    degree: int
    graph: fx.GraphModule  # the part as rewritten for this degree
    kernels: str
    # Trainable parameters it reads that another part owns (a tied head): (target, owner part, bytes, elements)
    # of one rank's shard. A pipeline stage without the owner holds its own copy, with gradient and state.
    tied: tuple[tuple[str, str, int, int], ...] = ()
    # Its replicated weights whose gradients each rank holds a part of (sequence parallel's norms, a bias added
    # after a reduce-scatter): summed over tp once a step, after backward.
    partial_grad_bytes: int = 0
    # Its mixture-of-experts layers (passes/expert_parallel.py finds them): their count, the fewest experts of
    # one, the bytes of their expert weights (and elements), the rows each dispatch moves per call.
    moe_layers: int = 0
    experts: int = 0
    expert_param_bytes: int = 0
    expert_elements: int = 0
    dispatch_bytes: sympy.Expr = sympy.Integer(0)
    # What context parallelism moves: the bytes of K and V of each attention (the ring's blocks), and of Q
    # and the output (all-to-all attention trades all four), over the whole sequence.
    attention_kv_bytes: sympy.Expr = sympy.Integer(0)
    attention_q_bytes: sympy.Expr = sympy.Integer(0)
    held_for_w: sympy.Expr = sympy.Integer(0)  # a microbatch's bytes from its B to its W (split backward)
    w_inputs: sympy.Expr = sympy.Integer(0)  # of held_for_w: forward's saved tensors (the matmuls' inputs)
    # of both: each tied weight's matmuls' (by target), held for no W where its owner runs on the same rank
    tied_held_for_w: tuple[tuple[str, sympy.Expr, sympy.Expr], ...] = ()
    sizes: dict[str, int] = field(default_factory=dict)  # the model's example sizes (what selective weighs at)
    sequence_shards: int = 1  # sequence parallel: the hidden state it reads arrives in degree sequence shards
    _saved: dict[str, tuple[sympy.Expr, sympy.Expr, frozenset[str], sympy.Expr]] = field(default_factory=dict)
    _times: dict[tuple, PartTimes] = field(default_factory=dict)
    _at: dict[tuple, tuple[float, ...]] = field(default_factory=dict)

    def saved(self, choice: str, autocast: torch.dtype | None = None) -> tuple[sympy.Expr, sympy.Expr]:
        """(bytes kept for backward, bytes live while a region recomputes) per microbatch under ``choice``
        (run under torch.autocast in ``autocast``, when given)."""
        return self._recompute(choice, autocast)[:2]

    def at(
        self, choice: str, sizes: dict[str, int], autocast: torch.dtype | None = None
    ) -> tuple[float, float, float, float, float, float]:
        """(kept, transient, boundary, gradients in flight, held from B to W, of that forward's own saved tensors)
        bytes at ``sizes``. Under recomputation W's inputs are made again in B, no longer forward's (0)."""
        key = (choice, tuple(sorted(sizes.items())), str(autocast))
        if key not in self._at:
            kept, transient, _, in_flight = self._recompute(choice, autocast)
            terms = in_flight.args if isinstance(in_flight, sympy.Max) else (in_flight,)  # none covers another
            self._at[key] = (
                value(kept, sizes), value(transient, sizes), value(self.boundary_bytes, sizes),
                max(value(term, sizes) for term in terms), value(self.held_for_w, sizes),
                value(self.w_inputs, sizes) if choice == "none" else 0.0,
            )  # fmt: skip
        return self._at[key]

    def recompute_flops(self, choice: str, sizes: dict[str, int]) -> float:
        """Forward FLOPs ``choice`` repeats in backward, at ``sizes``."""
        key = ("flops", choice, tuple(sorted(sizes.items())))
        if key not in self._at:
            names = self.recomputed(choice) if choice not in ("none", "full") else frozenset()
            works = [w for w in self.works if choice == "full" or w.name in names]
            self._at[key] = (sum(value(w.flops_fwd, sizes) for w in works), 0.0, 0.0)
        return self._at[key][0]

    def recomputed(self, choice: str) -> frozenset[str]:
        """The nodes ``choice`` repeats in backward."""
        return self._recompute(choice)[2]

    def _recompute(
        self, choice: str, autocast: torch.dtype | None = None
    ) -> tuple[sympy.Expr, sympy.Expr, frozenset[str], sympy.Expr]:
        key = f"{choice}/{autocast}"
        if key not in self._saved:
            has_block = any(_is_block(get_layer(n)) for n in self.graph.graph.nodes if n.op == "call_function")
            if choice != "none" and not has_block:
                self._saved[key] = self._recompute("none", autocast)
            else:
                g = copy.deepcopy(self.graph)
                passes.run_pass(passes.recompute.PASS, g, choice, self.kernels, self.sizes, autocast is None)
                shards = self.sequence_shards
                memory = passes.run_pass(passes.saved_tensors.PASS, g, self.kernels, True, autocast, shards).value
                in_flight = passes.run_pass(passes.gradients_in_flight.PASS, g).value
                self._saved[key] = (memory.kept, memory.transient, part_graph.recomputed(g), in_flight)
        return self._saved[key]

    def times(self, sizes: dict[str, int], hw: Hardware, dtype: torch.dtype) -> PartTimes:
        """One microbatch of ``sizes`` (B: its rows) on one rank of ``hw``."""
        key = (tuple(sorted(sizes.items())), id(hw), str(dtype))
        if key not in self._times:
            self._times[key] = part_times(self, sizes, hw, dtype)
        return self._times[key]


def _profile_part(
    sub: fx.GraphModule,
    owned: frozenset[str],
    owners: dict[str, str],
    degree: int,
    sp: bool,
    sizes: dict[str, int],
    kernels: str,
    hands_on: bool = True,
) -> PartAtDegree:
    """``hands_on``: another part reads its outputs (the last part's are the model's, returned as they are)."""
    g = copy.deepcopy(sub)
    sharded = False
    partial: tuple[str, ...] = ()
    if degree > 1:
        report = passes.run_pass(passes.tp_placement.PASS, g, degree, sp, sizes).value
        sharded = any(isinstance(p, Shard) for p in report.weights.values())
        partial = passes.run_pass(passes.tp_rewrite.PASS, g, degree, sp).value
        passes.run_pass(passes.cost_model.PASS, g)  # FLOPs of the local shapes
    works, comms = part_graph.works(g), part_graph.comms(g, hands_on)
    param_bytes, elements, largest, groups, tied = part_graph.local_params(g, owned, owners)
    out_node = next(n for n in g.graph.nodes if n.op == "output")
    boundary = sympy.Add(
        *(get_shape(v).nbytes for v in out_node.args[0] if isinstance(v, fx.Node) and get_shape(v).requires_grad)
    )
    attrs = {n.target: n for n in g.graph.nodes if n.op == "get_attr" and n.target in owned}
    partial_bytes = sum(int(evaluate_expr(get_shape(attrs[t]).nbytes, {})) for t in partial if t in attrs)
    part = PartAtDegree(works, comms, param_bytes, elements, largest, groups, sharded, boundary, degree, g, kernels,
                        tied, partial_bytes, sizes=sizes, sequence_shards=degree if sp else 1)  # fmt: skip
    if degree == 1:  # ep works with tp=1
        _experts(part, g, owned)
    part.attention_kv_bytes = _attention_bytes(g, slice(1, 3))
    part.attention_q_bytes = _attention_bytes(g, slice(0, 1))
    part.held_for_w, part.w_inputs = part_graph.held_for_w(g)
    part.tied_held_for_w = tuple(
        (target, sympy.expand(part.held_for_w - held), sympy.expand(part.w_inputs - saved))
        for target, *_ in tied
        for held, saved in [part_graph.held_for_w(g, frozenset({target}))]
    )
    return part


def _attention_bytes(g: fx.GraphModule, operands: slice) -> sympy.Expr:
    """Bytes of these inputs of the part's attentions (scaled_dot_product_attention's q, k, v)."""
    kv = [
        get_shape(a).tensor.nbytes
        for n in g.graph.nodes
        if n.op == "call_function" and "scaled_dot_product" in str(n.target)
        for a in n.args[operands]
        if isinstance(a, fx.Node)
    ]
    return sympy.Add(*kv)


def _experts(part: PartAtDegree, g: fx.GraphModule, owned: frozenset[str]) -> None:
    """Fill in the part's MoE layers (none where the pass does not recognise them: ep will refuse)."""
    try:
        layers, loops = passes.expert_parallel.find_layers(g), passes.expert_parallel.find_loops(g)
    except PlanError:
        return
    experts = [e for loop in loops for e in loop.experts]  # a loop's: each expert's own weights and rows
    weights = {w.target: w for layer in layers for w in layer.weights if w.target in owned}
    weights |= {w.target: w for e in experts for w in e.weights if w.target in owned}
    shapes = [get_shape(w).tensor for w in weights.values()]
    part.moe_layers = len(layers) + len(loops)
    part.experts = min([layer.experts for layer in layers] + [loop.num_experts for loop in loops], default=0)
    part.expert_param_bytes = sum(int(evaluate_expr(t.nbytes, {})) for t in shapes)
    part.expert_elements = sum(int(evaluate_expr(t.numel, {})) for t in shapes)
    rows = [layer.rows for layer in layers] + [e.rows for e in experts]
    part.dispatch_bytes = sympy.Add(*(get_shape(r).tensor.nbytes for r in rows))


@dataclass
class ModelProfile:
    """The parts of one model and their profiles per (tp degree, sequence parallel), made on demand."""

    parts: dict[str, fx.GraphModule]  # "pre", one per block kind ("block 0", ...), "post"
    owned: dict[str, frozenset[str]]  # per part, the parameters it owns (get_attr targets)
    tied: dict[str, dict[str, str]]  # per part, the parameters it reads that another part owns: their owner
    blocks: tuple[str, ...]  # the block kind of each repeated block, in order
    block_names: tuple[str, ...]
    heads: int  # attention heads (0: no attention found)
    kv_heads: int  # the keys' and values' heads (fewer under grouped-query attention)
    attention_dropout: bool  # some attention drops probabilities (ring attention under cp does not draw them)
    sizes: dict[str, int]
    kernels: str
    model_flops: float  # forward + backward FLOPs of one step at ``sizes`` (no recomputation)
    model_dtype: torch.dtype
    _cache: dict[tuple, PartAtDegree] = field(default_factory=dict)

    def part(self, name: str, degree: int, sp: bool) -> PartAtDegree:
        key = (name, degree, sp and degree > 1)
        if key not in self._cache:
            part = self.parts[name]
            self._cache[key] = _profile_part(part, self.owned[name], self.tied[name], degree, key[2], self.sizes,
                                             self.kernels, hands_on=name != "post")  # fmt: skip
        return self._cache[key]

    @property
    def experts(self) -> int:
        """The fewest experts of any MoE layer (0: no MoE layer that ep can split)."""
        counts = [self.part(name, 1, False).experts for name in self.parts]
        return min((c for c in counts if c), default=0)

    def shards(self, degree: int) -> bool:
        """tp at this degree shards some weight of every block kind."""
        return all(self.part(kind, degree, False).sharded for kind in dict.fromkeys(self.blocks))


def _signature(nodes: list[fx.Node]) -> tuple:
    return tuple((str(n.target) if n.op == "call_function" else n.op, str(get_shape(n))) for n in nodes)


def _attention_dropout(gm: fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        if node.op == "call_function" and "scaled_dot_product" in str(node.target):
            if attention_dropout(node.args, node.kwargs) not in (0, 0.0, None):
                return True
    return False


def _heads(gm: fx.GraphModule, operand: int = 0) -> int:
    """The heads of the first attention's query (``operand`` 1: its keys', fewer under grouped-query attention)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and "scaled_dot_product" in str(node.target):
            q = get_shape(node.args[operand]).tensors[0]
            if len(q.sizes) >= 3:
                return int(q.sizes[-3]) if q.sizes[-3].is_number else 0
    return 0


_CACHE: OrderedDict[tuple, ModelProfile] = OrderedDict()
_CACHE_SIZE = 8  # profiles kept: a process compiles the same model for several plans (every rank, tests)


def _graph_key(gm: fx.GraphModule) -> tuple:
    """What a profile depends on: every node's op, target, arguments, layer, shape and, for a tensor it
    reads, whether that tensor needs grad."""
    key = []
    for n in gm.graph.nodes:
        grad = getattr(operator.attrgetter(n.target)(gm), "requires_grad", None) if n.op == "get_attr" else None
        shape = str(get_shape(n)) if n.op != "output" else ""
        layer = get_layer(n) if n.op != "output" else ""
        key.append((n.op, str(n.target), str(n.args), str(n.kwargs), shape, layer, grad))
    return tuple(key)


def profile_graph(gm: fx.GraphModule, sizes: dict[str, int], kernels: str, model_flops: float) -> ModelProfile:
    """Cut the analysed graph into its parts (nothing is profiled until a degree is asked for); the profile
    of a graph profiled before (same nodes, shapes and sizes) is reused."""
    key = (_graph_key(gm), tuple(sorted(sizes.items())), kernels, model_flops)
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    profile = _profile(gm, sizes, kernels, model_flops)
    _CACHE[key] = profile
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return profile


def _profile(gm: fx.GraphModule, sizes: dict[str, int], kernels: str, model_flops: float) -> ModelProfile:
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "get_attr")]
    layers = [get_layer(n) for n in nodes]
    block_layers = list(dict.fromkeys(layer for layer in layers if _is_block(layer)))
    computes = [i for i, n in enumerate(nodes) if n.op == "call_function" and _is_block(layers[i])]
    first, last = (computes[0], computes[-1]) if computes else (len(nodes), len(nodes) - 1)
    outside = [i for i, layer in enumerate(layers) if not _is_block(layer)]
    post_compute = {nodes[i] for i in outside if i >= first}
    # A parameter belongs to the end that reads it: export puts every get_attr first, and the final norm's
    # or the head's weights on the first stage would be charged to the wrong pipeline rank.
    late = {
        nodes[i] for i in outside
        if i < first and nodes[i].op == "get_attr" and nodes[i].users and set(nodes[i].users) <= post_compute
    }  # fmt: skip
    pre = [nodes[i] for i in outside if i < first and nodes[i] not in late]
    post = [nodes[i] for i in outside if i >= first or nodes[i] in late]
    parts: dict[str, fx.GraphModule] = {}
    owned: dict[str, frozenset[str]] = {}

    tied: dict[str, dict[str, str]] = {}
    taken: dict[int, str] = {}  # parameters already owned, by whom (a tied weight: the first part reading it)

    def add(name: str, members: list[fx.Node]) -> None:
        parts[name] = part_graph.extract(gm, members)
        mine = set()
        # The name the part reads first: export may leave another name of a tied weight dangling (GPT-2's
        # wte beside the lm_head name its embedding reads), whose placement no rule decides.
        for n in sorted(members, key=lambda n: not n.users):
            if n.op == "get_attr":
                key = id(operator.attrgetter(n.target)(gm))
                if key not in taken:
                    taken[key] = name
                    mine.add(n.target)
        owned[name] = frozenset(mine)
        # What the part reads (its extracted graph pulls in the get_attrs it needs) that an earlier part owns.
        reads = {n.target for n in parts[name].graph.nodes if n.op == "get_attr"}
        owner = {t: taken.get(id(operator.attrgetter(t)(gm))) for t in reads}
        tied[name] = {t: o for t, o in owner.items() if o is not None and o != name}

    if pre:
        add("pre", pre)
    kinds: dict[tuple, str] = {}
    blocks = []
    for layer in block_layers:
        members = [n for n, name in zip(nodes, layers) if name == layer]
        signature = _signature(members)
        if signature not in kinds:
            kinds[signature] = f"block {len(kinds)}"
            add(kinds[signature], members)
        blocks.append(kinds[signature])
    if post:
        add("post", post)
    dtype = next((get_shape(n).tensors[0].dtype for n in nodes if n.op == "get_attr" and get_shape(n).tensors),
                 torch.float32)  # fmt: skip
    return ModelProfile(
        parts,
        owned,
        tied,
        tuple(blocks),
        tuple(block_layers),
        _heads(gm),
        _heads(gm, 1),
        _attention_dropout(gm),
        dict(sizes),
        kernels,
        model_flops,
        dtype,
    )
