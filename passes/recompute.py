"""Activation recomputation: regions whose activations are recomputed in backward instead of kept.

Reads:  autoshard.layer, autoshard.shape; autoshard.user_recompute (written at capture on the nodes of
        the model's own torch.utils.checkpoint calls); autoshard.cost (forward FLOPs: what a region repeats)
Writes: autoshard.recompute (meta.RecomputeRegion: with the bytes it frees and the FLOPs it repeats) on each
        region's call node

Each region becomes a submodule of the graph, called through ``graph_ops.recompute.region``, which
keeps only the region's inputs for backward and recomputes the rest just before the region's
backward runs. The choice (``Plan.recompute``):

    "full"         each repeated block (a layer named ``... .<index>``) is one region
    "selective"    within each block, every run of ops between the ones worth keeping that holds
                   attention (a product of two activations, a softmax) is a region; kept are matmuls
                   with a weight (FLOP-heavy) and communication (a collective is not repeated);
                   recomputed are attention scores, softmax, attention dropout and the pointwise ops
                   between them (Korthikanti et al.'s selective recomputation: the core attention), where
                   that frees at least as many bytes per FLOP repeated as recomputing the whole block:
                   weighed on what each kernel really keeps (``Deals``), so a fused attention kernel,
                   which keeps its inputs and a log-sum-exp, is kept
    0 < share < 1  the spans of each block that keep at most that share of the bytes autograd keeps, at the
                   least work repeated: FLOPs, and bytes moved (passes/recompute_budget.py); and matmuls
                   whose saved input its producer (a norm, an activation) makes again in backward, each
                   rewritten into a ``recompute.input_recomputed`` call
    (names, ...)   those blocks, each one region
    "none"         no region but the model's own torch.utils.checkpoint calls, which every choice honours

Before (one GPT-2 block, "full")::

    layer_norm = aten.layer_norm(add_3, [32], w_1, b_1)
    ...
    add_5 = aten.add(add_4, dropout_3)

After::

    recompute_0 = get_attr[recompute_0]                      # the block's nodes, as a graph
    region = recompute.region(recompute_0, None, add_3, w_1, b_1, ...)  # None: no ZeRO-3 runtime
    add_5 = region[0]                                        # what later nodes read
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import sympy
import torch
from torch import fx

from autoshard.errors import PlanError
from autoshard.graph_ops import pipeline, recompute, zero
from autoshard.graph_ops import tp as tp_ops
from autoshard.ir.meta import (
    LAYER,
    RECOMPUTE,
    SHAPE,
    USER_RECOMPUTE,
    NodeShape,
    RecomputeRegion,
    evaluate_expr,
    get_layer,
)
from autoshard.ir.ops import ALIASING, packet, runs
from autoshard.sharding.matmul import matmul_dims

from . import recompute_budget, saved_tensors
from .infra import Need, Pass, PassResult, calls_to
from .recompute_budget import Deals, InputRecipe, is_gathered

__all__ = ["PASS", "Deals", "blocks", "run"]

log = logging.getLogger(__name__)

aten = torch.ops.aten

# Runtime ops a region never contains: sends and receives happen once; communication is kept.
_NEVER = {pipeline.recv, pipeline.send, pipeline.size}
_COMMUNICATION = {
    tp_ops.all_reduce, tp_ops.copy, tp_ops.all_gather, tp_ops.scatter, tp_ops.reduce_scatter, tp_ops.gather_rs,
    tp_ops.vocab_parallel_embedding, tp_ops.vocab_parallel_cross_entropy, zero.gather, zero.mark,
}  # fmt: skip


def blocks(gm: fx.GraphModule) -> list[str]:
    """The repeated blocks (layers named ``... .<index>``) in graph order."""
    names = dict.fromkeys(get_layer(n) for n in gm.graph.nodes if n.op == "call_function")
    return [name for name in names if name.rsplit(".", 1)[-1].isdigit()]


def _view_root(node: Any) -> Any:
    """What ``node`` views: past aliasing ops and tp copies, to a parameter, a ZeRO-3 gather's output, or else."""
    for _ in range(32):
        if not isinstance(node, fx.Node) or node.op != "call_function" or is_gathered(node):
            return node
        if packet(node.target) not in ALIASING | {tp_ops.copy}:
            return node
        node = node.args[0]
    return node


def _reads_weight(node: Any) -> bool:
    """Whether a matmul operand is a trainable parameter (through views, or a ZeRO-3 gather)."""
    root = _view_root(node)
    if not isinstance(root, fx.Node):
        return False
    return is_gathered(root) or (root.op == "get_attr" and root.meta.get(SHAPE, NodeShape()).requires_grad)


def _kept(node: fx.Node) -> bool:
    """Selective recomputation keeps this node's output (a weight matmul, or communication)."""
    op, args = runs(node)  # through a zero-bubble matmul: the matmul
    dims = matmul_dims(op)
    return node.target in _COMMUNICATION or (dims is not None and _reads_weight(args[dims[1]]))


_ATTENTION = {aten.softmax, aten._softmax, aten._safe_softmax, aten.scaled_dot_product_attention}


def _attention(node: fx.Node) -> bool:
    """A product of two activations (a kept matmul never gets here), a softmax, or fused attention: what
    selective recomputation is for (S**2 bytes per head, few FLOPs)."""
    target = runs(node)[0]
    return packet(target) in _ATTENTION or matmul_dims(target) is not None


def _candidates(gm: fx.GraphModule, choice: Any) -> list[list[fx.Node]]:
    """The regions' nodes before closure, in graph order: per block (full), the runs between kept nodes of
    a block (selective), and the model's own checkpointed regions outside those."""
    names = blocks(gm)
    if isinstance(choice, tuple):
        unknown = [b for b in choice if b not in names]
        if unknown:
            raise PlanError(f"recompute names {unknown}, which are not blocks of this graph; the blocks are {names}")
    fine = choice == "selective" or isinstance(choice, float)  # runs between the kept matmuls, not whole blocks
    chosen = (
        set(names) if choice in ("full", "selective") or fine else set(choice) if isinstance(choice, tuple) else set()
    )
    runs: list[list[fx.Node]] = [[]]
    user: dict[int, list[fx.Node]] = {}
    key: Any = None  # the block the current run belongs to
    in_run: set[fx.Node] = set()
    position = {}
    for index, node in enumerate(gm.graph.nodes):
        position[node] = index
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        layer = get_layer(node)
        own = USER_RECOMPUTE in node.meta and (layer not in chosen or fine)  # the model's own checkpoint, whole
        if own:
            user.setdefault(node.meta[USER_RECOMPUTE], []).append(node)
        inside = layer in chosen and node.target not in _NEVER and not (fine and (_kept(node) or own))
        if inside and layer == key:
            runs[-1].append(node)
            in_run.add(node)
            continue
        if not inside and key is not None and USER_RECOMPUTE not in node.meta:
            if not any(a in in_run for a in node.all_input_nodes):
                # It does not read the run (a size from the pipe, a mask a later stage recomputes from the
                # inputs): it stays before the region, which takes it as an input, and the run goes on.
                continue
        runs.append([node] if inside else [])
        in_run = set(runs[-1])
        key = layer if inside else None
    # A run of views and sizes alone keeps nothing worth recomputing; selective recomputation takes only
    # the runs that hold attention. A norm or activation between two kept matmuls would cost its
    # recomputation and save nothing (the matmul after it keeps its input anyway); a hidden dropout with the
    # residual add and norm after it would save its one-byte mask per element and draw the mask again.
    if choice == "selective":
        runs = [r for r in runs if any(_attention(n) for n in r)]
    regions = [r for r in [*runs, *user.values()] if any(packet(n.target) not in ALIASING for n in r)]
    return sorted(regions, key=lambda r: position[r[0]])


def _worth_it(gm: fx.GraphModule, runs: list[list[fx.Node]], deals: Deals, sizes: dict[str, int]) -> list:
    """The attention runs that free at least as many bytes per FLOP repeated as recomputing their whole block
    does (what "full" trades): an attention whose kernel keeps its score matrices is recomputed; a fused one,
    which keeps its inputs and a log-sum-exp, frees almost nothing for a second attention forward and is kept."""
    blocks: dict[str, list[fx.Node]] = {}  # what "full" recomputes of each block
    for run in _candidates(gm, "full"):
        blocks.setdefault(get_layer(run[0]), []).extend(run)
    of_block = {
        layer: (evaluate_expr(deals.freed(nodes), sizes), evaluate_expr(deals.flops(nodes), sizes))
        for layer, nodes in blocks.items()
    }
    chosen = []
    for run in runs:
        layer = get_layer(run[0])
        if USER_RECOMPUTE in run[0].meta:  # the model's own checkpoint: every choice honours it
            chosen.append(run)
            continue
        freed, flops = evaluate_expr(deals.freed(run), sizes), evaluate_expr(deals.flops(run), sizes)
        block_freed, block_flops = of_block[layer]
        if freed > 0 and (block_freed <= 0 or freed * block_flops >= block_freed * flops):
            chosen.append(run)
    return chosen


def _closure(nodes: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]] | None:
    """(region, nodes to move after it): the region grown by the nodes between its first and last node that
    depend on it and that it depends on; None when that cannot be one call (nothing here makes it so)."""
    members = set(nodes)
    span, node = [], nodes[0]
    while True:
        span.append(node)
        if node is nodes[-1]:
            break
        node = node.next
    after: set[fx.Node] = set()
    for n in span:  # depends on the region
        if n not in members and any(a in members or a in after for a in n.all_input_nodes):
            after.add(n)
    before: set[fx.Node] = set()
    for n in reversed(span):  # the region depends on it
        if n not in members and any(u in members or u in before for u in n.users):
            before.add(n)
    region = [n for n in span if n in members or (n in after and n in before)]
    if any(n.op == "call_function" and n.target in _NEVER for n in region):
        return None
    return region, [n for n in span if n in after and n not in before]


def _outline(gm: fx.GraphModule, region: list[fx.Node], move: list[fx.Node], name: str, deals: Deals | None) -> fx.Node:
    members = set(region)
    inputs = list(dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in members))
    # The ZeRO-3 runtime, if any: the gathered parameters the region reads are gathered again before it replays.
    zero3 = next((n.args[0] for n in gm.graph.nodes if n.op == "call_function" and n.target is zero.gather), None)
    outputs = [n for n in region if any(u not in members for u in n.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for value in inputs:
        env[value] = sub.placeholder(value.name)
        env[value].meta.update(value.meta)
    for node in region:
        env[node] = sub.node_copy(node, lambda a: env[a])
    sub.output(tuple(env[n] for n in outputs))
    gm.add_submodule(name, fx.GraphModule(gm, sub, class_name="RecomputeRegion"))
    graph, last = gm.graph, region[-1]
    layer = get_layer(region[0])
    with graph.inserting_after(last):
        attr = graph.get_attr(name)
    attr.meta.update({SHAPE: NodeShape(), LAYER: layer})
    with graph.inserting_after(attr):
        call = graph.call_function(recompute.region, (attr, zero3, *inputs))
    call.meta.update({SHAPE: NodeShape(), LAYER: layer})
    freed, flops = (deals.freed(region), deals.flops(region)) if deals is not None else (sympy.Integer(0),) * 2
    call.meta[RECOMPUTE] = RecomputeRegion(name, layer, len(region), tuple(n.name for n in inputs), freed, flops)
    anchor = call
    for index, out in enumerate(outputs):
        with graph.inserting_after(anchor):
            anchor = graph.call_function(operator.getitem, (call, index))
        anchor.meta.update(out.meta)
        out.replace_all_uses_with(anchor, delete_user_cb=lambda user: user not in members)
    for node in move:  # what read the region's outputs in between now follows the call
        anchor.append(node)
        anchor = node
    for node in reversed(region):
        graph.erase_node(node)
    return call


def _remake_input(recipe: InputRecipe, name: str, deals: Deals) -> RecomputeRegion:
    """Each matmul of ``recipe`` becomes an input_recomputed call, told what makes its saved input again."""
    producer, calls = recipe.producer, []
    for node in recipe.consumers:
        graph = node.graph
        with graph.inserting_before(node):
            call = graph.call_function(
                recompute.input_recomputed,
                (
                    recompute.callable_name(node.target),
                    producer,
                    producer.target,
                    producer.args,
                    producer.kwargs,
                    *node.args,
                ),  # fmt: skip
                dict(node.kwargs),
            )
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        calls.append(call)
    inputs = tuple(a.name for a in producer.all_input_nodes)
    freed, flops = deals.freed(recipe), deals.flops(recipe)
    made = RecomputeRegion(name, get_layer(producer), 1, inputs, freed, flops, remade=producer.name)
    calls[0].meta[RECOMPUTE] = made  # once a recipe, on its first matmul (what explain() and the planner read)
    return made


def run(
    gm: fx.GraphModule,
    choice: Any,
    device_type: str = "cpu",
    sizes: dict[str, int] | None = None,
    remade_inputs: bool = True,
) -> PassResult:
    """``choice``: Plan.recompute; ``device_type``: whose kernels run ("cpu" or "cuda": what they keep differs);
    ``sizes``: the sizes selective recomputation weighs its choices at (B cancels out; S does not);
    ``remade_inputs``: whether a budget may make matmuls' inputs again (not under autocast, where a matmul
    keeps its own cast copy of the input). The value: the RecomputeRegion of each region made."""
    made = []
    candidates = _candidates(gm, choice)
    deals = Deals(gm, device_type) if candidates else None
    if choice == "selective" and deals is not None:
        found = len(candidates)
        candidates = _worth_it(gm, candidates, deals, sizes or saved_tensors.PROBE)
        log.info("selective recomputation: %d of %d attention runs worth recomputing", len(candidates), found)
    elif isinstance(choice, float):
        deals = deals or Deals(gm, device_type)
        user = [r for r in candidates if USER_RECOMPUTE in r[0].meta]
        at = sizes or saved_tensors.PROBE
        candidates = recompute_budget.choose(
            _candidates(gm, "full"), user, deals, choice, at, _kept, device_type, remade_inputs
        )
    for recipe in [c for c in candidates if isinstance(c, InputRecipe)]:
        made.append(_remake_input(recipe, f"recompute_{len(made)}", deals))
    for nodes in [c for c in candidates if not isinstance(c, InputRecipe)]:  # (freed bytes as the graph stood)
        closed = _closure(nodes)
        if closed is not None:
            call = _outline(gm, *closed, f"recompute_{len(made)}", deals)
            made.append(call.meta[RECOMPUTE])
    gm.graph.lint()
    gm.recompile()
    layers = sorted({r.layer for r in made})
    kind = choice if isinstance(choice, str) else f"budget {choice}" if isinstance(choice, float) else "blocks"
    remade = sum(1 for r in made if r.remade)
    summary = f"{len(made) - remade} recompute regions in {len(layers)} layers ({kind})"
    summary += f", {remade} matmul inputs made again" if remade else ""
    return PassResult("recompute", bool(made), summary, value=made)


PASS = Pass(
    "recompute",
    reads=(Need(LAYER), Need(SHAPE)),
    writes=(Need(RECOMPUTE, calls_to("recompute region calls", recompute.region)),),
    run=run,
)
