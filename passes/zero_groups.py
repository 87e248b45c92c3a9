"""ZeRO-3 gather groups: the parameters of one layer form one flat group, gathered and freed together.

Reads:  autoshard.layer (of get_attr nodes), autoshard.shape
Writes: autoshard.zero_group (meta.FlatSlot) on the get_attr nodes of trainable parameters

Groups are numbered in order of first use in forward, so "the next group" is the one to prefetch
in forward and "the previous group" the one to prefetch in backward. A parameter reached through
several get_attr nodes (tied weights) belongs to the group of its first use.
"""

from __future__ import annotations

from torch import fx

from autoshard.meta import ZERO_GROUP, FlatSlot, get_layer, get_shape

from .infra import PassResult

__all__ = ["READS", "WRITES", "run"]

READS = ("autoshard.layer", "autoshard.shape")
WRITES = (ZERO_GROUP,)


def run(gm: fx.GraphModule) -> PassResult:
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    first_use: dict[int, int] = {}
    layer_of: dict[int, str] = {}
    nodes_of: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not node.users:
            continue
        try:
            param = gm.get_parameter(node.target)
        except AttributeError:
            continue
        if not param.requires_grad:
            continue
        key = id(param)
        use = min(position[user] for user in node.users)
        if key not in first_use or use < first_use[key]:
            first_use[key] = use
            layer_of[key] = get_layer(node)
        nodes_of.setdefault(key, []).append(node)

    layer_first: dict[str, int] = {}
    for key, use in first_use.items():
        layer_first[layer_of[key]] = min(layer_first.get(layer_of[key], use), use)
    group_of_layer = {layer: g for g, layer in enumerate(sorted(layer_first, key=layer_first.get))}
    offsets = [0] * len(group_of_layer)
    for key in sorted(first_use, key=first_use.get):
        group = group_of_layer[layer_of[key]]
        numel = int(get_shape(nodes_of[key][0]).tensor.numel)
        slot = FlatSlot(group=group, offset=offsets[group], numel=numel)
        for node in nodes_of[key]:
            node.meta[ZERO_GROUP] = slot
        offsets[group] += numel
    return PassResult("zero_groups", False, f"{len(first_use)} parameters in {len(group_of_layer)} gather groups")
