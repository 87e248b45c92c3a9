"""ZeRO-3 rewrite: gather a layer's parameters before their first use, free them after their last.

Reads:  autoshard.zero_group (get_attr nodes), autoshard.shape
Writes: autoshard.zero3 (meta.Zero3Gather) on each gather node; replaces parameter get_attr nodes

Before::

    w = get_attr[model.h.0.fc.weight]
    y = aten.linear(x, w, b)
    z = aten.gelu(y)

After::

    zero3 = get_attr[zero3]                      # the rank's Zero3Runtime: shards, buffers
    params_3 = zero.gather(zero3, 3)             # all-gather group 3 (and prefetch group 4)
    w = params_3[0]; b = params_3[1]
    y = aten.linear(x, w, b)
    y_1 = zero.mark(y, zero3, 3, True)           # last use: free group 3; in backward, gather it again
    z = aten.gelu(y_1)

Every op that reads a group's parameters (through views) gets a mark on its output, so that in
backward the group is gathered again before any such op's backward runs; the last one in forward
also frees the group. The gather's backward reduce-scatters the group's gradients.
"""

from __future__ import annotations

import operator

from torch import fx

from autoshard.graph_ops import zero
from autoshard.ir.meta import LAYER, SHAPE, ZERO3, ZERO_GROUP, NodeShape, Zero3Gather, get_shape, get_zero_group
from autoshard.ir.ops import ALIASING, packet

from .infra import PARAMETERS, Need, Pass, PassResult, calls_to

__all__ = ["PASS", "RUNTIME_ATTR", "run"]

RUNTIME_ATTR = "zero3"


def _consumers(node: fx.Node) -> list[fx.Node]:
    """Ops that read ``node``'s data, looking through views of it."""
    out: list[fx.Node] = []
    for user in node.users:
        if user.op == "call_function" and packet(user.target) in ALIASING:
            out.extend(_consumers(user))
        elif user.op != "output":
            out.append(user)
    return out


def _marked_outputs(node: fx.Node) -> list[fx.Node]:
    """The tensors to mark for a consumer: itself, or its getitem users when it returns several."""
    if len(get_shape(node).tensors) == 1:
        return [node]
    return [u for u in node.users if u.op == "call_function" and u.target is operator.getitem]


def run(gm: fx.GraphModule) -> PassResult:
    graph = gm.graph
    by_group: dict[int, dict[int, list[fx.Node]]] = {}
    slots: dict[int, object] = {}
    for node in graph.nodes:
        if node.op == "get_attr" and ZERO_GROUP in node.meta:
            slot = get_zero_group(node)
            param_key = id(gm.get_parameter(node.target))
            by_group.setdefault(slot.group, {}).setdefault(param_key, []).append(node)
            slots[param_key] = slot
    if not by_group:
        return PassResult("zero3_gather_free", False, "no parameters to shard")

    position = {node: i for i, node in enumerate(graph.nodes)}
    first_compute = next(n for n in graph.nodes if n.op not in ("placeholder", "get_attr"))
    # A Program replaces this with the rank's Zero3Runtime (shards, buffers, process group).
    gm.add_submodule(RUNTIME_ATTR, zero.UnboundZero3Runtime())
    with graph.inserting_before(first_compute):
        runtime = graph.get_attr(RUNTIME_ATTR)
    runtime.meta.update({SHAPE: NodeShape(), LAYER: "(top)"})
    inserted = 0
    for group in sorted(by_group):
        params = sorted(by_group[group].items(), key=lambda item: slots[item[0]].offset)
        uses = [u for _, nodes in params for n in nodes for u in n.users]
        first_use = min(uses, key=position.__getitem__)
        with graph.inserting_before(first_use):
            gathered = graph.call_function(zero.gather, (runtime, group))
            gathered.meta[SHAPE] = NodeShape(tensors=tuple(get_shape(nodes[0]).tensor for _, nodes in params))
            gathered.meta[LAYER] = params[0][1][0].meta.get(LAYER, "(top)")
            gathered.meta[ZERO3] = Zero3Gather(
                group=group,
                targets=tuple(nodes[0].target for _, nodes in params),
                offsets=tuple(slots[key].offset for key, _ in params),
                numels=tuple(slots[key].numel for key, _ in params),
            )
            views = []
            for index, (_, nodes) in enumerate(params):
                view = graph.call_function(operator.getitem, (gathered, index))
                view.meta.update({k: v for k, v in nodes[0].meta.items() if k != ZERO_GROUP})
                views.append(view)
        consumers: list[fx.Node] = []
        for view, (_, nodes) in zip(views, params):
            for node in nodes:
                node.replace_all_uses_with(view)
                graph.erase_node(node)
            consumers.extend(_consumers(view))
        outputs = sorted({o for c in consumers for o in _marked_outputs(c)}, key=position.__getitem__)
        last = max(consumers, key=position.__getitem__)
        last_outputs = set(_marked_outputs(last))
        for out in outputs:
            free = out in last_outputs and out is max(last_outputs, key=position.__getitem__)
            with graph.inserting_after(out):
                marked = graph.call_function(zero.mark, (out, runtime, group, free))
            marked.meta.update(out.meta)
            out.replace_all_uses_with(marked, delete_user_cb=lambda user, m=marked: user is not m)
            inserted += 1
        inserted += 1 + len(views)
    graph.lint()
    gm.recompile()
    return PassResult(
        "zero3_gather_free", True, f"{len(by_group)} groups gathered and freed, {inserted} nodes inserted"
    )


PASS = Pass(
    "zero3_gather_free",
    reads=(Need(ZERO_GROUP, PARAMETERS), Need(SHAPE)),
    writes=(Need(ZERO3, calls_to("ZeRO-3 gather nodes", zero.gather)),),
    run=run,
)
